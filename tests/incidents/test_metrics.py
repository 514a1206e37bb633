"""/metrics: Prometheus text from live state (ledger pool counts, workers' gauges, indexed DB reads) and the
deployment's Redis-aggregated counters and histograms, behind a bearer token (generated on first run), one rendering per
KVSERVE_METRICS_CACHE_S for any number of scrapers, and O(1) Redis commands per pool whatever its size and
whatever the traffic was (no page scan, no table scan)."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import redis
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from django.contrib.auth.models import User

from incidents.metrics import ScrapeCache, metrics_render, scrape_cache
from incidents.models import CanaryRun
from incidents.services import incident_record, incident_resolve
from inference.engine import Engine, EngineConfig
from inference.metrics import FAMILIES, WorkerMetrics
from inference.registry import Registry
from inference.sequence import SamplingParams, Sequence, SeqStatus
from kvserve.chat.metrics import (admission_rejection_count_incr, admission_rejection_counts, chat_metrics_decoded,
                                  chat_metrics_prefilled, chat_metrics_refused)
from kvserve.tenants.models import Tenant
from kvserve.paths import BASE_DIR
from tests.incidents.helpers import chat_request, live_worker

MODEL = "SmolLM2-135M-Instruct"  # the served model's name: the model_name label

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


@pytest.fixture(autouse=True)
def fresh_scrapes(settings):
    settings.KVSERVE_METRICS_CACHE_S = 0  # these tests follow state scrape by scrape; caching is tested below


def scrape(client, **headers) -> dict:
    """The samples of one /metrics rendering, with the deployment's token unless `headers` say otherwise."""
    from django.conf import settings

    headers.setdefault("HTTP_AUTHORIZATION", f"Bearer {settings.KVSERVE_METRICS_TOKEN}")
    response = client.get("/metrics", **headers)
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _row(tenant, **fields):
    now = timezone.now()
    return chat_request(tenant, model=MODEL, prompt_tokens=40, **fields, **{
        k: now + timedelta(seconds=s) for k, s in (("prefill_started_at", 0.3), ("prefill_finished_at", 0.5),
                                                   ("decode_started_at", 0.6), ("finished_at", 2.1))})


def test_metrics_read_live_state(client, registry, make_worker, tiny_model, django_capture_on_commit_callbacks):
    tenant = Tenant.objects.create(name="acme")
    decode = live_worker(registry, make_worker, "decode", worker_id="decode-1", num_pages=10)
    live_worker(registry, make_worker, "prefill", worker_id="prefill-1", num_pages=512, dtype="bfloat16",
                page_shape=[30, 2, 16, 3, 64])
    decode.allocate("r1", 3)
    for status in ("queued", "queued", "decoding", "done", "failed"):
        chat_request(tenant, status=status)
    done = _row(tenant, status="done")
    done.created_at = done.prefill_started_at - timedelta(seconds=0.3)
    chat_metrics_prefilled(done, "OK", cached_tokens=32)
    seq = Sequence(done.id, [1, 2, 3], SamplingParams(max_tokens=4))
    seq.status, seq.finish_reason, seq.transfer_ms = SeqStatus.FINISHED, "length", 4.0
    chat_metrics_decoded(done, seq)
    chat_metrics_prefilled(_row(tenant, status="rejected"), "REJECTED")
    chat_metrics_refused(_row(tenant, status="failed"), "handoff_forged")
    admission_rejection_count_incr()
    admission_rejection_count_incr()
    incident_record(kind="foreign_read", severity="critical", detected_by="t")
    incident_record(kind="lease_expired", severity="warning", detected_by="t")
    resolved = incident_record(kind="lease_expired", severity="warning", detected_by="t")
    with django_capture_on_commit_callbacks(execute=True):  # counted once the resolution commits
        incident_resolve(incident=resolved, by_user=None)
    now = timezone.now()
    CanaryRun.objects.create(started_at=now - timedelta(minutes=5), passed=True, checks=[])
    CanaryRun.objects.create(started_at=now, passed=False, checks=[
        {"name": "marker_scan", "passed": True, "duration_s": 0.5, "details": {}},
        {"name": "self_test", "passed": False, "duration_s": 2.0, "details": {"why": "no incident"}},
        {"name": "live_probes", "passed": False, "outcome": "not_judged", "duration_s": 1.0, "details": {}}])
    # a worker's gauges, from a real engine holding pages for one of the tenant's requests
    engine = Engine(tiny_model, EngineConfig(num_pages=32, page_size=16))
    held = chat_request(tenant, status="decoding")
    engine.add_request(held.id, list(range(1, 40)), SamplingParams(max_tokens=8))
    engine.add_request("canary-probe", list(range(1, 10)), SamplingParams(max_tokens=8))
    engine.step()
    WorkerMetrics(registry.redis, registry.prefix, role="decode", model_name=MODEL, worker_id="decode-1",
                  gauges_ttl_s=15).flush(engine, waiting=2)

    m = scrape(client)
    assert m[("kvserve_redis_up", ())] == 1 and m[("kvserve_database_up", ())] == 1
    assert m[("kvserve_pool_pages", (("pool", "decode-1"), ("role", "decode"), ("state", "used")))] == 3
    assert m[("kvserve_pool_pages", (("pool", "decode-1"), ("role", "decode"), ("state", "free")))] == 7
    assert m[("kvserve_pool_pages", (("pool", "prefill-1"), ("role", "prefill"), ("state", "free")))] == 512
    assert m[("kvserve_pool_prefix_cached_pages", (("pool", "prefill-1"), ("role", "prefill")))] == 0
    assert m[("kvserve_kv_cache_usage_perc", (("model_name", MODEL), ("pool", "decode-1"), ("role", "decode")))] == 0.3
    assert m[("kvserve_worker_capacity_tokens", (("role", "decode"), ("worker", "decode-1")))] == 8192
    assert m[("kvserve_effective_context_limit_tokens", ())] == 8192
    assert m[("kvserve_requests_in_flight", (("status", "queued"),))] == 2
    assert m[("kvserve_requests_in_flight", (("status", "decoding"),))] == 2
    assert m[("kvserve_requests_in_flight", (("status", "prefilling"),))] == 0
    worker = (("model_name", MODEL), ("role", "decode"), ("worker", "decode-1"))
    assert m[("kvserve_num_requests_running", worker)] == 2 and m[("kvserve_num_requests_waiting", worker)] == 2
    pages = {dict(k[1])["tenant"]: v for k, v in m.items() if k[0] == "kvserve_kv_pages_held"}
    assert pages == {str(tenant.id): 3, "none": 1}  # (39 and 9 prompt tokens in pages of 16: held on demand) by tenant id
    assert b"acme" not in client.get("/metrics").content
    assert m[("kvserve_admission_rejections_total", (("reason", "context_length_exceeded"),))] == 2
    assert m[("kvserve_prompt_tokens_total", (("model_name", MODEL),))] == 40
    by_tenant = (("model_name", MODEL), ("tenant", str(tenant.id)))  # the tenant's id, never its name
    assert m[("kvserve_prefix_cache_queries_total", by_tenant)] == 40
    assert m[("kvserve_prefix_cache_hits_total", by_tenant)] == 32
    assert m[("kvserve_handoff_verdicts_total", (("model_name", MODEL), ("verdict", "OK")))] == 1
    assert m[("kvserve_handoff_verdicts_total", (("model_name", MODEL), ("verdict", "REJECTED")))] == 1
    assert m[("kvserve_decode_verdicts_total", (("model_name", MODEL), ("verdict", "accepted")))] == 1
    assert m[("kvserve_decode_verdicts_total", (("model_name", MODEL), ("verdict", "handoff_forged")))] == 1
    assert m[("kvserve_request_success_total", (("finished_reason", "length"), ("model_name", MODEL)))] == 1
    hist = {name: histogram(m, name) for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                                                  "request_decode_time_seconds", "e2e_request_latency_seconds",
                                                  "kv_transfer_time_seconds")}
    assert {name: (h["count"], round(h["sum"], 3)) for name, h in hist.items()} == {
        "request_queue_time_seconds": (1, 0.3), "request_prefill_time_seconds": (1, 0.2),
        "request_decode_time_seconds": (1, 1.5), "e2e_request_latency_seconds": (1, 2.1),
        "kv_transfer_time_seconds": (1, 0.004)}
    assert hist["request_queue_time_seconds"]["buckets"]["0.25"] == 0
    assert hist["request_queue_time_seconds"]["buckets"]["0.5"] == 1
    assert hist["request_queue_time_seconds"]["buckets"]["+Inf"] == 1
    assert histogram(m, "time_to_first_token_seconds")["count"] == 0  # shown, at zero, before any traffic
    sizes = {name: histogram(m, name) for name in ("request_prompt_tokens", "request_generation_tokens",
                                                   "request_inference_time_seconds")}
    assert {name: (h["count"], round(h["sum"], 3)) for name, h in sizes.items()} == {
        "request_prompt_tokens": (1, 40), "request_generation_tokens": (1, 0),
        "request_inference_time_seconds": (1, 1.8)}
    assert sizes["request_prompt_tokens"]["buckets"]["20.0"] == 0 and sizes["request_prompt_tokens"]["buckets"]["50.0"] == 1
    info = {dict(k[1])["worker"]: dict(k[1]) for k, v in m.items() if k[0] == "kvserve_cache_config_info" and v == 1}
    assert info["decode-1"] == {"worker": "decode-1", "role": "decode", "block_size": "16", "num_gpu_blocks": "10",
                                "cache_dtype": "float32"}
    assert info["prefill-1"]["cache_dtype"] == "bfloat16"
    pool_bytes = {dict(k[1])["worker"]: v for k, v in m.items() if k[0] == "kvserve_worker_kv_pool_bytes"}
    assert pool_bytes == {"prefill-1": 512 * 30 * 2 * 16 * 3 * 64 * 2}  # bf16: 2 bytes a value; decode-1 has no shape
    modes = {dict(k[1])["worker"]: dict(k[1])["mode"] for k, v in m.items() if k[0] == "kvserve_precision_info" and v == 1}
    assert modes["decode-1"] == "fp32"  # the registration's default (an older worker that sends no precision)
    assert m[("kvserve_incidents_total", (("kind", "lease_expired"), ("severity", "warning")))] == 2
    assert m[("kvserve_incidents_resolved_total", (("kind", "lease_expired"), ("severity", "warning")))] == 1
    open_by = {s: m[("kvserve_incidents_open", (("severity", s),))] for s in ("critical", "warning")}
    assert open_by == {"critical": 1, "warning": 1}
    assert m[("kvserve_canary_check_passed", (("check", "self_test"),))] == 0
    outcome = lambda check, o: m[("kvserve_canary_check_outcome", (("check", check), ("outcome", o)))]  # noqa: E731
    assert [outcome("self_test", o) for o in ("passed", "not_judged", "wrong")] == [0, 0, 1]  # stored before outcomes
    assert [outcome("live_probes", o) for o in ("passed", "not_judged", "wrong")] == [0, 1, 0]
    assert m[("kvserve_canary_check_duration_seconds", (("check", "marker_scan"),))] == 0.5
    assert m[("kvserve_canary_last_run_passed", ())] == 0


def histogram(m: dict, name: str) -> dict:
    """count, sum and cumulative buckets (by `le`) of a histogram with one label set."""
    series = {k: v for k, v in m.items() if k[0].startswith(f"kvserve_{name}_")}
    buckets = {dict(k[1])["le"]: v for k, v in series.items() if k[0].endswith("_bucket")}
    (count,) = [v for k, v in series.items() if k[0].endswith("_count")]
    (total,) = [v for k, v in series.items() if k[0].endswith("_sum")]
    return {"count": count, "sum": total, "buckets": buckets}


def test_metrics_follow_state_between_scrapes(client, registry, make_worker):
    decode = live_worker(registry, make_worker, "decode", worker_id="decode-1", num_pages=10)
    key = ("kvserve_pool_pages", (("pool", "decode-1"), ("role", "decode"), ("state", "used")))
    decode.allocate("r1", 4)
    assert scrape(client)[key] == 4
    decode.release("r1")
    assert scrape(client)[key] == 0


def test_metrics_without_redis_still_report_the_database(client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/15"
    m = scrape(client)
    assert m[("kvserve_redis_up", ())] == 0
    assert ("kvserve_requests_in_flight", (("status", "queued"),)) in m
    assert not [k for k in m if k[0] in ("kvserve_pool_pages", "kvserve_prompt_tokens_total")]


def test_admission_rejection_counter_never_raises(settings):
    admission_rejection_count_incr("no_workers")
    assert admission_rejection_counts() == {"no_workers": 1}
    settings.REDIS_URL = "redis://127.0.0.1:1/15"
    admission_rejection_count_incr()  # logged, not raised


# ---- access: a bearer token, KVSERVE_METRICS_TOKEN or generated on first run -------------------------------

def test_token_is_required(client, settings):
    settings.KVSERVE_METRICS_TOKEN = "s3cret-metrics-token"
    for headers, code in (({}, "missing_metrics_token"),
                          ({"HTTP_AUTHORIZATION": "Bearer wrong"}, "invalid_metrics_token"),
                          ({"HTTP_AUTHORIZATION": "Bearer s3cret-metrics-tokenX"}, "invalid_metrics_token"),
                          ({"HTTP_AUTHORIZATION": "Basic s3cret-metrics-token"}, "invalid_metrics_token")):
        response = client.get("/metrics", **headers)
        assert response.status_code == 401 and response["WWW-Authenticate"].startswith("Bearer")
        error = response.json()["error"]
        assert error["code"] == code and "KVSERVE_METRICS_TOKEN" in error["message"]
        assert b"kvserve_" not in response.content
    assert ("kvserve_redis_up", ()) in scrape(client, HTTP_AUTHORIZATION="Bearer s3cret-metrics-token")
    assert ("kvserve_redis_up", ()) in scrape(client, HTTP_AUTHORIZATION="bearer  s3cret-metrics-token")


def test_staff_sessions_pass_and_other_users_do_not(client, settings):
    settings.KVSERVE_METRICS_TOKEN = "s3cret-metrics-token"
    client.force_login(User.objects.create_user("tenant-user", password="pw-123456789"))
    assert client.get("/metrics").status_code == 401
    client.force_login(User.objects.create_user("ops", password="pw-123456789", is_staff=True))
    assert ("kvserve_redis_up", ()) in scrape(client, HTTP_AUTHORIZATION="")


def test_an_anonymous_scrape_is_refused_by_default(client, tmp_path):
    """No KVSERVE_METRICS_TOKEN in the environment: one is generated into the secrets file, and an anonymous
    scrape sees no tenant's figures (as under `make run`)."""
    assert client.get("/metrics").status_code == 401  # this test run's own settings
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_METRICS_TOKEN"}
    out = subprocess.run([sys.executable, "-c", "import django; django.setup(); from django.conf import settings; "
                          "print(settings.KVSERVE_METRICS_TOKEN)"], capture_output=True, text=True, timeout=120,
                         env={**env, "DJANGO_SETTINGS_MODULE": "kvserve.settings",
                              "KVSERVE_SECRETS_FILE": str(tmp_path / "s.json")}, cwd=BASE_DIR)
    token = out.stdout.strip().splitlines()[-1]
    assert len(token) == 64 and json.loads((tmp_path / "s.json").read_text())["KVSERVE_METRICS_TOKEN"] == token


# ---- cost: one rendering per window, O(1) Redis commands per pool ----------------------------------------

def test_scrapes_within_the_window_share_one_rendering(client, settings, registry, make_worker):
    settings.KVSERVE_METRICS_CACHE_S = 30
    decode = live_worker(registry, make_worker, "decode", worker_id="decode-1", num_pages=10)
    key = ("kvserve_pool_pages", (("pool", "decode-1"), ("role", "decode"), ("state", "used")))
    first = scrape_cache.renders
    assert scrape(client)[key] == 0
    decode.allocate("r1", 4)
    assert all(scrape(client)[key] == 0 for _ in range(5))  # the cached rendering
    assert scrape_cache.renders == first + 1
    assert b'state="used"} 4.0' in metrics_render(now=time.monotonic() + 31)  # the window passed: rendered anew
    assert scrape_cache.renders == first + 2


def test_concurrent_scrapes_wait_for_the_one_rendering():
    started, release, calls = threading.Event(), threading.Event(), []

    def slow_render():
        calls.append(1)
        started.set()
        release.wait(30)
        return b"body %d" % len(calls)

    cache = ScrapeCache(slow_render)
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get("k", 5.0, now=100.0))) for _ in range(8)]
    threads[0].start()
    started.wait(30)
    for t in threads[1:]:
        t.start()
    release.set()
    for t in threads:
        t.join(30)
    assert results == [b"body 1"] * 8 and cache.renders == 1
    assert cache.get("k", 5.0, now=104.9) == b"body 1" and cache.get("k", 5.0, now=105.0) == b"body 2"
    assert cache.get("other deployment", 5.0, now=105.0) == b"body 3"
    assert cache.get("other deployment", 0, now=105.0) == b"body 4"  # 0: every scrape renders


@pytest.fixture
def private_redis():
    """A redis-server of this test's own, so its command counts are this test's alone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--maxmemory-policy", "noeviction"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0", client
    client.close()
    proc.terminate()
    proc.wait(10)


def test_a_scrape_costs_a_few_commands_per_pool_whatever_its_size(client, settings, make_worker, private_redis):
    url, r = private_redis
    settings.REDIS_URL = url
    registry = Registry(r, prefix=settings.KVSERVE_LEDGER_PREFIX, ttl_s=15)
    big = live_worker(registry, make_worker, "decode", worker_id="decode-big", num_pages=42_580)
    live_worker(registry, make_worker, "prefill", worker_id="prefill-1", num_pages=512)
    big.allocate("r1", 1000)
    r.config_resetstat()
    m = scrape(client)
    assert m[("kvserve_pool_pages", (("pool", "decode-big"), ("role", "decode"), ("state", "free")))] == 41_580
    stats = r.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): v["calls"] for name, v in stats.items()}
    assert not {"eval", "evalsha", "lrange", "lpos", "zrange"} & calls.keys(), calls  # no script, no page read
    assert calls.get("hgetall") == len(FAMILIES), calls  # one per aggregated family; never a pool's hash
    per_pool = sum(calls.get(c, 0) for c in ("hmget", "llen", "scard", "hlen"))
    assert per_pool == 5 * 2 + 3, calls  # five counts per pool (the fifth: prefix-cached pages) in one MULTI,
    # and the three broker queues
    assert calls.get("mget", 0) == 3, calls  # the registry's infos (workers, effective limit), the workers' gauges
    assert sum(calls.values()) <= 70, calls  # and none of them grows with the pool

"""The history sampler (incidents/history.py) on real Redis with injected time: rates and quantiles from the deltas of
the aggregated counters, one sample per interval, retention; /api/history/'s shape and permissions."""
import pytest

from incidents.canary.live import broker_queue_lengths
from incidents.history import histogram_quantile, history_get, history_sample, max_samples
from inference.metrics import Batch
from tests.incidents.helpers import live_worker

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]
M = {"model_name": "m"}


def send(registry, batch: Batch) -> None:
    batch.send(registry.redis, registry.prefix)


def test_histogram_quantile_interpolates_within_the_bucket():
    bounds = (1.0, 2.0, 4.0)
    assert histogram_quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert histogram_quantile(0.5, bounds, [0, 10, 0, 0]) == pytest.approx(1.5)
    assert histogram_quantile(0.25, bounds, [10, 0, 10, 0]) == pytest.approx(0.5)
    assert histogram_quantile(0.99, bounds, [0, 0, 0, 5]) == 4.0  # +Inf: its lower bound, as Prometheus


def test_the_sampler_records_rates_from_the_counters_deltas(registry):
    send(registry, Batch().inc("generation_tokens", 100, **M).observe("time_to_first_token_seconds", 9.0, **M)
         .inc("request_failure", code="engine_error", **M).inc("num_preemptions", 1, role="decode", **M))
    first = history_sample(now=1000.0)
    assert first.tokens_per_s is None and first.ttft_p50_s is None and first.errors == {}  # nothing to diff yet
    assert first.queue_tasks == broker_queue_lengths()["prefill"] + broker_queue_lengths()["decode"]

    batch = Batch().inc("generation_tokens", 300, **M)
    for _ in range(90):
        batch.observe("time_to_first_token_seconds", 0.02, **M)  # the (0.01, 0.025] bucket
    for _ in range(10):
        batch.observe("time_to_first_token_seconds", 3.0, **M)  # the (2.5, 5.0] bucket
    batch.inc("request_failure", 2, code="engine_error", **M).inc("request_failure", code="worker_lost", **M)
    batch.inc("admission_rejections", 3, reason="tenant_in_flight_limit").inc("admission_rejections", 2, reason="rate_limited")
    batch.inc("admission_rejections", 5, reason="context_length_exceeded")  # a 400, not a 429
    batch.inc("num_preemptions", 4, role="decode", **M)
    batch.inc("prefix_cache_queries", 200, tenant="1", **M).inc("prefix_cache_hits", 50, tenant="1", **M)
    send(registry, batch)
    s = history_sample(now=1015.0)
    assert (s.interval_s, s.tokens_per_s) == (15.0, 20.0)
    assert s.ttft_p50_s == pytest.approx(0.01 + 0.015 * 50 / 90, abs=1e-4)  # the 9 s of the first interval is out
    assert s.ttft_p99_s == pytest.approx(2.5 + 2.5 * 9 / 10, abs=1e-4)
    assert s.errors == {"engine_error": 2, "worker_lost": 1}
    assert (s.refused_429, s.preemptions, s.prefix_cache_hit_rate) == (5, 4, 0.25)

    assert history_sample(now=1016.0) is None  # the same interval: one sample
    quiet = history_sample(now=1030.0)
    assert (quiet.tokens_per_s, quiet.ttft_p50_s, quiet.errors, quiet.preemptions) == (0.0, None, {}, 0)
    assert quiet.prefix_cache_hit_rate is None  # no lookups: no rate, not 0
    series = history_get(window_s=3600, now=1030.0)["service"]
    assert [p["ts"] for p in series] == [1000.0, 1015.0, 1030.0] and series[1]["tokens_per_s"] == 20.0


def test_counters_that_went_back_leave_a_gap_not_a_negative_rate(registry):
    send(registry, Batch().inc("generation_tokens", 100, **M))
    history_sample(now=1000.0)
    registry.redis.delete(f"{registry.prefix}:metrics:generation_tokens")
    send(registry, Batch().inc("generation_tokens", 10, **M))
    assert history_sample(now=1015.0).tokens_per_s is None
    assert history_sample(now=1030.0).tokens_per_s == pytest.approx(0.0)


def test_pools_are_sampled_for_every_live_worker(registry, make_worker):
    decode = live_worker(registry, make_worker, "decode", worker_id="decode-1", num_pages=4)
    decode.allocate("r1", 3)
    history_sample(now=1000.0)
    decode.allocate("r2", 1)
    history_sample(now=1015.0)
    pools = history_get(window_s=3600, now=1015.0)["pools"]
    assert pools == {"decode-1": [[1000.0, 3, 1, 0], [1015.0, 4, 0, 0]]}


def test_retention_caps_and_windows_every_series(registry, make_worker, settings):
    settings.KVSERVE_HISTORY_SAMPLE_S, settings.KVSERVE_HISTORY_RETENTION_S = 15, 600
    live_worker(registry, make_worker, "prefill", worker_id="prefill-1", num_pages=2)
    for i in range(max_samples() + 20):
        assert history_sample(now=1000.0 + 15 * i) is not None
    last = 1000.0 + 15 * (max_samples() + 19)
    for key in ("service", "pool:prefill-1"):
        k = f"{registry.prefix}:history:{key}"
        assert registry.redis.llen(k) == max_samples() and 0 < registry.redis.ttl(k) <= 660
    body = history_get(window_s=300, now=last)
    assert [p["ts"] for p in body["service"]] == [last - 15 * i for i in range(20, -1, -1)]
    assert len(body["pools"]["prefill-1"]) == 21
    assert history_get(window_s=300, now=last + 3600)["pools"] == {}  # a pool silent past the window drops out


def test_api_history_is_staff_only_and_validates_the_window(client, admin_client, django_user_model, registry):
    history_sample()
    assert client.get("/api/history/").status_code == 403
    django_user_model.objects.create_user("tenant-user", password="pw-x-12345")
    client.login(username="tenant-user", password="pw-x-12345")
    assert client.get("/api/history/").status_code == 403
    response = admin_client.get("/api/history/")
    body = response.json()
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    assert (body["window_s"], body["sample_every_s"], body["retention_s"]) == (3600, 15, 86400)
    assert len(body["service"]) == 1 and {"ts", "tokens_per_s", "ttft_p50_s", "ttft_p99_s", "errors", "refused_429",
                                          "queue_tasks", "waiting", "preemptions",
                                          "prefix_cache_hit_rate"} <= body["service"][0].keys()
    assert admin_client.get("/api/history/?window=900").json()["window_s"] == 900
    for bad in ("abc", "10", "999999", "-5"):
        r = admin_client.get(f"/api/history/?window={bad}")
        assert r.status_code == 400 and r.json()["error"]["param"] == "window"

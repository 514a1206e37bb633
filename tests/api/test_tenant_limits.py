"""Fair share at admission over real Redis (registry, ledger, metrics) and the real DB, work-conserving: a
tenant alone is admitted however far over its shares; while another tenant has requests in flight, a tenant
over its in-flight or KV share gets 429 with Retry-After and a message naming the limit, at once; nothing is
written or queued; other tenants are admitted; KV is counted from the ledger's real holdings and prompts,
never max_tokens."""
import json

import pytest
from django.db import transaction

from inference.ledger import RedisLedger
from kvserve.celery import app
from kvserve.chat.metrics import admission_rejection_counts
from kvserve.chat.models import ChatRequest
from kvserve.tenants.models import Tenant
from kvserve.tenants.services import api_key_create
from tests.api.chat_helpers import FakeWorker
from tests.conftest import TEST_REDIS_URL

pytestmark = [pytest.mark.django_db]

URL = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
PAGE = 16


@pytest.fixture
def env(registry_settings, registry, make_worker, registry_redis, registry_prefix, monkeypatch):
    """Live prefill (4096 tokens: the smallest pool) and decode (8192) registrations with their real ledger
    pools, and a stand-in for the prefill the services send, that records what was queued (rows stay unfinished,
    as queued requests do)."""
    s = registry_settings
    s.CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                            "LOCATION": TEST_REDIS_URL, "KEY_PREFIX": f"{registry_prefix}:cache"}}
    s.KVSERVE_THROTTLE_RATE = "1000/min"
    s.KVSERVE_TENANT_MAX_IN_FLIGHT, s.KVSERVE_TENANT_KV_SHARE, s.KVSERVE_TENANT_RETRY_AFTER_S = 3, 0.5, 2
    registry.register(make_worker("prefill", worker_id="p1", num_pages=256, page_size=PAGE, capacity_tokens=4096,
                                  window=8192))
    registry.register(make_worker("decode", worker_id="d1", num_pages=512, page_size=PAGE, capacity_tokens=8192,
                                  window=8192))
    pools = {w: RedisLedger.register(registry_redis, w, role, n, PAGE, prefix=registry_prefix)
             for w, role, n in (("p1", "prefill", 256), ("d1", "decode", 512))}
    worker = FakeWorker(registry_redis, registry_prefix)
    monkeypatch.setattr(app, "send_task", worker.send_task)
    monkeypatch.setattr(transaction, "on_commit", lambda fn, using=None, robust=False: fn())
    worker.pools = pools
    return worker


def post(client, raw, max_tokens=16):
    return client.post(URL, json.dumps({"messages": MESSAGES, "max_tokens": max_tokens}),
                       content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {raw}")


def assert_429(response, code):
    assert response.status_code == 429, response.content
    assert response["Retry-After"] == "2"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == code and error["param"] is None
    return error["message"]


def rid_of(env, i=-1) -> str:
    return env.calls[i][0]


def finish(rid):
    ChatRequest.objects.filter(id=rid).update(status=ChatRequest.Status.DONE)


def test_a_tenant_alone_is_admitted_over_both_old_limits(client, env):
    """Work-conserving: nobody else has a request in flight, so 5 requests (limit 3), each with a max_tokens
    near the window (a 2,048-token KV share), are all admitted: max_tokens is not a reservation."""
    acme = api_key_create("acme")[1]
    for _ in range(5):
        assert post(client, acme, max_tokens=3900).status_code == 200
    assert ChatRequest.objects.filter(tenant__name="acme").count() == 5 and len(env.calls) == 5
    counts = admission_rejection_counts()
    assert counts.get("tenant_in_flight_limit", 0) == counts.get("tenant_kv_limit", 0) == 0


def test_four_tenants_with_large_max_tokens_on_an_idle_pool_are_all_admitted(client, env):
    """The issue's case: four tenants, two requests each, max_tokens near the smallest pool (4,096 tokens):
    each holds or awaits only its prompts, far below its share, so none is refused."""
    keys = [api_key_create(f"t{i}")[1] for i in range(4)]
    for _ in range(2):
        for key in keys:
            assert post(client, key, max_tokens=4000).status_code == 200
    assert ChatRequest.objects.count() == 8


def test_over_the_in_flight_share_while_another_tenant_waits_is_429_and_nothing_is_queued(client, env):
    acme, other = api_key_create("acme")[1], api_key_create("other")[1]
    for _ in range(4):
        assert post(client, acme).status_code == 200  # alone: over its share of 3, admitted
    assert post(client, other).status_code == 200  # another tenant arrives (it holds nothing: admitted)
    other_rid = rid_of(env)
    message = assert_429(post(client, acme), "tenant_in_flight_limit")
    assert "4 requests in flight" in message and "KVSERVE_TENANT_MAX_IN_FLIGHT" in message
    assert ChatRequest.objects.filter(tenant__name="acme").count() == 4 and len(env.calls) == 5
    assert post(client, other).status_code == 200  # the other tenant is not held back
    for rid, _ in env.calls[:2]:
        finish(rid)
    assert post(client, acme).status_code == 200  # 2 of its 4 finished: under its share again
    assert_429(post(client, acme), "tenant_in_flight_limit")
    finish(other_rid)
    finish(rid_of(env, 5))
    assert post(client, acme).status_code == 200  # the other tenant is done: alone again
    assert admission_rejection_counts()["tenant_in_flight_limit"] == 2


def test_over_the_kv_share_while_another_tenant_waits_is_429_naming_the_limit(client, env):
    """KV is counted from the ledger's real holdings (pages x page size) and the prompts of requests that hold
    nothing yet, never max_tokens."""
    acme, other = api_key_create("acme")[1], api_key_create("other")[1]
    assert post(client, acme, max_tokens=3900).status_code == 200
    rid = rid_of(env)
    ChatRequest.objects.filter(id=rid).update(status=ChatRequest.Status.DECODING)
    env.pools["d1"].allocate(rid, 2)  # holds 32 tokens so far
    assert post(client, other).status_code == 200
    assert post(client, acme, max_tokens=3900).status_code == 200  # 32 + two prompts: far below 2,048
    env.pools["d1"].extend(rid, 126)  # grows to 2,048 tokens held: its whole share
    message = assert_429(post(client, acme, max_tokens=1), "tenant_kv_limit")
    assert "2048 tokens" in message and "50%" in message and "4096 tokens" in message
    assert "KVSERVE_TENANT_KV_SHARE" in message
    assert ChatRequest.objects.filter(tenant__name="acme").count() == 2
    env.pools["d1"].release(rid)
    finish(rid)
    assert post(client, acme, max_tokens=16).status_code == 200
    assert admission_rejection_counts()["tenant_kv_limit"] == 1


def test_a_tenant_holding_nothing_is_admitted_above_its_share_while_others_wait(client, env):
    acme, other = api_key_create("acme")[1], api_key_create("other")[1]
    assert post(client, other).status_code == 200
    Tenant.objects.filter(name="acme").update(kv_share=0.001)  # a 4-token share: below any prompt
    assert post(client, acme, max_tokens=16).status_code == 200  # holds nothing: never starved
    assert_429(post(client, acme, max_tokens=16), "tenant_kv_limit")  # but nothing more while it is owed


def test_a_tenants_own_limits_override_the_deployments(client, env):
    acme, other = api_key_create("acme")[1], api_key_create("other")[1]
    assert post(client, other).status_code == 200
    Tenant.objects.filter(name="acme").update(max_in_flight=1, kv_share=0)
    assert post(client, acme, max_tokens=3000).status_code == 200
    assert "the tenant's max_in_flight" in assert_429(post(client, acme), "tenant_in_flight_limit")
    Tenant.objects.filter(name="acme").update(max_in_flight=0)  # 0: no limit; kv_share 0: no KV limit
    for _ in range(4):
        assert post(client, acme, max_tokens=3000).status_code == 200


def test_an_overlong_request_is_still_400_not_429(client, env):
    acme, other = api_key_create("acme")[1], api_key_create("other")[1]
    post(client, other)
    for _ in range(3):
        post(client, acme)
    assert post(client, acme, max_tokens=8000).status_code == 400  # can never fit: the client must change it


def test_metrics_count_429s_per_limit(client, env, settings):
    from prometheus_client.parser import text_string_to_metric_families

    settings.KVSERVE_METRICS_CACHE_S = 0
    acme = api_key_create("acme")[1]

    def refusals():
        text = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {settings.KVSERVE_METRICS_TOKEN}").content.decode()
        return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "kvserve_admission_rejections_total"}

    assert refusals()["tenant_in_flight_limit"] == 0 and refusals()["tenant_kv_limit"] == 0  # shown before any
    post(client, api_key_create("other")[1])  # another tenant waits: the shares bite
    post(client, acme)
    env.pools["d1"].allocate(rid_of(env), 128)  # acme's first request holds its whole 2,048-token share
    post(client, acme)  # KV
    Tenant.objects.filter(name="acme").update(kv_share=0, max_in_flight=1)
    post(client, acme)  # in flight
    assert refusals() == {"context_length_exceeded": 0, "tenant_in_flight_limit": 1, "tenant_kv_limit": 1,
                          "rate_limited": 0}

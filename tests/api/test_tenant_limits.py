"""Fair share at admission over real Redis (registry, ledger, metrics) and the real DB: a tenant over its
in-flight or KV limit gets 429 with Retry-After and a message naming the limit, at once; nothing is written
or queued; other tenants are admitted; KV is counted from the ledger's real holdings."""
import json

import pytest
from django.db import transaction

from inference.ledger import RedisLedger
from kvserve.chat import tasks
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
    pools, and a stand-in for prefill.delay that records what was queued (rows stay unfinished, as queued
    requests do)."""
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
    monkeypatch.setattr(tasks, "prefill", worker)
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


def test_over_the_in_flight_limit_is_429_at_once_and_nothing_is_queued(client, env):
    acme, other = api_key_create("acme")[1], api_key_create("other")[1]
    for _ in range(3):
        assert post(client, acme).status_code == 200
    message = assert_429(post(client, acme), "tenant_in_flight_limit")
    assert "3 requests in flight" in message and "KVSERVE_TENANT_MAX_IN_FLIGHT" in message
    assert ChatRequest.objects.filter(tenant__name="acme").count() == 3 and len(env.calls) == 3
    assert post(client, other).status_code == 200  # another tenant is not held back
    ChatRequest.objects.filter(id=env.calls[0][0]).update(status=ChatRequest.Status.DONE)
    assert post(client, acme).status_code == 200  # one finished: admitted again
    assert admission_rejection_counts()["tenant_in_flight_limit"] == 1


def test_over_the_kv_share_is_429_naming_the_limit(client, env):
    acme = api_key_create("acme")[1]
    assert post(client, acme, max_tokens=1500).status_code == 200  # owed ~1500 of the 2048-token budget
    message = assert_429(post(client, acme, max_tokens=600), "tenant_kv_limit")
    assert "2048 tokens" in message and "50%" in message and "4096 tokens" in message
    assert "KVSERVE_TENANT_KV_SHARE" in message
    assert ChatRequest.objects.count() == 1
    assert admission_rejection_counts()["tenant_kv_limit"] == 1


def test_a_tenant_holding_nothing_is_admitted_above_its_share(client, env):
    acme = api_key_create("acme")[1]
    assert post(client, acme, max_tokens=3000).status_code == 200  # fits the window (4096), above 2048: admitted
    assert_429(post(client, acme, max_tokens=16), "tenant_kv_limit")  # but nothing more while it is owed


def test_kv_is_counted_from_the_ledgers_real_holdings(client, env):
    """A running request counts the pages it really holds, not its prompt + max_tokens (pages on demand)."""
    acme = api_key_create("acme")[1]
    assert post(client, acme, max_tokens=3000).status_code == 200
    rid = env.calls[0][0]
    ChatRequest.objects.filter(id=rid).update(status=ChatRequest.Status.DECODING)
    env.pools["d1"].allocate(rid, 2)  # holds 32 tokens so far
    assert post(client, acme, max_tokens=1500).status_code == 200  # 32 + 1500 + the new prompt <= 2048
    env.pools["d1"].extend(rid, 100)  # grows to 1632 tokens held (the second request still owes ~1510)
    assert_429(post(client, acme, max_tokens=16), "tenant_kv_limit")
    env.pools["d1"].release(rid)
    ChatRequest.objects.filter(id=rid).update(status=ChatRequest.Status.DONE)
    assert post(client, acme, max_tokens=16).status_code == 200


def test_a_tenants_own_limits_override_the_deployments(client, env):
    acme = api_key_create("acme")[1]
    Tenant.objects.filter(name="acme").update(max_in_flight=1, kv_share=0)
    assert post(client, acme, max_tokens=3000).status_code == 200
    assert "the tenant's max_in_flight" in assert_429(post(client, acme), "tenant_in_flight_limit")
    Tenant.objects.filter(name="acme").update(max_in_flight=0)  # 0: no limit; kv_share 0: no KV limit
    for _ in range(4):
        assert post(client, acme, max_tokens=3000).status_code == 200


def test_an_overlong_request_is_still_400_not_429(client, env):
    acme = api_key_create("acme")[1]
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
    post(client, acme, max_tokens=1500)
    post(client, acme, max_tokens=1500)
    for _ in range(2):
        post(client, acme)
    post(client, acme)
    assert refusals() == {"context_length_exceeded": 0, "tenant_in_flight_limit": 1, "tenant_kv_limit": 1}

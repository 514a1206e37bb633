"""Per-tenant usage (kvserve/tenants/usage.py) through the real service path: admission (chat_request_create), prefill
and decode on real runtimes (tiny model), the answer the API returns (completion_wait); the usage rows add up to its
`usage`, including prefix-cache hits. 429s (fair share, throttle) and failures by code are counted; the CSV export."""
import csv
import datetime as dt
import io

import pytest
from django.db import transaction

from inference.params import RequestParams, Sampling
from kvserve.celery import app
from kvserve.chat import runtime as runtime_module
from kvserve.chat.metrics import admission_rejection_counts
from kvserve.chat.models import ChatRequest
from kvserve.chat.outputs import completion_wait
from kvserve.chat.services import chat_request_create, chat_request_decode, chat_request_fail, chat_request_prefill
from kvserve.dispatch import DECODE, PREFILL
from kvserve.errors import ApiError
from kvserve.tenants.models import Tenant, TenantFailure, TenantUsage
from kvserve.tenants.services import api_key_create
from kvserve.tenants.usage import hour_of, usage_by_tenant, usage_csv
from tests.conftest import TEST_REDIS_URL
from tests.incidents.helpers import chat_request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


@pytest.fixture
def pipeline(registry_redis, registry_prefix, tiny_model, monkeypatch):
    """A prefill and a decode runtime (registered), and a broker that runs each stage's task at once in this process
    with that stage's runtime installed, as its worker would."""
    from inference.engine import EngineConfig
    from inference.worker import RuntimeOptions, WorkerRuntime

    options, key = RuntimeOptions(prefix=registry_prefix), b"k" * 32
    prefill = WorkerRuntime("prefill", registry_redis, key, model=tiny_model, options=options,
                            config=EngineConfig(num_pages=64, window=1024, prefix_cache=True))
    decode = WorkerRuntime("decode", registry_redis, key, model=tiny_model, options=options,
                           config=EngineConfig(num_pages=64, window=1024, prefix_cache=True))

    def send_task(name, args=None, queue=None, **_):
        runtime_module._runtime["current"] = prefill if name == PREFILL else decode
        (chat_request_prefill if name == PREFILL else chat_request_decode)(*args)
        assert name in (PREFILL, DECODE)

    monkeypatch.setattr(app, "send_task", send_task)
    monkeypatch.setattr(transaction, "on_commit", lambda fn, using=None, robust=False: fn())
    monkeypatch.setitem(runtime_module._runtime, "current", decode)
    yield prefill, decode
    prefill.stop()
    decode.stop()


def ask(api_key, prompt: list[int], max_tokens: int = 6) -> dict:
    req, _ = chat_request_create(api_key=api_key, prompt=prompt, max_tokens=max_tokens,
                                 params=RequestParams(Sampling(temperature=0.0)))
    return completion_wait(ChatRequest.objects.get(id=req.id))


def test_usage_adds_up_to_what_the_api_returned(pipeline):
    api_key, _ = api_key_create("acme")
    prompt = list(range(10, 60))  # 50 tokens: the second ask reads its first full pages from the prefix cache
    answers = [ask(api_key, prompt), ask(api_key, prompt), ask(api_key, list(range(70, 90)), max_tokens=3)]
    usages = [a["usage"] for a in answers]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 0  # a real hit, counted below
    (row,) = TenantUsage.objects.filter(tenant=api_key.tenant)
    assert row.hour == hour_of(ChatRequest.objects.first().created_at)
    assert (row.requests, row.completed, row.failed, row.refused_429) == (3, 3, 0, 0)
    assert row.prompt_tokens == sum(u["prompt_tokens"] for u in usages)
    assert row.completion_tokens == sum(u["completion_tokens"] for u in usages)
    assert row.cached_tokens == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    (total,) = usage_by_tenant(row.hour, row.hour + dt.timedelta(hours=1))
    assert total["cache_hit_rate"] == round(row.cached_tokens / row.prompt_tokens, 4)


def test_a_fair_share_429_is_counted_and_writes_no_request(pipeline):
    acme_key, _ = api_key_create("acme")
    Tenant.objects.filter(pk=acme_key.tenant_id).update(max_in_flight=1)
    chat_request(acme_key.tenant, status="queued")  # acme's one request in flight
    chat_request(api_key_create("globex")[0].tenant, status="queued")  # another tenant waits: the share bites
    with pytest.raises(ApiError) as refused:
        chat_request_create(api_key=acme_key, prompt=[10, 11, 12], max_tokens=2, params=RequestParams())
    assert refused.value.status_code == 429
    assert ChatRequest.objects.filter(tenant=acme_key.tenant).count() == 1
    assert TenantUsage.objects.get(tenant=acme_key.tenant).refused_429 == 1


def test_a_throttled_call_is_counted(client, settings, registry_prefix):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                                   "LOCATION": TEST_REDIS_URL, "KEY_PREFIX": f"{registry_prefix}:cache"}}
    settings.KVSERVE_THROTTLE_RATE = "1/min"
    api_key, raw = api_key_create("acme")
    statuses = [client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code for _ in range(3)]
    assert statuses == [200, 429, 429]
    assert TenantUsage.objects.get(tenant=api_key.tenant).refused_429 == 2
    assert admission_rejection_counts()["rate_limited"] == 2  # /metrics and the history's 429 series


def test_failures_are_counted_by_code_once_per_request():
    tenant = Tenant.objects.create(name="acme")
    a, b = chat_request(tenant, status="decoding"), chat_request(tenant, status="queued")
    assert chat_request_fail(a, code="engine_error", message="x")
    assert not chat_request_fail(a, code="worker_lost", message="ended already: not counted again")
    assert chat_request_fail(b, code="queue_timeout", message="x")
    row = TenantUsage.objects.get(tenant=tenant)
    assert (row.requests, row.failed, row.completed) == (2, 2, 0)
    assert dict(TenantFailure.objects.values_list("code", "count")) == {"engine_error": 1, "queue_timeout": 1}
    hour = hour_of(a.created_at)
    assert usage_by_tenant(hour, hour + dt.timedelta(hours=1))[0]["failures"] == {"engine_error": 1,
                                                                                 "queue_timeout": 1}


def test_the_csv_has_a_line_per_tenant_hour_and_names_only_when_asked():
    acme, globex = Tenant.objects.create(name="acme"), Tenant.objects.create(name="globex")
    hour = hour_of()
    TenantUsage.objects.create(tenant=acme, hour=hour, requests=3, completed=2, prompt_tokens=30, failed=1)
    TenantUsage.objects.create(tenant=globex, hour=hour - dt.timedelta(hours=1), requests=1, completed=1)
    TenantUsage.objects.create(tenant=globex, hour=hour - dt.timedelta(days=3), requests=9)  # outside the period
    TenantFailure.objects.create(tenant=acme, hour=hour, code="engine_error", count=1)
    rows = list(csv.DictReader(io.StringIO(usage_csv(hour - dt.timedelta(hours=2), hour + dt.timedelta(hours=1),
                                                     names=True))))
    assert [(r["tenant_name"], r["requests"], r["failures"]) for r in rows] == [("globex", "1", ""),
                                                                               ("acme", "3", "engine_error=1")]
    anonymous = usage_csv(hour - dt.timedelta(hours=2), hour + dt.timedelta(hours=1), names=False)
    assert "acme" not in anonymous and anonymous.splitlines()[0].startswith("hour_utc,tenant_id,requests,")

"""/healthz from live worker registrations: 200 only while a prefill and a decode worker can serve."""
import time

import pytest

from inference.registry import Registry

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


def test_no_workers_is_503(client):
    response = client.get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert body["workers"] == [] and body["effective_context_limit"] is None
    assert body["window"] is None  # derived from live workers only, never from a second config
    assert "prefill" in body["error"] and "decode" in body["error"]


def test_prefill_and_decode_live_is_200_with_min_limit(client, registry, make_worker):
    registry.register(make_worker("prefill", worker_id="p1", window=8192, capacity_tokens=16384))
    registry.register(make_worker("decode", worker_id="d1", window=8192, capacity_tokens=5000))
    response = client.get("/healthz")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["effective_context_limit"] == 5000 and "error" not in body
    assert body["window"] == 8192
    assert {w["worker_id"] for w in body["workers"]} == {"p1", "d1"}
    assert {"capacity_tokens", "window", "faults", "quarantined"} <= set(body["workers"][0])


def test_only_prefill_is_503(client, registry, make_worker):
    registry.register(make_worker("prefill", worker_id="p1"))
    body = client.get("/healthz").json()
    assert body["effective_context_limit"] is None and "decode" in body["error"]


def test_expired_worker_turns_healthz_503(client, registry_redis, registry_prefix, make_worker):
    registry = Registry(registry_redis, prefix=registry_prefix, ttl_s=0.4)
    registry.register(make_worker("prefill", worker_id="p1"))
    registry.register(make_worker("decode", worker_id="d1"))
    assert client.get("/healthz").status_code == 200
    time.sleep(0.25)
    registry.heartbeat("p1")
    time.sleep(0.25)
    response = client.get("/healthz")
    assert response.status_code == 503
    assert [w["worker_id"] for w in response.json()["workers"]] == ["p1"]


def test_quarantined_decode_pool_turns_healthz_503(client, registry, make_worker):
    registry.register(make_worker("prefill", worker_id="p1"))
    registry.register(make_worker("decode", worker_id="d1"))
    registry.quarantine("d1", "incident #1")
    response = client.get("/healthz")
    assert response.status_code == 503
    assert [w["quarantined"] for w in response.json()["workers"] if w["worker_id"] == "d1"] == [True]


def test_healthz_needs_no_key_even_with_a_bad_one(client, registry, make_worker):
    assert client.get("/healthz", HTTP_AUTHORIZATION="Bearer kvs-wrong").status_code == 503


def test_unreachable_redis_is_503_not_500(client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/15"
    response = client.get("/healthz")
    assert response.status_code == 503
    assert "unreachable" in response.json()["error"]


def test_served_window_is_the_smallest_live_window(client, registry, make_worker):
    registry.register(make_worker("prefill", worker_id="p1", window=8192, capacity_tokens=16384))
    registry.register(make_worker("decode", worker_id="d1", window=4096, capacity_tokens=4096))
    body = client.get("/healthz").json()
    assert (body["window"], body["effective_context_limit"]) == (4096, 4096)

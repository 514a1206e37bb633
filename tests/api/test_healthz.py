"""/healthz from live worker registrations: 200 only while a prefill and a decode worker can serve; anonymous,
so it says that and the effective context limit, nothing about hosts, pids, faults or quarantine."""
import pytest

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


def test_no_workers_is_503_logged_as_a_warning(client, request_log):
    response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "effective_context_limit": None}
    # expected while a stack starts: never an ERROR per health probe
    assert [(r.levelname, r.getMessage()) for r in request_log] == [("WARNING", "Service Unavailable: /healthz")]


def test_prefill_and_decode_live_is_200_with_min_limit_and_nothing_else(client, registry, make_worker):
    registry.register(make_worker("prefill", worker_id="p1", window=8192, capacity_tokens=16384,
                                  host="secret-host-1", faults=["no_scrub"]))
    registry.register(make_worker("decode", worker_id="d1", window=8192, capacity_tokens=5000, host="secret-host-2"))
    registry.quarantine("d2", "incident #7")
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "effective_context_limit": 5000}
    text = response.content.decode()
    for secret in ("secret-host", "p1", "d1", "no_scrub", "pid", "incident", "quarantin"):
        assert secret not in text, secret


def test_only_prefill_is_503(client, registry, make_worker):
    registry.register(make_worker("prefill", worker_id="p1"))
    assert client.get("/healthz").json()["effective_context_limit"] is None


def test_expired_worker_turns_healthz_503(client, registry, registry_redis, make_worker):
    registry.register(make_worker("prefill", worker_id="p1"))
    registry.register(make_worker("decode", worker_id="d1"))
    assert client.get("/healthz").status_code == 200
    registry.heartbeat("p1")
    registry_redis.pexpireat(registry.key("info", "d1"), 1)  # d1's TTL ran out, on Redis' clock: dropped now
    assert client.get("/healthz").status_code == 503


def test_quarantined_decode_pool_turns_healthz_503_without_saying_why(client, registry, make_worker):
    registry.register(make_worker("prefill", worker_id="p1"))
    registry.register(make_worker("decode", worker_id="d1"))
    registry.quarantine("d1", "incident #1")
    response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "effective_context_limit": None}


def test_healthz_needs_no_key_even_with_a_bad_one(client, registry, make_worker):
    assert client.get("/healthz", HTTP_AUTHORIZATION="Bearer kvs-wrong").status_code == 503


def test_unreachable_redis_is_503_not_500(client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/15"
    response = client.get("/healthz")
    assert response.status_code == 503 and response.json()["status"] == "unavailable"


def test_limit_is_the_smallest_live_limit(client, registry, make_worker):
    registry.register(make_worker("prefill", worker_id="p1", window=8192, capacity_tokens=16384))
    registry.register(make_worker("decode", worker_id="d1", window=4096, capacity_tokens=4096))
    assert client.get("/healthz").json()["effective_context_limit"] == 4096


def test_the_detail_is_for_staff_at_api_pools(client, admin_client, registry, make_worker):
    registry.register(make_worker("prefill", worker_id="p1", host="secret-host-1"))
    assert client.get("/api/pools/").status_code == 403
    body = admin_client.get("/api/pools/").json()
    assert [(w["id"], w["host"]) for w in body["workers"]] == [("p1", "secret-host-1")]

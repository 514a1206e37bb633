"""Pool selectors, utilization history, /api/pools/ and /dashboard/: live registry + ledger state; tenant names
for superusers only."""
import json
import time

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from incidents.models import CanaryRun
from incidents.pools import DIRTY, FREE, OTHER, page_map_get, pool_state_list, worker_admin_list
from incidents.selectors import canary_latest_get, dashboard_get, incident_open_list
from incidents.services import incident_record, incident_resolve
from incidents.history import history_sample
from inference.ledger import RedisLedger
from kvserve.chat.salt import request_salt
from kvserve.tenants.models import Tenant
from tests.incidents.helpers import chat_request, live_worker

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


@pytest.fixture
def staff_user():
    return User.objects.create_user("ops", password="pw-ops-123", is_staff=True)


@pytest.fixture
def pools(registry, make_worker):
    """prefill: 8 pages x 16 (128 >= window 100, SAFE); decode: 4 pages x 16 (64 < 100, UNSAFE), 3 owned, 1 dirty."""
    acme, globex = Tenant.objects.create(name="acme"), Tenant.objects.create(name="globex")
    a, g = chat_request(acme), chat_request(globex)
    prefill = live_worker(registry, make_worker, "prefill", worker_id="prefill-1", num_pages=8, capacity_tokens=128,
                          window=100)
    decode = live_worker(registry, make_worker, "decode", worker_id="decode-1", num_pages=4, capacity_tokens=64,
                         window=100, faults=["no_scrub"])
    decode.allocate(a.id, 2)
    decode.allocate(g.id, 1)
    RedisLedger(registry.redis, "decode-1", prefix=registry.prefix, lease_ttl_s=0.001).allocate("probe-owner", 1)
    time.sleep(0.01)
    assert decode.reap_expired()  # the probe's lease ran out: its page is dirty until scrubbed
    return {"acme": acme, "globex": globex, "a": a, "g": g, "prefill": prefill, "decode": decode}


def test_pool_state_list_counts_capacity_and_safety(pools, admin_user):
    workers, maps = pool_state_list(user=admin_user)
    by_id = {w["id"]: w for w in workers}
    assert [w["role"] for w in workers] == ["prefill", "decode"]
    p, d = by_id["prefill-1"], by_id["decode-1"]
    assert (p["capacity_tokens"], p["window"], p["safe"], p["num_pages"]) == (128, 100, True, 8)
    assert (p["used"], p["free"], p["dirty"], p["utilization"]) == (0, 8, 0, 0.0)
    assert (d["capacity_tokens"], d["window"], d["safe"]) == (64, 100, False)
    assert (d["used"], d["free"], d["dirty"], d["utilization"]) == (3, 0, 1, 0.75)
    assert d["faults"] == ["no_scrub"] and not d["quarantined"]
    assert len(maps["prefill-1"]["cells"]) == 8 and len(maps["decode-1"]["cells"]) == 4


def test_page_map_names_tenants_for_superusers_only(pools, admin_user, staff_user):
    acme, globex = pools["acme"], pools["globex"]
    _, maps = pool_state_list(user=admin_user)
    assert maps["decode-1"]["cells"] == [acme.pk, acme.pk, globex.pk, DIRTY]
    legend = {e["code"]: e for e in maps["decode-1"]["legend"]}
    assert legend[acme.pk]["label"] == "acme" and legend[acme.pk]["pages"] == 2
    assert legend[acme.pk]["request_ids"] == [pools["a"].id]
    _, maps = pool_state_list(user=staff_user)
    legend = {e["code"]: e for e in maps["decode-1"]["legend"]}
    assert legend[acme.pk]["label"] == f"tenant #{acme.pk}" and "request_ids" not in legend[acme.pk]
    assert "acme" not in json.dumps(maps) and "globex" not in json.dumps(maps)


def test_page_map_marks_owners_that_are_not_chat_requests():
    snapshot = {0: "free", 1: {"owner": "canary-sandbox-1", "epoch": 3}, 2: "dirty", 3: "lost"}
    page_map = page_map_get(snapshot, show_names=False)
    assert page_map["cells"] == [FREE, OTHER, DIRTY, -2]
    assert page_map["legend"] == [{"code": OTHER, "label": "not a chat request", "pages": 1, "cached": 0,
                                   "num_requests": 1}]


def test_page_map_counts_prefix_cached_pages_for_their_tenant(pools, admin_user, staff_user):
    """A cached page's owner is its scope's cache entry; the map shows it as its tenant's, names for superusers."""
    acme, a = pools["acme"], pools["a"]
    prefill = pools["prefill"]
    grant = prefill.allocate(a.id, 3)
    prefill.cache(a.id, request_salt(acme, None), grant.pages[:2], grant.epochs[:2])
    prefill.allocate("narrowed-probe", 1)
    narrowed = prefill.allocate("narrowed-probe2", 1)
    prefill.cache("narrowed-probe2", request_salt(acme, "alice"), narrowed.pages, narrowed.epochs)
    _, maps = pool_state_list(user=admin_user)
    legend = {e["code"]: e for e in maps["prefill-1"]["legend"]}
    assert maps["prefill-1"]["cells"][:3] == [acme.pk] * 3
    assert (legend[acme.pk]["label"], legend[acme.pk]["pages"], legend[acme.pk]["cached"]) == ("acme", 3, 2)
    assert legend[acme.pk]["num_requests"] == 1  # the cache entry is no request
    assert legend[OTHER]["cached"] == 1 and legend[OTHER]["pages"] == 2  # user-narrowed scope and a probe
    _, maps = pool_state_list(user=staff_user)
    assert "acme" not in json.dumps(maps) and request_salt(acme, None) not in json.dumps(maps)


def test_polling_samples_nothing_the_history_beat_does(admin_client, pools, settings):
    assert all(w["history"] == [] for w in admin_client.get("/api/pools/").json()["workers"])
    history_sample(now=time.time() - 1)
    decode = next(w for w in admin_client.get("/api/pools/").json()["workers"] if w["id"] == "decode-1")
    assert [s[1:] for s in decode["history"]] == [[3, 0, 1]]


def test_dashboard_get_has_limit_canary_and_open_incidents(pools, admin_user):
    incident = incident_record(kind="foreign_read", severity="critical", worker="decode-1", pool="decode-1",
                               pages=[2], detected_by="test")
    closed = incident_record(kind="lease_expired", severity="warning", detected_by="test")
    incident_resolve(incident=closed, by_user=admin_user)
    body = dashboard_get(user=admin_user)
    assert body["effective_context_limit"] is None  # decode-1 is quarantined now: no decode worker serves
    assert [i["id"] for i in body["open_incidents"]] == [incident.pk] and body["open_incidents_total"] == 1
    assert next(w for w in body["workers"] if w["id"] == "decode-1")["quarantine_reason"].startswith("incident #")
    assert body["latest_canary"] is None and "error" not in body
    json.dumps(body)  # serialisable as is


def test_effective_limit_is_the_registry_one(pools, registry, admin_user):
    pools["decode"].release(pools["a"].id)
    assert dashboard_get(user=admin_user)["effective_context_limit"] == registry.effective_limit() == 64


def test_canary_latest_and_open_incidents(admin_user):
    CanaryRun.objects.create(started_at=timezone.now() - timezone.timedelta(hours=1), passed=False, checks=[])
    run = CanaryRun.objects.create(started_at=timezone.now(), passed=True, checks=[
        {"name": "marker_scan", "passed": True, "duration_s": 1.5, "details": {"markers": 4}}])
    latest = canary_latest_get()
    assert latest["id"] == run.pk and latest["passed"]
    assert latest["checks"] == [{"name": "marker_scan", "passed": True, "outcome": "passed", "duration_s": 1.5,
                                  "details": {"markers": 4}, "per_worker": {}}]
    assert incident_open_list() == []


def test_dashboard_get_reports_redis_down(settings, admin_user):
    settings.REDIS_URL = "redis://127.0.0.1:1/15"
    body = dashboard_get(user=admin_user)
    assert body["workers"] == [] and "Redis unreachable" in body["error"]


def test_worker_admin_list_keeps_quarantined_workers_that_are_gone(pools, registry):
    registry.quarantine("decode-dead", reason="incident #9: foreign_read")
    rows = {r["id"]: r for r in worker_admin_list()}
    assert rows["decode-dead"] == {**rows["decode-dead"], "live": False, "quarantined": True,
                                   "quarantine_reason": "incident #9: foreign_read"}
    assert rows["decode-1"]["live"] and rows["decode-1"]["safe"] is False and rows["prefill-1"]["safe"] is True


# --- /api/pools/ and /dashboard/ -----------------------------------------------------------------

def test_api_pools_requires_a_staff_session(client, pools, django_user_model):
    response = client.get("/api/pools/")
    assert response.status_code == 403 and "staff" in response.json()["error"]["message"]
    django_user_model.objects.create_user("tenant-user", password="pw-x-12345")
    client.login(username="tenant-user", password="pw-x-12345")
    assert client.get("/api/pools/").status_code == 403


def test_api_pools_returns_the_overview(admin_client, pools):
    response = admin_client.get("/api/pools/")
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    body = response.json()
    decode = next(w for w in body["workers"] if w["id"] == "decode-1")
    expected = {"role", "capacity_tokens", "window", "safe", "num_pages", "used", "free", "dirty", "utilization",
                "faults", "quarantined", "heartbeat", "history"}
    assert expected <= decode.keys()
    assert (decode["used"], decode["free"], decode["dirty"]) == (3, 0, 1)
    assert decode["history"] == []  # polling samples nothing (the history beat does)
    assert set(body["page_maps"]) == {"prefill-1", "decode-1"}
    assert body["effective_context_limit"] == 64
    assert {"latest_canary", "open_incidents"} <= body.keys()


def test_dashboard_page_is_staff_only_and_self_contained(client, admin_client, pools, django_user_model):
    assert client.get("/dashboard/").status_code == 302  # to the admin login
    page = admin_client.get("/dashboard/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="dashboard-data"' in html and "/api/pools/" in html
    assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html
    for asset in ("incidents/dashboard.js", "incidents/dashboard.css"):
        assert asset in html
        assert admin_client.get(f"/static/{asset}").status_code == 200


def test_page_map_counts_a_requests_choices_and_their_shared_prompt_for_its_tenant(pools, admin_user):
    """n choices: each choice's own pages and the prompt pages they share (the request scope's cache entry) are the
    request's tenant's."""
    from inference.choices import choice_id, choice_scope

    acme, a = pools["acme"], pools["a"]
    prefill = pools["prefill"]
    c0, c1 = choice_id(a.id, 0), choice_id(a.id, 1)
    grant = prefill.allocate(c0, 2)
    prefill.cache(c0, choice_scope(a.id), grant.pages[:1], grant.epochs[:1])
    prefill.allocate(c1, 1)
    assert prefill.hit(c1, choice_scope(a.id), grant.pages[:1], grant.epochs[:1])
    _, maps = pool_state_list(user=admin_user)
    legend = {e["code"]: e for e in maps["prefill-1"]["legend"]}
    assert maps["prefill-1"]["cells"][:3] == [acme.pk] * 3
    assert (legend[acme.pk]["pages"], legend[acme.pk]["cached"], legend[acme.pk]["request_ids"]) == (3, 1, [a.id])

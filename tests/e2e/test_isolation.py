"""A KV-isolation violation through real worker processes, end to end: a fault inside one decode worker's own
process (KVSERVE_FAULTS=foreign_page_once) makes a real request's block table point at a page it does not own;
the worker's read guard stops it; the client gets 503 kv_isolation_violation and no content; the incident names
reader, page, previous owner and epochs; the worker is quarantined and stops consuming (the next requests are
served by the other decode worker); a staff user releases it on the admin's Workers page; it serves again."""
import json
import re
import sqlite3
import time

import httpx
import pytest

from tests.e2e.stack import Stack

pytestmark = pytest.mark.timeout(300)
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture
def two_decoders(tmp_path, tiny_paths):
    """1 prefill + 2 decode workers (one with the fault) + web, tiny model, SQLite."""
    s = Stack(tmp_path, KVSERVE_MODEL=str(tiny_paths["gguf"]), KVSERVE_WINDOW="2048")
    try:
        s.manage("migrate", "--noinput")
        creds = json.loads(s.manage("bootstrap_demo").strip().splitlines()[-1])
        s.api_key, s.admin_password = creds["api_key"], creds["admin_password"]
        s.start_worker("prefill", queues="prefill,maintenance")
        s.start_worker("decode", name="decode-healthy")
        s.start_worker("decode", name="decode-faulty", KVSERVE_FAULTS="foreign_page_once")
        s.start_web()
        s.wait_healthy()
        s.wait_workers("decode", 2)
        yield s
    finally:
        s.close()


def workers_by_name(stack) -> dict[str, str]:
    live = stack.registry().live_workers("decode")
    faulty = [w.worker_id for w in live if "foreign_page_once" in w.faults]
    healthy = [w.worker_id for w in live if "foreign_page_once" not in w.faults]
    assert len(faulty) == len(healthy) == 1, live
    return {"faulty": faulty[0], "healthy": healthy[0]}


def db(stack, query, *params):
    with sqlite3.connect(stack.workdir / "db.sqlite3") as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(query, params).fetchall()]


def ask(stack) -> tuple[httpx.Response, dict]:
    """One non-streamed completion; (response, its request's row)."""
    before = {r["id"] for r in db(stack, "select id from chat_chatrequest")}
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {stack.api_key}"},
                   json={"messages": MESSAGES, "max_tokens": 8, "temperature": 0.0})
    (row,) = [x for x in db(stack, "select * from chat_chatrequest") if x["id"] not in before]
    # the answer comes from the stream, before the worker's task writes the row's end: wait for it
    row = wait_for(lambda: (x := db(stack, "select * from chat_chatrequest where id = ?", row["id"])[0])["status"]
                   in ("done", "failed", "rejected") and x, what="the row to end")
    return r, row


def wait_for(predicate, timeout_s=30.0, what="it"):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def admin_client(stack) -> httpx.Client:
    client = httpx.Client(base_url=stack.url, timeout=30)
    page = client.get("/admin/login/?next=/admin/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    r = client.post("/admin/login/?next=/admin/", data={"username": "admin", "password": stack.admin_password,
                                                        "csrfmiddlewaretoken": token, "next": "/admin/"})
    assert r.status_code == 302 and "sessionid" in client.cookies, r.text[:500]
    return client


def test_a_violation_in_a_decode_worker_fails_closed_is_an_incident_quarantines_and_an_admin_releases_it(two_decoders):
    stack = two_decoders
    ids = workers_by_name(stack)
    # 1. requests until one lands on the faulty worker: its first request meets the fault
    for _ in range(12):
        r, row = ask(stack)
        if row["decode_worker"] == ids["faulty"]:
            break
        assert r.status_code == 200 and row["status"] == "done"
    else:
        pytest.fail("no request reached the faulty decode worker")
    body = r.json()
    assert r.status_code == 503 and body["error"]["code"] == "kv_isolation_violation" and "choices" not in body
    assert (row["status"], row["error_code"], row["completion_text"]) == ("failed", "kv_isolation_violation", None)
    # 2. the incident: reader, page, previous owner, epochs, worker
    # incident_record saves the row, then quarantines and marks it: wait for the mark
    (incident,) = wait_for(lambda: db(stack, "select * from incidents_incident where reader_request = ? and "
                                             "quarantined = 1", row["id"]), what="the incident, marked quarantined")
    epochs = json.loads(incident["epochs"])
    assert (incident["kind"], incident["severity"], incident["worker"], incident["quarantined"]) == (
        "foreign_read", "critical", ids["faulty"], 1)
    assert incident["previous_owner_request"].startswith("fault-bystander-") and len(json.loads(incident["pages"])) == 1
    assert set(epochs) == {"reader", "page"} and epochs["reader"] != epochs["page"]
    assert "ownership guard" in incident["detected_by"]
    # 3. quarantined: it stops consuming its queue; the next requests are all served by the other worker
    assert stack.registry().is_quarantined(ids["faulty"])
    wait_for(lambda: "quarantined: stopped consuming decode" in stack.tail("decode-faulty", 200_000),
             what="the quarantined worker to stop consuming")
    for _ in range(4):  # with both consuming, each lands on either: 1/16 that all four miss the quarantined one
        r, row = ask(stack)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert row["decode_worker"] == ids["healthy"]
    # 4. a staff user releases it on the admin's Workers page (real HTTP, login, CSRF)
    admin = admin_client(stack)
    page = admin.get("/admin/workers/")
    assert ids["faulty"] in page.text
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    r = admin.post("/admin/workers/", data={"worker_id": ids["faulty"], "notes": "e2e: fault understood",
                                            "csrfmiddlewaretoken": token})
    assert r.status_code == 302 and not stack.registry().is_quarantined(ids["faulty"])
    wait_for(lambda: "released from quarantine: consuming decode again" in stack.tail("decode-faulty", 200_000),
             what="the released worker to consume again")
    # 5. it serves again
    for _ in range(12):
        r, row = ask(stack)
        assert r.status_code == 200 and row["status"] == "done"
        if row["decode_worker"] == ids["faulty"]:
            break
    else:
        pytest.fail("the released worker never served again")
    assert db(stack, "select count(*) as n from incidents_incident where severity = 'critical'")[0]["n"] == 1

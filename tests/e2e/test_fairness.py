"""Fair share on the real stack, work-conserving: a tenant alone is admitted beyond its in-flight share; while
another tenant has a request in flight, its excess is refused at once (429, Retry-After, the share named) and
the other tenant's request is served during the flood."""
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest


def chat(stack, key, content, max_tokens):
    """(status, Retry-After, body) of one chat completion."""
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(stack.url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.headers.get("Retry-After"), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After"), json.loads(e.read())


def unfinished(stack, tenant) -> int:
    rows = stack.sql("SELECT COUNT(*) FROM chat_chatrequest r JOIN tenants_tenant t ON r.tenant_id = t.id "
                     "WHERE t.name = ? AND r.status NOT IN ('done', 'failed', 'rejected')", tenant)
    return rows[0][0]


def flood_of(stack, key, n, max_tokens=24):
    with ThreadPoolExecutor(n) as pool:
        return [f.result() for f in [pool.submit(chat, stack, key, f"Count from one to fifty, number {i}.",
                                                 max_tokens) for i in range(n)]]


@pytest.mark.timeout(600)
def test_a_tenant_alone_is_served_beyond_its_share_and_refused_beyond_it_while_another_waits(stack):
    flood = stack.manage("create_api_key", "fair-flood").strip().splitlines()[-1]
    light = stack.manage("create_api_key", "fair-light").strip().splitlines()[-1]
    stack.manage("shell", "-c", "from kvserve.tenants.models import Tenant; "
                 "Tenant.objects.filter(name='fair-flood').update(max_in_flight=2, kv_share=0.5)")
    alone = flood_of(stack, flood, 6)  # nobody else in flight: all 6 admitted, 3x its share of 2
    assert [r[0] for r in alone] == [200] * 6, alone
    served = []
    waiting = threading.Thread(target=lambda: served.append(
        chat(stack, light, "Tell a long story about the sea and its ships.", 160)))
    waiting.start()  # tenant B's request, in flight while A floods
    deadline = time.monotonic() + 60
    while unfinished(stack, "fair-light") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert unfinished(stack, "fair-light") == 1
    results = flood_of(stack, flood, 6)
    still_waiting = unfinished(stack, "fair-light") == 1
    waiting.join(300)
    assert served and served[0][0] == 200 and served[0][2]["choices"][0]["message"]["content"], served
    assert still_waiting, "B finished before A's flood was judged: the test did not contend"
    statuses = sorted(r[0] for r in results)
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
    for status, retry_after, body in results:
        if status == 429:
            assert retry_after and int(retry_after) >= 1
            assert body["error"]["code"] == "tenant_in_flight_limit", body
            assert "the tenant's max_in_flight" in body["error"]["message"]
    rows = stack.sql("SELECT COUNT(*) FROM chat_chatrequest r JOIN tenants_tenant t ON r.tenant_id = t.id "
                     "WHERE t.name = ?", "fair-flood")
    assert rows[0][0] == 6 + statuses.count(200)  # a refused request leaves no row and queues nothing

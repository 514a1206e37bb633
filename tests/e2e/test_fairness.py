"""Fair share on the real stack: tenant A's flood is refused at once (429, Retry-After, the limit named) beyond
its in-flight limit, while tenant B's request is admitted and served during the flood."""
import json
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


@pytest.mark.timeout(600)
def test_a_flooding_tenant_is_refused_beyond_its_limit_and_another_is_served(stack):
    flood = stack.manage("create_api_key", "fair-flood").strip().splitlines()[-1]
    light = stack.manage("create_api_key", "fair-light").strip().splitlines()[-1]
    stack.manage("shell", "-c", "from kvserve.tenants.models import Tenant; "
                 "Tenant.objects.filter(name='fair-flood').update(max_in_flight=2, kv_share=0.5)")
    with ThreadPoolExecutor(8) as pool:
        flooding = [pool.submit(chat, stack, flood, f"Count from one to fifty, number {i}.", 48) for i in range(6)]
        served = chat(stack, light, "What is the capital of France?", 8)  # sent while A's requests run
        results = [f.result() for f in flooding]
    assert served[0] == 200 and served[2]["choices"][0]["message"]["content"], served
    statuses = sorted(r[0] for r in results)
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
    for status, retry_after, body in results:
        if status == 429:
            assert retry_after and int(retry_after) >= 1
            assert body["error"]["code"] == "tenant_in_flight_limit", body
            assert "the tenant's max_in_flight" in body["error"]["message"]
    rows = stack.sql("SELECT COUNT(*) FROM chat_chatrequest r JOIN tenants_tenant t ON r.tenant_id = t.id "
                     "WHERE t.name = ?", "fair-flood")
    assert rows[0][0] == statuses.count(200)  # a refused request leaves no row and queues nothing

"""A stack serving as `make run` does on the CPUs measured (w4a8, so both workers keep bf16 KV pools): the KV that
crosses from prefill to decode is bf16 pages; a chat completes, the registrations, the dashboard's data and /metrics
say what each pool holds, and the canary (live probes of each worker's handoff verification, read guard and scrub,
marker traffic, the self-test) passes over bf16 pools."""
import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.stack import Stack
from tests.e2e.test_canary import canary
from tests.e2e.test_chat_api import http


@pytest.fixture(scope="module")
def w4a8_stack(tmp_path_factory, real_model):
    s = Stack(tmp_path_factory.mktemp("w4a8-stack"), KVSERVE_PRECISION="w4a8", KVSERVE_CANARY_TIMEOUT_S="400")
    try:
        yield s.start()
    finally:
        s.close()


@pytest.mark.timeout(600)
def test_a_w4a8_stack_serves_over_bf16_pools_and_its_canary_passes(w4a8_stack):
    s = w4a8_stack
    workers = s.registry().live_workers()
    assert sorted(w.role for w in workers) == ["decode", "prefill"]
    assert all(w.precision == "w4a8" and w.dtype == "bfloat16" for w in workers), workers
    assert all(w.pool_bytes == w.num_pages * 30 * 2 * 16 * 3 * 64 * 2 for w in workers)  # 2 bytes a value

    status, _, raw = http(s, "POST", "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 24})
    assert status == 200, raw
    body = json.loads(raw)
    assert body["choices"][0]["message"]["content"].strip() and body["usage"]["completion_tokens"] >= 1

    with urllib.request.urlopen(s.metrics_request(), timeout=30) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    pool_bytes = {x.labels["worker"]: x.value for x in families["kvserve_worker_kv_pool_bytes"].samples}
    assert pool_bytes == {w.worker_id: w.pool_bytes for w in workers}
    assert {x.labels["cache_dtype"] for x in families["kvserve_cache_config_info"].samples} == {"bfloat16"}

    rc, result, log = canary(s)
    assert rc == 0 and result["passed"] is True, log
    assert all(c["passed"] for c in result["checks"]), log

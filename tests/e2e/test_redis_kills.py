"""A dropped Redis connection is not a failed request: every Redis connection of a real stack (web, workers, their
Celery broker connections; found through the processes' sockets) killed every second while requests stream and
wait, and every request completes; the books balance after. The long version is `python -m bench.redis_kills`."""
import threading

import httpx
import pytest
import redis

from bench.redis_kills import kill_stack_connections
from tests.e2e.stack import Stack
from tests.e2e.test_faults import LONG, books_balance

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def kstack(tmp_path, tiny_paths):
    s = Stack(tmp_path, KVSERVE_MODEL=str(tiny_paths["gguf"]), KVSERVE_WINDOW="2048")
    try:
        yield s.start()
    finally:
        s.close()


def complete(stack, stream: bool, out: list) -> None:
    body = {"messages": LONG, "max_tokens": 200, "stream": stream, "temperature": 0.0}
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    with httpx.Client(timeout=120) as client:
        if not stream:
            r = client.post(stack.url + "/v1/chat/completions", json=body, headers=headers)
            out.append("done" if r.status_code == 200 else f"{r.status_code} {r.text[:200]}")
            return
        with client.stream("POST", stack.url + "/v1/chat/completions", json=body, headers=headers) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        errors = [line for line in lines if '"error"' in line]
        out.append("done" if r.status_code == 200 and lines[-1] == "data: [DONE]" and not errors
                   else f"{r.status_code} {errors[:1]}")


def test_requests_complete_while_every_redis_connection_of_the_stack_is_killed_each_second(kstack):
    admin = redis.Redis.from_url(kstack.env["REDIS_URL"])
    out: list[str] = []
    clients = [threading.Thread(target=complete, args=(kstack, i % 2 == 0, out)) for i in range(4)]
    for t in clients:
        t.start()
    killed = 0
    while any(t.is_alive() for t in clients):
        killed += kill_stack_connections(kstack, admin)
        for t in clients:
            t.join(1.0 / len(clients))
    assert killed >= 8  # connections were killed while the requests ran
    assert out == ["done"] * 4
    for role in ("prefill", "decode"):
        books_balance(kstack, role)

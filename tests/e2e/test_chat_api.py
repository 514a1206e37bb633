"""The chat API on a real stack (Celery prefill + decode workers with the real model, uvicorn): the official
`openai` client, admission that leaves no trace, tenant isolation over HTTP, concurrency (16 requests
match the engine alone; 64 streams at once all finish)."""
import asyncio
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from inference.engine import Engine, EngineConfig
from inference.ledger import RedisLedger, pool_ids
from inference.sequence import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.api_key, max_retries=0, timeout=240)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def http(stack, method, path, body=None, key=None):
    """(status, headers, raw body) of one call, errors included."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(stack.url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {key or getattr(stack, 'api_key', '')}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def wait_final(stack, request_id, key=None, timeout_s=30) -> dict:
    """The request's detail once its row is final (decode updates the row just after the last event)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, _, raw = http(stack, "GET", f"/api/requests/{request_id}", key=key)
        body = json.loads(raw)
        if status != 200 or body["status"] in ("done", "failed", "rejected") or time.monotonic() > deadline:
            return body
        time.sleep(0.2)


def test_openai_client_non_stream(stack, client, model_id, real_model):
    assert model_id == "SmolLM2-135M-Instruct"
    r = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=32)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"
    prompt_tokens = len(real_model.tokenizer.encode_chat(QUESTION))
    assert r.usage.prompt_tokens == prompt_tokens and 0 < r.usage.completion_tokens <= 32
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == model_id
    detail = wait_final(stack, r.id)
    assert detail["status"] == "done" and detail["usage"] == r.usage.model_dump(include={
        "prompt_tokens", "completion_tokens", "total_tokens"})
    assert detail["verdicts"] == {"handoff": "OK", "decode": "accepted"} and detail["error"] is None
    assert detail["timings"]["total_ms"] > 0 and detail["workers"]["prefill"] and detail["workers"]["decode"]


def test_openai_client_stream(stack, client, model_id):
    chunks = list(client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=32, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    # the replay of the same request gives the same text
    status, headers, raw = http(stack, "GET", f"/api/requests/{chunks[0].id}/stream")
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == text
    assert raw.decode().rstrip().endswith("data: [DONE]")


def test_openai_client_errors(client, model_id):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_id, messages=QUESTION, n=9)
    assert exc.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="kvs-wrong", max_retries=0).models.list()


def _ledger_state(stack) -> dict:
    r, prefix = stack.redis, stack.prefix
    pools = pool_ids(r, prefix)
    broker = {k.decode(): r.llen(k) for k in r.scan_iter(match=f"{prefix}:broker:*") if r.type(k) == b"list"}
    # every key of the stack (ledger, registry, output streams, transport, broker) except counters:
    # the throttle's and /metrics' admission-rejection count, which exist to count exactly this
    counters = (f"{prefix}:cache:", f"{prefix}:metrics:")
    keys = {k.decode() for k in r.scan_iter(match=f"{prefix}:*") if not k.decode().startswith(counters)}
    (rows,), = stack.sql("select count(*) from chat_chatrequest")
    return {"pools": pools, "free": {p: (RedisLedger(r, p, prefix=prefix).num_free(),
                                         RedisLedger(r, p, prefix=prefix).num_pages) for p in pools},
            "broker": broker, "keys": keys, "rows": rows}


@pytest.mark.parametrize("case", ["max_tokens", "prompt"])
def test_overlong_request_is_refused_before_anything_happens(stack, client, model_id, real_model, case):
    client.models.list()  # the throttle's counter exists before the snapshot
    before = _ledger_state(stack)
    assert len(before["pools"]) == 2  # (the prefill pool may keep earlier prompts' pages: its prefix cache)
    limit = 8192
    if case == "max_tokens":
        messages, max_tokens = QUESTION, 8192
    else:
        messages, max_tokens = [{"role": "user", "content": "word " * 9000}], 16
    prompt_tokens = len(real_model.tokenizer.encode_chat(messages))
    status, _, raw = http(stack, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens})
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "messages"
    for number in (limit, prompt_tokens + max_tokens, prompt_tokens, max_tokens):
        assert str(number) in error["message"], (number, error["message"])
    time.sleep(0.5)  # anything queued would have been picked up by now
    after = _ledger_state(stack)
    assert after["free"] == before["free"]  # nothing reserved
    assert after["keys"] == before["keys"]  # no ledger/stream/queue key written
    assert after["broker"] == before["broker"]  # nothing queued
    assert after["rows"] == before["rows"]  # no ChatRequest row


def test_tenant_isolation_over_http(stack, client, model_id):
    other = stack.manage("create_api_key", "other").strip().splitlines()[-1]
    r = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=4)
    for suffix in ("", "/stream"):
        status, _, raw = http(stack, "GET", f"/api/requests/{r.id}{suffix}", key=other)
        assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
        assert b"Paris" not in raw
    assert http(stack, "GET", f"/api/requests/{r.id}")[0] == 200
    theirs = openai.OpenAI(base_url=stack.url + "/v1", api_key=other, max_retries=0).chat.completions.create(
        model=model_id, messages=QUESTION, max_tokens=4)
    assert http(stack, "GET", f"/api/requests/{theirs.id}")[0] == 404
    assert http(stack, "GET", f"/api/requests/{theirs.id}", key=other)[0] == 200


PROMPTS = [f"Name one famous thing about {place}." for place in (
    "Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Rome", "Delhi", "Sydney", "Toronto", "Nairobi", "Madrid",
    "Seoul", "Berlin", "Mexico City", "Istanbul")] + ["Write a haiku about the sea, then explain it in one line."]


@pytest.mark.timeout(600)
def test_16_concurrent_requests_match_the_engine_alone(client, model_id, real_model):
    """Issue 4's acceptance test: disaggregated, concurrent serving gives the engine's own greedy text."""
    max_tokens = 24
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    engine = Engine(real_model, EngineConfig(num_pages=512, window=8192))
    expected = [s.text for s in engine.generate([real_model.tokenizer.encode_chat(m) for m in messages],
                                                SamplingParams(max_tokens=max_tokens))]

    def ask(m):
        r = client.chat.completions.create(model=model_id, messages=m, max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content

    with ThreadPoolExecutor(len(messages)) as pool:
        got = list(pool.map(ask, messages))
    assert len(set(expected)) == len(expected)  # the prompts really differ
    assert got == expected


@pytest.mark.timeout(600)
def test_64_concurrent_streams_all_complete(stack, model_id):
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=stack.api_key, max_retries=0, timeout=300)
    web_pid = stack.procs["web"].pid
    peak_threads = []

    async def one(i):
        stream = await client.chat.completions.create(
            model=model_id, max_tokens=8, stream=True,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}])
        text, finish = "", []
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                if chunk.choices[0].finish_reason:
                    finish.append(chunk.choices[0].finish_reason)
        return text, finish

    async def watch_threads(done: asyncio.Event):
        while not done.is_set():
            status = Path(f"/proc/{web_pid}/status").read_text()
            peak_threads.append(int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads"))))
            await asyncio.sleep(0.2)

    async def main():
        done = asyncio.Event()
        watcher = asyncio.create_task(watch_threads(done))
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            done.set()
            await watcher
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 64
    assert all(finish in (["stop"], ["length"]) and text for text, finish in results), results
    print(f"web process threads during 64 streams: peak {max(peak_threads)}")


def test_client_disconnect_mid_stream_leaves_the_server_serving(stack, client, model_id):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": QUESTION, "max_tokens": 64, "stream": True}),
                 {"Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    conn.close()  # hang up after the first event
    r = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=32)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert "Traceback" not in stack.tail("web", 20000)


@pytest.mark.timeout(300)
def test_no_live_workers_is_503_and_nothing_is_queued(own_stack):
    own_stack.manage("migrate", "--noinput")
    key = json.loads(own_stack.manage("bootstrap_demo").strip().splitlines()[-1])["api_key"]
    own_stack.start_web()
    deadline = time.monotonic() + 60
    while True:
        try:
            status = http(own_stack, "GET", "/healthz")[0]
            break
        except OSError:
            assert time.monotonic() < deadline, own_stack.tail("web")
            time.sleep(0.3)
    assert status == 503
    status, _, raw = http(own_stack, "POST", "/v1/chat/completions", {"messages": QUESTION}, key=key)
    error = json.loads(raw)["error"]
    assert status == 503 and error["code"] == "no_workers" and error["type"] == "service_unavailable"
    assert own_stack.sql("select count(*) from chat_chatrequest") == [(0,)]
    assert not [k for k in own_stack.redis.scan_iter(match=f"{own_stack.prefix}:broker:*")
                if own_stack.redis.type(k) == b"list" and own_stack.redis.llen(k)]

"""The concurrency-sensitive paths on PostgreSQL (the production database): several prefill and decode worker
processes claiming and finishing rows at once while other processes record incidents, and the reaper failing
the requests of a worker killed mid-decode. The tiny model: only concurrency matters here."""
import json
import signal
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.stack import Stack

RECORD_INCIDENTS = """
from incidents.services import incident_record
for i in range({n}):
    incident_record(kind="lease_expired", severity="warning", pool="load-test", detected_by="pg load test {tag}",
                    details={{"i": i}})
print("recorded")
"""
REAP = ("import json; from kvserve.chat.reaper import requests_reap_orphans as r; "
        "print(json.dumps(r(), default=str))")


def tiny_stack(stack: Stack, tiny_paths, concurrency: int) -> Stack:
    stack.env.update(KVSERVE_MODEL=str(tiny_paths["gguf"]), KVSERVE_WINDOW="2048", KVSERVE_NUM_PAGES="256",
                     KVSERVE_WORKER_CONCURRENCY=str(concurrency))
    return stack


def rows(stack: Stack) -> dict[str, tuple]:
    return {r[0]: r[1:] for r in stack.sql(
        "select id, status, prefill_deliveries, decode_deliveries, handoff_verdict, prefill_worker, decode_worker, "
        "error_code from chat_chatrequest")}


@pytest.mark.timeout(600)
def test_many_workers_claim_and_finish_rows_while_incidents_are_recorded(postgres_stack, tiny_paths):
    stack = tiny_stack(postgres_stack, tiny_paths, concurrency=4).start()
    stack.start_worker("prefill", name="prefill2")
    stack.start_worker("decode", name="decode2")
    stack.wait_workers("prefill", 2)
    decoders = {w.worker_id for w in stack.wait_workers("decode", 2)}
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.api_key, max_retries=0, timeout=300)
    recorders = [stack.spawn(f"incidents{i}", [sys.executable, "manage.py", "shell", "-c",
                                               RECORD_INCIDENTS.format(n=25, tag=i)]) for i in range(3)]

    def ask(i: int):
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"request {i}"}],
                                              max_tokens=120, temperature=0.8, seed=i)

    with ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(ask, range(24)))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in answers)
    for proc in recorders:
        assert proc.wait(timeout=300) == 0
    deadline = time.monotonic() + 60
    while any(r[0] != "done" for r in rows(stack).values()) and time.monotonic() < deadline:
        time.sleep(0.3)  # decode writes the row just after its final event
    table = rows(stack)
    assert set(table) == {r.id for r in answers}
    for rid, (status, prefills, decodes, verdict, _, _, error) in table.items():
        assert (status, prefills, decodes, verdict, error) == ("done", 1, 1, "OK", ""), (rid, table[rid])
    assert {r[5] for r in table.values()} == decoders  # both decode workers finished rows
    assert stack.sql("select count(*) from incidents_incident where pool = 'load-test'") == [(75,)]
    assert stack.sql("select count(distinct id) from incidents_incident where pool = 'load-test'") == [(75,)]
    # the counter every process adds to agrees with the rows, whatever interleaving the recorders had
    ((recorded,),) = stack.sql("select count(*) from incidents_incident where kind = 'lease_expired' "
                               "and severity = 'warning'")
    with urllib.request.urlopen(stack.metrics_request(), timeout=30) as r:
        text = r.read().decode()
    assert f'kvserve_incidents_total{{kind="lease_expired",severity="warning"}} {float(recorded)}' in text


@pytest.mark.timeout(600)
def test_the_reaper_fails_the_requests_of_a_killed_decode_worker(postgres_stack, tiny_paths):
    stack = tiny_stack(postgres_stack, tiny_paths, concurrency=8).start()
    (decoder,) = stack.wait_workers("decode", 1)
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.api_key, max_retries=0, timeout=300)
    # greedy prompts on which the tiny model runs past 300 tokens without an EOS: they are all decoding at the kill
    streams = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"story {i}"}],
                                              max_tokens=1900, stream=True) for i in (2, 4, 7, 9)]
    for s in streams:
        next(iter(s))  # the role chunk: each request is admitted
    deadline = time.monotonic() + 120
    while sum(r[0] == "decoding" for r in rows(stack).values()) < 4:
        assert time.monotonic() < deadline, rows(stack)
        time.sleep(0.2)
    stack.stop("decode", sig=signal.SIGKILL)
    failed: set[str] = set()
    deadline = time.monotonic() + 120
    while len(failed) < 4:
        assert time.monotonic() < deadline, (failed, rows(stack))
        time.sleep(1)
        failed |= set(json.loads(stack.manage("shell", "-c", REAP).strip().splitlines()[-1])["failed_requests"])
    for rid, (status, *_, decode_worker, error) in rows(stack).items():
        assert (status, decode_worker, error) == ("failed", decoder.worker_id, "worker_lost"), rid
    for s in streams:  # every client sees the failure as an error event, not a hang
        with pytest.raises(openai.APIError):
            for _ in s:
                pass

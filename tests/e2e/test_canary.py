"""Canaries on a real stack (Celery prefill + decode workers with the real model, uvicorn, SQLite, Redis DB 15):
`manage.py canary --json` passes on a healthy stack; with each fault injected into a live worker the
matching check fails, an incident names that worker, and the worker is quarantined."""
import json
import os
import sqlite3
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.stack import ROOT, Stack

ALL_CHECKS = ["live_probes", "worker_config", "handoff_contract", "reproduction", "marker", "prefix_scope", "integrity",
              "selftest"]
# fault -> (role of the worker it is injected into, the checks that must then fail)
FAULTS = {
    "no_handoff_check": ("decode", {"handoff_contract", "worker_config"}),
    "no_ownership_guard": ("decode", {"worker_config"}),
    "no_watermark_guard": ("decode", {"worker_config"}),
    "no_scrub": ("prefill", {"worker_config"}),
    "no_admission": ("prefill", {"worker_config"}),
    "placeholder_on_reject": ("prefill", {"worker_config"}),
}


@pytest.fixture(scope="module")
def canary_stack(tmp_path_factory, real_model):
    """A stack of this module's own: the fault test leaves workers quarantined."""
    s = Stack(tmp_path_factory.mktemp("canary-stack"), KVSERVE_CANARY_TIMEOUT_S="400")
    try:
        yield s.start()
    finally:
        s.close()


def canary(stack, *args) -> tuple[int, dict, str]:
    out = stack.manage_status("canary", "--json", *args)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-3000:]
    return out.returncode, json.loads(lines[-1]), out.stdout + out.stderr[-4000:]


def rows(stack, sql, *params) -> list[tuple]:
    with sqlite3.connect(stack.workdir / "db.sqlite3") as db:
        return db.execute(sql, params).fetchall()


@pytest.mark.timeout(600)
def test_canary_passes_on_a_healthy_stack(canary_stack):
    s = canary_stack
    assert "kvserve canary: kvserve.canary, every 5 minutes" in s.manage("setup_schedules")
    rc, body, log = canary(s)
    assert rc == 0 and body["passed"] is True, log
    checks = {c["name"]: c for c in body["checks"]}
    assert list(checks) == ALL_CHECKS and all(c["passed"] for c in checks.values())
    marker = checks["marker"]["details"]
    assert marker["echoed"]["canary-a"] >= 1 and not marker["vacuous"] and marker["leaks"] == []
    assert marker["read_records"] and all(not r["problems"] for r in marker["read_records"].values())
    outcome = {r["probe"]: r for r in marker["requests"]}
    at = outcome["canary-b-at-limit"]
    assert at["prompt_tokens"] + at["max_tokens"] == marker["limit"] and at["final"] == "done"
    for name in ("canary-b-over-by-prompt", "canary-b-over-by-max-tokens"):
        assert outcome[name]["refusal"]["code"] == "context_length_exceeded" and not outcome[name]["request"]
    scope = checks["prefix_scope"]["details"]  # A hits its own sentinel prefix, B's identical prompt does not
    assert not scope["vacuous"] and max(scope["a_cached_tokens"]) > 0 and scope["b_cached_tokens"] == 0
    assert scope["prefill_audits"] and set(scope["prefill_audits"].values()) == {"ok"}
    repro = checks["reproduction"]["details"]
    assert repro["refusal"]["status"] == 400 and repro["rows"] == [] and repro["queues_before"] == repro["queues_after"]
    assert checks["selftest"]["details"]["observable"]["leak_reproduced"]
    assert rows(s, "select passed, json_array_length(checks) from incidents_canaryrun where id = ?", body["run"]) == [
        (1, len(ALL_CHECKS))]
    assert rows(s, "select count(*) from incidents_incident") == [(0,)]
    assert not any(w.quarantined for w in s.registry().live_workers())
    tasks = dict(rows(s, "select task, enabled from django_celery_beat_periodictask"))
    assert tasks == {"kvserve.canary": 1, "kvserve.reap": 1, "kvserve.history_sample": 1}


@pytest.mark.timeout(600)
def test_scheduled_task_runs_the_suite_in_the_maintenance_worker(canary_stack):
    """What beat sends every 5 minutes: `kvserve.canary`, routed to the maintenance queue, which the prefill
    worker consumes; its self-test reuses that worker's loaded model, its marker traffic the same workers."""
    s = canary_stack
    last = rows(s, "select coalesce(max(id), 0) from incidents_canaryrun")[0][0]
    s.manage("shell", "-c", "from kvserve.celery import app; "
                            "app.send_task('kvserve.canary', kwargs={'only': ['marker', 'selftest']})")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        done = rows(s, "select passed, checks from incidents_canaryrun where id > ? and finished_at is not null", last)
        if done:
            break
        time.sleep(1)
    assert done, s.tail("prefill")
    passed, checks = done[0]
    assert passed == 1, checks
    assert [c["name"] for c in json.loads(checks)] == ["marker", "selftest"]
    assert "canary run" in s.tail("prefill", 200_000)


@pytest.mark.timeout(600)
def test_each_fault_on_a_live_worker_fails_its_check_and_quarantines_it(canary_stack):
    s = canary_stack
    healthy = {w.worker_id for w in s.registry().live_workers()}
    for fault, (role, _) in FAULTS.items():  # small pools: the fault, not the size, is under test
        s.start_worker(role, name=f"faulty-{fault}", KVSERVE_FAULTS=fault, KVSERVE_NUM_PAGES="64",
                       KVSERVE_WINDOW="1024")
    for role in ("prefill", "decode"):
        s.wait_workers(role, 1 + sum(r == role for r, _ in FAULTS.values()), timeout_s=240)
    by_fault = {w.faults[0]: w.worker_id for w in s.registry().live_workers() if w.faults}
    assert set(by_fault) == set(FAULTS)

    rc, body, log = canary(s, "--only", "worker_config,handoff_contract,integrity")
    assert rc == 1 and body["passed"] is False, log
    checks = {c["name"]: c for c in body["checks"]}
    assert checks["integrity"]["passed"]  # the books still balance: faults switch guards off, not the ledger
    incidents = rows(s, "select kind, worker, severity, quarantined, detected_by from incidents_incident")
    registry = s.registry()
    for fault, (role, failing) in FAULTS.items():
        worker = by_fault[fault]
        for name in failing:
            assert not checks[name]["passed"], (fault, name)
        assert f"fault injection active: {fault}" in checks["worker_config"]["details"]["workers"][worker]["problems"]
        assert ("config_unsafe", worker, "critical", 1, "canary worker_config") in incidents
        if "handoff_contract" in failing:
            cases = checks["handoff_contract"]["details"]["workers"][worker]["cases"]
            assert {c for c, r in cases.items() if not r["ok"]} == {"rejected", "truncated", "bad_signature", "wrong_request"}
            assert ("handoff_mismatch", worker, "critical", 1, "canary handoff_contract") in incidents
        assert registry.is_quarantined(worker)
    # the healthy workers pass every check and stay in service
    assert all(not registry.is_quarantined(w) for w in healthy)
    assert all(r["ok"] for w in healthy if w.startswith("decode")
               for r in checks["handoff_contract"]["details"]["workers"][w]["cases"].values())
    assert {i[1] for i in incidents} == set(by_fault.values())


# ---- live probes: each worker's own code path, broken inside that worker's process -----------------------

# Loaded by the interpreter of the workers it is given to (PYTHONPATH), never by production code: it breaks
# one check in that process's own code, and registers nothing (no fault string for a canary to read).
BREAKER = '''
import os
_break = os.environ.get("KVSERVE_E2E_BREAK")
if _break == "guard":
    from inference.block_manager import BlockManager
    BlockManager.check_reads = lambda self, seq, num_past, num_new: None
elif _break == "scrub":
    from inference.kv_cache import PagePool
    PagePool.scrub = lambda self, pages: None
elif _break == "handoff":
    import inference.handoff
    inference.handoff._check_contract = lambda *a, **k: None
'''


@pytest.fixture
def probe_stack(tmp_path, tiny_paths):
    s = Stack(tmp_path, KVSERVE_MODEL=str(tiny_paths["gguf"]), KVSERVE_WINDOW="2048",
              KVSERVE_CANARY_CHECK_TIMEOUT_S="120")
    breaker = tmp_path / "breaker"
    breaker.mkdir()
    (breaker / "sitecustomize.py").write_text(BREAKER)
    s.breaker_path = str(breaker)
    try:
        yield s.start()
    finally:
        s.close()


def live_probes(stack) -> tuple[int, dict, str]:
    rc, body, log = canary(stack, "--only", "live_probes")
    (check,) = body["checks"]
    return rc, check, log


@pytest.mark.timeout(600)
def test_live_probes_pass_on_healthy_workers_and_fail_naming_the_worker_whose_check_is_broken(probe_stack):
    s = probe_stack
    rc, check, log = live_probes(s)
    assert rc == 0 and check["passed"], log
    workers = check["details"]["workers"]
    assert {w["role"] for w in workers.values()} == {"prefill", "decode"}
    for worker_id, w in workers.items():
        assert w["checks"]["guard"]["worker"] == worker_id and w["checks"]["scrub"]["nonzero_after_free"] == 0
        if w["role"] == "decode":
            cases = w["checks"]["handoff"]["cases"]
            assert set(cases) == {"valid", "rejected_kv", "truncated", "other_key", "replayed", "swapped_blob"}
            assert cases["valid"]["got"]["status"] == "done" and "delta" not in cases["truncated"]["events"]
    assert rows(s, "select count(*) from incidents_incident") == [(0,)]
    # one decode worker per broken check, each broken in its own process (and registering no fault)
    # the project root too: sitecustomize runs before `python -m` puts the working directory on sys.path
    pythonpath = os.pathsep.join(filter(None, [s.breaker_path, str(ROOT), os.environ.get("PYTHONPATH")]))
    for broken in ("guard", "scrub", "handoff"):
        s.start_worker("decode", name=f"broken-{broken}", KVSERVE_E2E_BREAK=broken, PYTHONPATH=pythonpath)
    live = s.wait_workers("decode", 4, timeout_s=240)
    assert not any(w.faults for w in live)
    rc, check, log = live_probes(s)
    assert rc == 1 and not check["passed"], log
    by_name = {wid: set(w["failed"]) for wid, w in check["details"]["workers"].items()}
    # a worker id is role-host-pid-xxxx; each broken worker is the process the stack started under its name
    broken_ids = {n: wid for n in ("guard", "scrub", "handoff") for wid in by_name
                  if int(wid.split("-")[-2]) == s.procs[f"broken-{n}"].pid}
    assert {n: by_name[wid] for n, wid in broken_ids.items()} == {"guard": {"guard"}, "scrub": {"scrub"},
                                                                  "handoff": {"handoff"}}
    assert all(not failed for wid, failed in by_name.items() if wid not in broken_ids.values())
    incidents = rows(s, "select worker, detected_by, severity from incidents_incident where detected_by like 'canary%'")
    for name, wid in broken_ids.items():
        assert (wid, "canary live_probes", "critical") in incidents
        assert s.registry().is_quarantined(wid)



# ---- a saturated decode worker: every Celery thread busy, the pool near full -------------------------------

def stream_chat(stack, content: str, max_tokens: int, **extra) -> dict:
    """One streamed chat completion read to its end: status, finish reason or error, and when each delta came."""
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "stream": True, **extra}).encode()
    req = urllib.request.Request(stack.url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json"})
    out = {"status": None, "finish": None, "error": None, "deltas": []}
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            out["status"] = r.status
            for line in r:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]
                for choice in chunk.get("choices", []):
                    if (choice.get("delta") or {}).get("content"):
                        out["deltas"].append(time.monotonic())
                    out["finish"] = choice.get("finish_reason") or out["finish"]
    except urllib.error.HTTPError as e:
        out["status"], out["error"] = e.code, e.read()[:500]
    return out


def decode_pool_use(stack) -> float:
    from inference.ledger import RedisLedger

    (w,) = stack.registry().live_workers("decode")
    return 1 - RedisLedger(stack.redis, w.worker_id, prefix=stack.prefix).num_free() / w.num_pages


@pytest.fixture
def busy_stack(tmp_path, tiny_paths):
    """Two Celery threads per worker and a decode pool two long streams fill (130 pages of 16 tokens)."""
    s = Stack(tmp_path, KVSERVE_MODEL=str(tiny_paths["gguf"]), KVSERVE_WINDOW="2048", KVSERVE_NUM_PAGES="130",
              KVSERVE_WORKER_CONCURRENCY="2", KVSERVE_CANARY_CHECK_TIMEOUT_S="70")
    try:
        yield s.start()
    finally:
        s.close()


def decoding(stack) -> int:
    """Client requests decoding now: each holds one of the decode worker's Celery threads."""
    return stack.sql("select count(*) from chat_chatrequest where status = 'decoding' "
                     "and id not like 'canary-probe-%'")[0][0]


@pytest.mark.timeout(900)
def test_a_saturated_decode_worker_is_judged_through_its_probe_lane_and_never_quarantined(busy_stack):
    """Both of the decode worker's Celery threads hold a long stream (more wait in its queue) and its pool is near
    full: the live probes still reach it (its probe lane) and its valid handoff still gets pages (the engine's
    probe reserve), so every probe is judged and passes; nothing is recorded, nothing quarantined, and the
    streams are served throughout."""
    s = busy_stack
    samples, stop = [], threading.Event()

    def sample():
        while not stop.wait(0.5):
            samples.append((time.monotonic(), decoding(s)))

    with ThreadPoolExecutor(4) as pool:  # two decode, two wait in its queue (their KV within its transport TTL)
        # ignore_eos: the tiny random model samples its end-of-sequence token now and then, and a stream that ended
        # after a few tokens (CI: one decode task done in 1.2 s) never let the pool fill
        streams = [pool.submit(stream_chat, s, f"Story {i}. " + "the sea is wide " * 68, 1000, ignore_eos=True)
                   for i in range(4)]
        # the probes start once two streams hold the pool near full (the loop's deadline fails the test otherwise;
        # reading the use again after it proves nothing: a stream may end or be preempted right after). Two prompts
        # (931 tokens, 59 pages each) fill 0.91 of it, and grow into the probe reserve within ~80 steps, when the
        # younger is preempted; the elder alone is above 0.8 again for its last ~270 tokens. On a fast CPU (CI: 1000
        # tokens in 1.4 s) those last a tenth and a third of a second: so the wait polls often, and a stream that
        # ended meanwhile leaves the next queued one its turn
        deadline = time.monotonic() + 300
        while not (decoding(s) == 2 and decode_pool_use(s) >= 0.8):
            done = [f.result() for f in streams if f.done()]  # status, finish reason, error of each that ended
            assert time.monotonic() < deadline and len(streams) - len(done) >= 2, (done, s.tail("decode"))
            time.sleep(0.02)
        sampler = threading.Thread(target=sample, daemon=True)
        began = time.monotonic()
        sampler.start()
        rc, check, log = live_probes(s)
        ended = time.monotonic()
        stop.set()
        sampler.join()
        results = [f.result() for f in streams]
    # saturated while there was work: both threads held a client stream (or every stream not yet ended), but for
    # the handover after a stream ended (its last delta within 3 s before the sample) while a queued one takes its
    # thread. Streams may all end mid-probe (a fast CPU, or a slow probe on a loaded one): a thread with no stream
    # left to serve is not idle, and a count of handovers is no measure.
    ends = [r["deltas"][-1] for r in results if r["deltas"]]
    left = lambda t: sum(e > t for e in ends)  # noqa: E731  streams not yet ended at t
    busy = [(t, n) for t, n in samples if left(t) >= 2]
    idle = [(round(t - began, 1), n, left(t)) for t, n in samples
            if n < min(2, left(t)) and not any(0 <= t - e <= 3 for e in ends)]
    assert busy and not idle and sum(n == 2 for _, n in busy) >= 0.5 * len(busy), (idle, samples, ends)
    assert rc == 0 and check["outcome"] == "passed", log
    (decode,) = [w for w in check["details"]["workers"].values() if w["role"] == "decode"]
    cases = decode["checks"]["handoff"]["cases"]
    assert {c: r["outcome"] for c, r in cases.items()} == dict.fromkeys(cases, "passed") and len(cases) == 6
    assert cases["valid"]["got"]["status"] == "done"
    # each answer came from the worker's probe lane, not from a Celery thread a stream let go of
    threads = [decode["checks"][n]["thread"] for n in ("guard", "scrub")]
    threads += [r["got"]["record"]["thread"] for c, r in cases.items() if c != "valid"]
    assert threads and all(t.startswith("probe-lane") for t in threads), threads
    assert rows(s, "select count(*) from incidents_incident") == [(0,)]
    assert not any(s.registry().is_quarantined(w.worker_id) for w in s.registry().live_workers())
    for r in results:  # served throughout: every stream ends normally, and content came while the canary ran
        assert r["status"] == 200 and r["error"] is None and r["finish"] in ("length", "stop"), r
    assert any(began <= t <= ended for r in results for t in r["deltas"])
    with urllib.request.urlopen(f"{s.url}/healthz", timeout=10) as h:
        assert h.status == 200
    after = stream_chat(s, "What is the capital of France?", 8)
    assert after["status"] == 200 and after["finish"] in ("length", "stop"), after

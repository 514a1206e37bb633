"""WorkerRuntime in-process against real Redis: the prefill→decode path, the handoff refusals, the
window check and lease reaping. The Celery processes around it are covered in tests/e2e."""
import dataclasses
import os
import threading
import time

import pytest
import torch

from inference.cancel import Cancel
from inference.engine import EngineConfig
from inference.events import Delta, Done, Error
from inference.handoff import HandoffRefused, Verdict, handoff_accept
from inference.ledger import RedisLedger
from inference.sequence import SeqStatus
from inference.worker import (DecodeCommand, PoolLostCommand, PrefillCommand, RequestFailed, RuntimeOptions, WindowTooLarge,
                              WorkerRuntime, check_window)
from tests.inference.helpers import greedy, make_engine

KEY = b"k" * 32


@pytest.fixture
def runtimes(redis_client, ledger_prefix, tiny_model):
    opts = RuntimeOptions(prefix=ledger_prefix, lease_ttl_s=30, registry_ttl_s=15)
    made = []

    def make(role, **config):
        cfg = EngineConfig(num_pages=config.pop("num_pages", 64), page_size=16, window=1024, **config)
        rt = WorkerRuntime(role, redis_client, KEY, model=tiny_model, config=cfg, options=opts)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.stop()


def test_prefill_then_decode_across_runtimes_matches_the_engine_alone(runtimes, tiny_model):
    prefill, decode = runtimes("prefill"), runtimes("decode")
    prompt = list(range(10, 50))
    (alone,) = make_engine(tiny_model).generate([prompt], greedy(10))
    handoff = prefill.prefill("r1", prompt, greedy(10))
    assert handoff.verdict is Verdict.OK and handoff.transferred_tokens == handoff.expected_tokens == 40
    assert prefill.ledger.num_free() == 64  # prefill pages freed (and scrubbed) once sent
    seq = decode.decode("r1", prompt, greedy(10), handoff.to_dict())
    assert seq.output_ids == alone.output_ids and seq.status is SeqStatus.FINISHED
    assert decode.ledger.num_free() == 64
    decode.ledger.check_integrity()
    events = list(decode.outputs.read("r1", timeout_s=5))
    assert isinstance(events[-1], Done) and events[-1].usage.completion_tokens == 10
    counts = [e.tokens for e in events if isinstance(e, Delta)]  # completion tokens so far, on every delta
    assert counts == sorted(set(counts)) and counts[0] >= 1 and counts[-1] <= 10 and len(counts) > 1
    (record,) = decode.outputs.read_records({"r1"})
    assert set(record["owners"]) == {"r1"} and record["page_epochs"] == record["epochs"]


def test_a_bf16_pool_travels_as_bf16_pages_and_decodes_as_the_engine_alone(runtimes, tiny_model, redis_client):
    """KVSERVE_KV_DTYPE=bfloat16 on both sides: registered as such, the blob half the bytes (signed bf16, checksums
    over its bytes), the same tokens as one engine over a bf16 pool, every page scrubbed to zero bytes after."""
    prefill, decode = runtimes("prefill", kv_dtype="bfloat16"), runtimes("decode", kv_dtype="bfloat16")
    assert prefill.info().dtype == decode.info().dtype == "bfloat16"
    prompt = list(range(10, 50))
    (alone,) = make_engine(tiny_model, kv_dtype="bfloat16").generate([prompt], greedy(10))
    handoff = prefill.prefill("r1", prompt, greedy(10))
    assert handoff.verdict is Verdict.OK and handoff.dtype == handoff.blob_dtype == "bfloat16"
    stored = redis_client.hget(prefill.transport.key("r1"), "blob")
    assert stored is not None and len(stored) == handoff.num_pages * prefill.engine.pool.bytes_per_page
    assert prefill.engine.pool.bytes_per_page * 2 == runtimes("prefill").engine.pool.bytes_per_page
    seq = decode.decode("r1", prompt, greedy(10), handoff.to_dict())
    assert seq.output_ids == alone.output_ids and seq.status is SeqStatus.FINISHED
    for rt in (prefill, decode):
        assert rt.ledger.num_free() == 64 and rt.engine.pool.data.view(torch.uint8).count_nonzero() == 0


def test_an_int8_pool_travels_as_its_codes_and_scales_and_decodes_as_the_engine_alone(runtimes, tiny_model,
                                                                                      redis_client):
    """KVSERVE_KV_DTYPE=int8 on both sides: the blob is the pages' bytes (codes and each row's scale, signed as int8,
    checksummed), decode reads them to the same tokens as one engine over an int8 pool, and scrubs every byte."""
    prefill, decode = runtimes("prefill", kv_dtype="int8"), runtimes("decode", kv_dtype="int8")
    assert prefill.info().dtype == decode.info().dtype == "int8"
    prompt = list(range(10, 50))
    (alone,) = make_engine(tiny_model, kv_dtype="int8").generate([prompt], greedy(10))
    handoff = prefill.prefill("r1", prompt, greedy(10))
    assert handoff.verdict is Verdict.OK and handoff.dtype == handoff.blob_dtype == "int8"
    head_dim = tiny_model.config.head_dim
    assert handoff.blob_shape[-1] == head_dim + 4  # each row's codes and its scale travel together
    stored = redis_client.hget(prefill.transport.key("r1"), "blob")
    assert stored is not None and len(stored) == handoff.num_pages * prefill.engine.pool.bytes_per_page
    assert prefill.engine.pool.bytes_per_page * 4 * head_dim == \
        runtimes("prefill").engine.pool.bytes_per_page * (head_dim + 4)
    seq = decode.decode("r1", prompt, greedy(10), handoff.to_dict())
    assert seq.output_ids == alone.output_ids and seq.status is SeqStatus.FINISHED
    for rt in (prefill, decode):
        assert rt.ledger.num_free() == 64 and rt.engine.pool.data.view(torch.uint8).count_nonzero() == 0


def test_a_decode_worker_refuses_kv_of_another_dtype(runtimes):
    prefill, decode = runtimes("prefill", kv_dtype="bfloat16"), runtimes("decode")
    prompt = list(range(10, 50))
    handoff = prefill.prefill("r", prompt, greedy(4))
    with pytest.raises(HandoffRefused) as err:
        decode.decode("r", prompt, greedy(4), handoff.to_dict())
    assert err.value.kind == "handoff_mismatch" and "bfloat16" in err.value.reason and "float32" in err.value.reason
    assert decode.ledger.num_free() == 64 and not decode.engine.has_request("r")


def test_a_prompt_prefill_cannot_hold_ends_rejected_with_nothing_taken_or_sent(runtimes, redis_client):
    prefill = runtimes("prefill")
    handoff = prefill.prefill("big", list(range(10, 1100)), greedy(10))
    assert handoff.verdict is Verdict.REJECTED and handoff.transferred_tokens == 0 and handoff.num_pages == 0
    assert prefill.ledger.num_free() == 64 and not redis_client.exists(prefill.transport.key("big"))


@pytest.mark.parametrize("tamper, kind", [
    (lambda h: dataclasses.replace(h, signature="0" * 64), "handoff_forged"),
    (lambda h: dataclasses.replace(h, transferred_tokens=1).signed(b"x" * 32), "handoff_forged"),
    (lambda h: dataclasses.replace(h, transferred_tokens=1).signed(KEY), "handoff_mismatch"),
    (lambda h: dataclasses.replace(h, verdict=Verdict.REJECTED, reason="too long").signed(KEY), "rejected"),
    (lambda h: dataclasses.replace(h, page_checksums=("0" * 16,) * h.num_pages).signed(KEY), "handoff_mismatch"),
    (lambda h: dataclasses.replace(h, page_epochs=tuple(e + 1000 for e in h.page_epochs)).signed(KEY), "stale_epoch"),
    (lambda h: dataclasses.replace(h, model_fingerprint="other").signed(KEY), "handoff_mismatch"),
])
def test_decode_refuses_bad_handoffs_and_takes_no_pages(runtimes, tamper, kind):
    prefill, decode = runtimes("prefill"), runtimes("decode")
    prompt = list(range(10, 50))
    good = prefill.prefill("r", prompt, greedy(4))
    with pytest.raises(HandoffRefused) as err:
        decode.decode("r", prompt, greedy(4), tamper(good).to_dict())
    assert err.value.kind == kind
    assert decode.ledger.num_free() == 64 and not decode.engine.has_request("r")


def test_malformed_and_replayed_handoffs_are_refused(runtimes):
    prefill, decode = runtimes("prefill"), runtimes("decode")
    prompt = list(range(10, 30))
    with pytest.raises(HandoffRefused, match="handoff_forged"):
        decode.decode("r", prompt, greedy(4), {"request_id": "r", "verdict": "OK"})
    good = prefill.prefill("r", prompt, greedy(4)).to_dict()
    decode.decode("r", prompt, greedy(4), good)
    with pytest.raises(HandoffRefused) as err:  # the KV was deleted once pulled
        decode.decode("r", prompt, greedy(4), good)
    assert err.value.kind == "kv_missing"


def test_window_larger_than_the_pool_refuses_to_start_unless_clamped(runtimes, redis_client, ledger_prefix):
    with pytest.raises(WindowTooLarge, match="KVSERVE_NUM_PAGES >= 65536"):
        check_window(42_580, 16, 1_048_576, clamp=False)  # the incident: 681,280 tokens < 1,048,576
    assert check_window(42_580, 16, 1_048_576, clamp=True) == 681_280
    with pytest.raises(WindowTooLarge):
        runtimes("decode", num_pages=8)
    assert not redis_client.keys(f"{ledger_prefix}:workers:info:*")  # never registered


def test_heartbeat_reaps_an_expired_lease_and_scrubs_before_reuse(runtimes, redis_client):
    rt = runtimes("decode")
    grant = rt.ledger.allocate("stuck", 2)
    rt.engine.pool.data[list(grant.pages)] = 5.0
    rt.ledger.renew_leases(["stuck"], ttl_s=0.05)
    expiry = redis_client.zscore(rt.ledger.key("leases"), "stuck")
    rt.beat(now_ms=expiry)  # its lease ran out (on the given clock): reaped into dirty, scrubbed by the loop
    deadline = time.time() + 5
    while rt.ledger.num_free() != 64 and time.time() < deadline:
        time.sleep(0.05)
    assert rt.ledger.num_free() == 64
    assert float(rt.engine.pool.data[list(grant.pages)].abs().sum()) == 0.0
    rt.ledger.check_integrity()


def test_a_pool_sized_by_memory_is_checked_against_the_window(tiny_model):
    config = EngineConfig(page_size=16, pool_mb=1)
    pages = config.pages_for(tiny_model.config, __import__("torch").float32)
    per_page = 16 * tiny_model.config.num_layers * 2 * tiny_model.config.num_kv_heads * tiny_model.config.head_dim * 4
    assert pages == 2**20 // per_page and pages * 16 >= 1024
    with pytest.raises(WindowTooLarge):
        check_window(pages, 16, pages * 16 + 1, clamp=False)


# ---- faults: the loop, leases, the pool, duplicates, cancellation ------------------------------------

class Held:
    """Holds the engine loop before its next step while `paused`, so a fault lands mid-request."""

    def __init__(self, runtime):
        self.open = threading.Event()
        self.open.set()
        self.parked = threading.Event()  # the loop waits before a step (set once it does, while paused)
        real = runtime.engine.step

        def step():
            if not self.open.is_set():
                self.parked.set()
            self.open.wait(30)
            return real()

        runtime.engine.step = step

    def __enter__(self):
        self.open.clear()
        return self

    def __exit__(self, *exc):
        self.open.set()


def start_decode(prefill, decode, rid, max_tokens=600, prompt=None):
    """Runs prefill + decode of `rid` in a thread; returns (thread, box) once decode has streamed a delta."""
    prompt = prompt or list(range(10, 50))
    handoff = prefill.prefill(rid, prompt, greedy(max_tokens)).to_dict()
    box = {}

    def run():
        try:
            box["seq"] = decode.decode(rid, prompt, greedy(max_tokens), handoff)
        except Exception as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    next(decode.outputs.read(rid, timeout_s=30))
    return thread, box


def final_event(runtime, rid):
    return list(runtime.outputs.read(rid, timeout_s=30))[-1]


def wait_until(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def fault_runtimes(redis_client, ledger_prefix, tiny_model):
    """Runtimes whose fatal path and lease records are observed instead of exiting the test process."""
    made, seen = [], {"fatal": [], "lease_lost": [], "violations": []}

    def make(role, clock=time.monotonic, **opts):
        options = RuntimeOptions(prefix=ledger_prefix, lease_ttl_s=30, registry_ttl_s=15, **opts)
        rt = WorkerRuntime(role, redis_client, KEY, model=tiny_model, options=options, clock=clock,
                           config=EngineConfig(num_pages=64, page_size=16, window=1024),
                           on_fatal=lambda runtime, reason: seen["fatal"].append(reason),
                           on_lease_lost=lambda runtime, rid, pages: seen["lease_lost"].append(rid),
                           on_violation=lambda runtime, v: seen["violations"].append(v))
        made.append(rt)
        return rt

    yield make, seen
    for rt in made:
        rt.stop()


def test_a_failed_step_fails_its_requests_with_an_error_event_and_the_loop_serves_on(fault_runtimes):
    make, seen = fault_runtimes
    rt = make("prefill")
    real, calls = rt.engine.step, []

    def step_that_fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return real()

    rt.engine.step = step_that_fails_once
    with pytest.raises(RequestFailed) as err:
        rt.prefill("boom", list(range(10, 40)), greedy(4))
    assert err.value.code == "engine_error" and "injected step failure" in err.value.message
    assert final_event(rt, "boom") == Error("engine_error", "the engine failed: RuntimeError: injected step failure")
    assert rt.prefill("after", list(range(10, 40)), greedy(4)).verdict is Verdict.OK  # the loop goes on
    assert rt.serving and not seen["fatal"] and rt.ledger.num_free() == 64
    rt.ledger.check_integrity()


def test_a_loop_that_cannot_go_on_fails_its_requests_unregisters_and_asks_to_exit(fault_runtimes, redis_client):
    make, seen = fault_runtimes
    rt = make("prefill", loop_max_failures=1)
    rt.engine.step = lambda: (_ for _ in ()).throw(RuntimeError("the engine is broken"))
    with pytest.raises(RequestFailed, match="engine_error"):
        rt.prefill("doomed", list(range(10, 40)), greedy(4))
    wait_until(lambda: seen["fatal"])
    assert "the engine loop cannot go on" in seen["fatal"][0] and not rt.serving
    assert rt.registry.live_workers() == []  # never advertised again
    assert not redis_client.exists(rt.ledger.key("meta"))
    rt.beat()  # the heartbeat of a dead loop does nothing more
    assert rt.registry.live_workers() == [] and len(seen["fatal"]) == 1


def test_the_heartbeat_never_advertises_a_stalled_loop(fault_runtimes):
    make, seen = fault_runtimes
    skew = [0.0]
    rt = make("decode", loop_stall_s=60, clock=lambda: time.monotonic() + skew[0])
    stepping, stuck = threading.Event(), threading.Event()
    rt.engine.step = lambda: (stepping.set(), stuck.wait(30))
    rt._commands.put(PrefillCommand("stall", list(range(10, 40)), greedy(4)))  # work: the loop steps, and hangs
    assert stepping.wait(30)
    rt.beat()
    assert not seen["fatal"] and rt.registry.live_workers() != []  # a step under loop_stall_s is no stall
    skew[0] += 61  # a minute on: the loop has made no progress for longer than loop_stall_s
    rt.beat()
    stuck.set()
    assert seen["fatal"] and "no progress" in seen["fatal"][0]
    assert rt.registry.live_workers() == []


def test_two_beats_never_queue_the_same_dirty_pages_and_the_loop_stays_alive(fault_runtimes, redis_client):
    make, _ = fault_runtimes
    rt = make("decode")
    grant = rt.ledger.allocate("orphan", 3)  # pages of an owner this worker does not run
    rt.engine.pool.data[list(grant.pages)] = 7.0
    with Held(rt):
        busy = PrefillCommand("busy", list(range(10, 30)), greedy(2))
        rt._commands.put(busy)
        wait_until(lambda: rt._commands.empty() and rt.engine.has_request("busy"))  # the loop waits to step
        rt.beat(now_ms=10**15)  # its lease has expired: reaped into dirty, claimed, queued for the loop
        rt.beat(now_ms=10**15)
        assert rt._commands.qsize() == 1  # the second beat found nothing unclaimed
    busy.future.result(30)
    wait_until(lambda: rt.ledger.num_free() == 64)
    assert rt.serving and float(rt.engine.pool.data[list(grant.pages)].abs().sum()) == 0.0
    rt.ledger.check_integrity()


def test_a_lost_lease_fails_the_request_lease_lost_scrubbed_and_no_violation(fault_runtimes, redis_client):
    make, seen = fault_runtimes
    prefill, decode = make("prefill"), make("decode")
    thread, box = start_decode(prefill, decode, "r1")
    with Held(decode):
        pages = sorted(decode.ledger.pages_of("r1"))
        # another process reaps the lease (a long pause, or Redis' clock stepping) while the request runs
        reaper = RedisLedger(redis_client, decode.worker_id, prefix=decode.options.prefix)
        assert [e.owner for e in reaper.reap_expired(now_ms=10**15)] == ["r1"]
        decode.beat()
    thread.join(30)
    assert isinstance(box["error"], RequestFailed) and box["error"].code == "lease_lost"
    assert final_event(decode, "r1").code == "lease_lost"
    assert seen["lease_lost"] == ["r1"] and not seen["violations"]
    assert not decode.registry.is_quarantined(decode.worker_id)
    wait_until(lambda: decode.ledger.num_free() == 64)
    assert float(decode.engine.pool.data[pages].abs().sum()) == 0.0
    decode.ledger.check_integrity()


def test_a_lease_the_ledger_no_longer_has_fails_its_request_on_the_next_beat(fault_runtimes, redis_client):
    make, seen = fault_runtimes
    prefill, decode = make("prefill"), make("decode")
    thread, box = start_decode(prefill, decode, "r8")
    with Held(decode):
        pages = sorted(decode.ledger.pages_of("r8"))
        redis_client.zrem(decode.ledger.key("leases"), "r8")  # lost in a failover: the pages look held, no lease
        decode.beat()  # renewal reports r8 missing
    thread.join(30)
    assert box["error"].code == "lease_lost" and seen["lease_lost"] == ["r8"] and not seen["violations"]
    deltas = [e for e in decode.outputs.read("r8", timeout_s=5) if isinstance(e, Delta)]
    assert len(deltas) < 50  # stopped at that beat, not when it finished 600 tokens later
    wait_until(lambda: decode.ledger.num_free() == 64)  # what the ledger still listed was released
    assert float(decode.engine.pool.data[pages].abs().sum()) == 0.0
    decode.ledger.check_integrity()


def test_a_request_that_finishes_after_its_lease_was_reaped_fails_lease_lost(fault_runtimes, redis_client):
    make, seen = fault_runtimes
    prefill, decode = make("prefill"), make("decode")
    thread, box = start_decode(prefill, decode, "r2", max_tokens=300)
    with Held(decode):
        RedisLedger(redis_client, decode.worker_id, prefix=decode.options.prefix).reap_expired(now_ms=10**15)
    thread.join(60)  # no beat: its next page grant (or its free at the end) was refused
    assert box["error"].code == "lease_lost" and seen["lease_lost"] == ["r2"] and not seen["violations"]
    decode.beat()  # the reaped pages are then scrubbed by this worker and marked clean
    wait_until(lambda: decode.ledger.num_free() == 64)
    decode.ledger.check_integrity()


def test_a_clock_step_does_not_expire_the_leases_of_running_requests(fault_runtimes, redis_client):
    make, seen = fault_runtimes
    prefill, decode = make("prefill"), make("decode")
    thread, box = start_decode(prefill, decode, "r3", max_tokens=200)
    with Held(decode):
        decode.beat(now_ms=10**15)  # Redis' clock jumped: the beat renews r3 before it reaps anything
    thread.join(60)
    assert box["seq"].status is SeqStatus.FINISHED and len(box["seq"].output_ids) == 200
    assert not seen["lease_lost"]


def test_a_vanished_pool_fails_its_requests_scrubs_everything_and_serves_a_new_generation(fault_runtimes,
                                                                                           redis_client):
    make, _ = fault_runtimes
    prefill, decode = make("prefill"), make("decode")
    thread, box = start_decode(prefill, decode, "r4")
    with Held(decode):
        old_epochs = sorted(decode.ledger.pages_of("r4").values())
        for key in redis_client.scan_iter(match=f"{decode.ledger.prefix}:pool:{decode.worker_id}:*"):
            redis_client.delete(key)  # Redis lost the pool: restart without persistence, FLUSHDB, failover
        redis_client.delete(decode.registry.key("info", decode.worker_id))
        decode.beat()
    thread.join(30)
    assert box["error"].code == "pool_lost" and final_event(decode, "r4").code == "pool_lost"
    wait_until(lambda: decode.serving)
    assert float(decode.engine.pool.data.abs().sum()) == 0.0  # the whole tensor
    assert decode.ledger.generation == 1 and [w.worker_id for w in decode.registry.live_workers("decode")] == [
        decode.worker_id]
    seq = decode.decode("r5", list(range(10, 50)), greedy(8), prefill.prefill("r5", list(range(10, 50)),
                                                                              greedy(8)).to_dict())
    (record,) = decode.outputs.read_records({"r5"})
    assert seq.status is SeqStatus.FINISHED and min(record["epochs"]) > max(old_epochs)
    decode.ledger.check_integrity()


def test_every_command_queued_with_a_failing_one_still_ends(fault_runtimes):
    make, _ = fault_runtimes
    rt = make("prefill")
    with Held(rt):
        busy = PrefillCommand("busy", list(range(10, 30)), greedy(2))
        rt._commands.put(busy)
        wait_until(lambda: rt._commands.empty() and rt.engine.has_request("busy"))
        rt._commands.put(PoolLostCommand(rt.ledger.generation, "injected: the pool vanished"))
        after = PrefillCommand("after", list(range(10, 30)), greedy(2))
        rt._commands.put(after)  # drained in the same batch as the failing command
    with pytest.raises(RequestFailed) as err:
        after.future.result(30)
    assert err.value.code == "pool_lost" and busy.future.done()
    wait_until(lambda: rt.serving)


def test_a_violation_fails_closed_and_quarantines_even_when_recording_the_incident_fails(redis_client, ledger_prefix,
                                                                                         tiny_model, runtimes):
    def broken_recorder(runtime, violation):
        raise RuntimeError("the incident database is down")

    options = RuntimeOptions(prefix=ledger_prefix, lease_ttl_s=30, registry_ttl_s=15)
    decode = WorkerRuntime("decode", redis_client, KEY, model=tiny_model, options=options,
                           config=EngineConfig(num_pages=64, page_size=16, window=1024), on_violation=broken_recorder)
    try:
        prefill = runtimes("prefill")
        bystander, seen = start_decode(prefill, decode, "bystander", max_tokens=200)
        thread, box = start_decode(prefill, decode, "victim")
        with Held(decode):
            other = decode.ledger.allocate("someone-else", 1)
            decode.engine.seqs["victim"].block_table[0] = other.pages[0]  # the bug: a foreign page in its table
        thread.join(30)
        bystander.join(60)
        assert box["error"].code == "kv_isolation_violation"
        assert seen["seq"].status is SeqStatus.FINISHED  # the recorder's failure touched no other request
        assert final_event(decode, "victim").code == "kv_isolation_violation"
        assert decode.registry.is_quarantined(decode.worker_id) and decode.serving
    finally:
        decode.stop()


def test_a_duplicate_delivery_is_refused_and_the_original_runs_on(fault_runtimes):
    make, _ = fault_runtimes
    prefill, decode = make("prefill"), make("decode")
    prompt = list(range(10, 50))
    handoff = prefill.prefill("r6", prompt, greedy(300))
    _, blob = handoff_accept(handoff, KEY, decode.decode_side("r6", prompt), decode.transport.take)
    original = DecodeCommand("r6", prompt, greedy(300), handoff.first_token, blob, 40)
    decode._commands.put(original)
    next(decode.outputs.read("r6", timeout_s=30))  # decoding
    again = DecodeCommand("r6", prompt, greedy(300), handoff.first_token, blob, 40)  # delivered twice
    decode._commands.put(again)
    with pytest.raises(RequestFailed) as err:
        again.future.result(30)
    assert err.value.code == "duplicate_delivery"
    seq = original.future.result(60)  # undisturbed
    assert seq.status is SeqStatus.FINISHED and len(seq.output_ids) == 300
    assert not any(isinstance(e, Error) for e in decode.outputs.read("r6", timeout_s=5))


def test_a_cancel_flag_aborts_the_running_request_and_frees_its_pages(fault_runtimes):
    make, _ = fault_runtimes
    prefill, decode = make("prefill"), make("decode")
    thread, box = start_decode(prefill, decode, "r7")
    decode.cancels.request(Cancel("r7", "client_disconnected", "the client went away"))
    thread.join(30)
    assert box["error"].code == "client_disconnected"
    assert decode.ledger.num_free() == 64 and not decode.engine.has_request("r7")


# ---- the decode worker's own acceptance (inference.handoff.handoff_accept) and admission re-check ----------

def test_a_valid_handoff_replayed_onto_another_request_is_refused_and_its_kv_left_alone(runtimes, redis_client):
    prefill, decode = runtimes("prefill"), runtimes("decode")
    prompt = list(range(10, 50))
    good = prefill.prefill("victim", prompt, greedy(4))
    with pytest.raises(HandoffRefused) as err:
        decode.decode("attacker", prompt, greedy(4), good.to_dict())  # same prompt length, another request
    assert err.value.kind == "handoff_mismatch" and "victim" in err.value.reason
    assert decode.ledger.num_free() == 64 and not decode.engine.has_request("attacker")
    assert redis_client.exists(decode.transport.key("victim"))  # not pulled: the real owner can still decode
    seq = decode.decode("victim", prompt, greedy(4), good.to_dict())
    assert seq.status is SeqStatus.FINISHED


@pytest.mark.parametrize("meta", [{"dtype": "float16"}, {"dtype": "float64"}, {"shape": [3, 2, 2, 16, 2, 8]}])
def test_a_transported_blob_whose_shape_or_dtype_is_not_the_signed_one_is_refused(runtimes, redis_client, meta):
    import json as json_lib

    prefill, decode = runtimes("prefill"), runtimes("decode")
    prompt = list(range(10, 50))
    good = prefill.prefill("r", prompt, greedy(4))
    key = decode.transport.key("r")
    stored = json_lib.loads(redis_client.hget(key, "meta"))
    redis_client.hset(key, "meta", json_lib.dumps({**stored, **meta}))  # the blob relabelled in transit
    with pytest.raises(HandoffRefused) as err:
        decode.decode("r", prompt, greedy(4), good.to_dict())
    assert err.value.kind == "handoff_mismatch" and "signed handoff says" in err.value.reason
    assert decode.ledger.num_free() == 64 and not decode.engine.has_request("r")


def test_the_decode_worker_re_checks_admission_against_its_own_pool(runtimes, redis_client, ledger_prefix, tiny_model):
    from inference.scheduler import RequestTooLarge

    prefill = runtimes("prefill")
    options = RuntimeOptions(prefix=ledger_prefix, lease_ttl_s=30, registry_ttl_s=15)
    small = WorkerRuntime("decode", redis_client, KEY, model=tiny_model, options=options,
                          config=EngineConfig(num_pages=32, page_size=16, window=512))
    try:
        prompt = list(range(10, 50))
        handoff = prefill.prefill("big", prompt, greedy(600))  # 640 tokens: fits prefill's 1024, not decode's 512
        with pytest.raises(RequestTooLarge):
            small.decode("big", prompt, greedy(600), handoff.to_dict(), timeout_s=10)
        assert small.ledger.num_free() == 32 and not small.engine.has_request("big")
    finally:
        small.stop()


def test_the_prefill_worker_re_checks_admission_and_sends_nothing(runtimes, redis_client):
    prefill = runtimes("prefill")
    handoff = prefill.prefill("long", list(range(10, 50)), greedy(1000))  # 1040 > the 1024-token window
    assert handoff.verdict is Verdict.REJECTED and "exceeds this engine's limit of 1024" in handoff.reason
    assert handoff.has_valid_signature(KEY) and handoff.num_pages == 0
    assert prefill.ledger.num_free() == 64 and not redis_client.exists(prefill.transport.key("long"))


def test_the_foreign_page_fault_is_stopped_by_the_real_guard_once_and_touches_no_other_page(runtimes, redis_client,
                                                                                            ledger_prefix, tiny_model):
    from inference.faults import Faults

    seen = []
    options = RuntimeOptions(prefix=ledger_prefix, lease_ttl_s=30, registry_ttl_s=15)
    decode = WorkerRuntime("decode", redis_client, KEY, model=tiny_model, options=options,
                           config=EngineConfig(num_pages=64, page_size=16, window=1024,
                                               faults=Faults({"foreign_page_once"})),
                           on_violation=lambda rt, v: seen.append(v))
    try:
        prefill = runtimes("prefill")
        prompt = list(range(10, 50))
        with pytest.raises(RequestFailed) as err:
            decode.decode("first", prompt, greedy(8), prefill.prefill("first", prompt, greedy(8)).to_dict())
        assert err.value.code == "kv_isolation_violation"
        # nothing decoded over the foreign page is published: at most the first token (prefill's, sampled from
        # the request's own prompt before the fault) precedes the one error
        assert [e.type for e in decode.outputs.read("first", timeout_s=5)] in (["error"], ["delta", "error"])
        (v,) = seen
        assert v.kind == "foreign_read" and v.reader == "first" and v.page_owner.startswith("fault-bystander-")
        assert v.reader_epoch is not None and v.page_epoch is not None and v.reader_epoch != v.page_epoch
        assert decode.registry.is_quarantined(decode.worker_id)
        wait_until(lambda: decode.ledger.num_free() == 64)  # reader and bystander pages freed
        decode.ledger.check_integrity()
        assert decode.engine.pool.data[v.page].abs().sum() == 0  # the page bytes themselves: scrubbed
        seq = decode.decode("second", prompt, greedy(8), prefill.prefill("second", prompt, greedy(8)).to_dict())
        assert seq.status is SeqStatus.FINISHED  # once per process
    finally:
        decode.stop()


def test_a_finished_request_leaves_its_pages_zeroed_in_both_tensors(runtimes):
    """Scrub on free in the worker path, seen in the page bytes themselves (not the mirror or the free count)."""
    prefill, decode = runtimes("prefill"), runtimes("decode")
    prompt = list(range(10, 50))
    decode.decode("z", prompt, greedy(8), prefill.prefill("z", prompt, greedy(8)).to_dict())
    (record,) = decode.outputs.read_records({"z"})
    assert sum(record["written"]) == 47 and len(record["pages"]) == 3  # 40 prompt + 7 decoded tokens had K/V
    wait_until(lambda: decode.ledger.num_free() == 64)
    assert decode.engine.pool.data[record["pages"]].count_nonzero() == 0
    assert prefill.engine.pool.data.count_nonzero() == 0  # the prefill pages, freed once sent


def test_a_decode_pool_short_of_pages_preempts_and_recomputes_from_the_sequences_own_tokens(redis_client, ledger_prefix,
                                                                                          tiny_model):
    opts = RuntimeOptions(prefix=ledger_prefix, lease_ttl_s=30, registry_ttl_s=15)
    cfg = dict(page_size=16, window=128)
    prefill = WorkerRuntime("prefill", redis_client, KEY, model=tiny_model, config=EngineConfig(num_pages=16, **cfg),
                            options=opts)
    decode = WorkerRuntime("decode", redis_client, KEY, model=tiny_model, config=EngineConfig(num_pages=8, **cfg),
                           options=opts)
    try:
        prompts = {f"r{i}": list(range(10 + i, 50 + i)) for i in range(2)}  # 3 pages each, 6 at the end: 12 > 8
        alone = {rid: make_engine(tiny_model).generate([p], greedy(50))[0].output_ids for rid, p in prompts.items()}
        handoffs = {rid: prefill.prefill(rid, p, greedy(50)).to_dict() for rid, p in prompts.items()}
        assert prefill.ledger.num_free() == 16
        box = {}

        def run(rid):
            box[rid] = decode.decode(rid, prompts[rid], greedy(50), handoffs[rid])

        with Held(decode):  # both join the batch before either can finish
            threads = [threading.Thread(target=run, args=(rid,), daemon=True) for rid in prompts]
            for t in threads:
                t.start()
            wait_until(lambda: decode.engine.has_request("r0") and not decode._commands.empty()
                       or len(decode.engine.seqs) == 2)
        for t in threads:
            t.join(60)
        assert {rid: box[rid].output_ids for rid in prompts} == alone
        # the newest admitted is preempted: r1, unless r1's command reached the loop first (the two threads race)
        assert decode.engine.scheduler.num_preemptions >= 1 and any(box[rid].num_preemptions for rid in prompts)
        assert decode.ledger.num_free() == 8
        decode.ledger.check_integrity()
        for rid in prompts:
            events = list(decode.outputs.read(rid, timeout_s=5))
            assert isinstance(events[-1], Done) and events[-1].usage.completion_tokens == 50
            assert "".join(e.text for e in events if isinstance(e, Delta)) == box[rid].text  # no text twice after a recompute
    finally:
        prefill.stop()
        decode.stop()


def test_a_grow_refused_for_a_reaped_lease_fails_the_request_lease_lost_without_waiting_for_a_beat(
        redis_client, ledger_prefix, tiny_model):
    seen = []
    opts = RuntimeOptions(prefix=ledger_prefix, lease_ttl_s=600, registry_ttl_s=600)  # next beat: 200 s away
    made = [WorkerRuntime(role, redis_client, KEY, model=tiny_model, options=opts,
                          config=EngineConfig(num_pages=64, page_size=16, window=1024),
                          on_lease_lost=lambda runtime, rid, pages: seen.append(rid)) for role in ("prefill", "decode")]
    prefill, decode = made
    try:
        thread, box = start_decode(prefill, decode, "r9", max_tokens=300)
        with Held(decode):
            RedisLedger(redis_client, decode.worker_id, prefix=decode.options.prefix).reap_expired(now_ms=10**15)
        thread.join(30)  # its next page grant is refused: failed then, not at a beat
        assert box["error"].code == "lease_lost" and seen == ["r9"]
        assert final_event(decode, "r9").code == "lease_lost"
        assert not decode.engine.has_request("r9")
    finally:
        for rt in made:
            rt.stop()


def test_a_failure_after_a_prefill_finished_leaves_no_sequence_and_no_page(fault_runtimes):
    make, _ = fault_runtimes
    rt = make("prefill")
    real, calls = rt.engine.export_kv, []

    def export_that_fails_once(seq):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected export failure")
        return real(seq)

    rt.engine.export_kv = export_that_fails_once
    with pytest.raises(RequestFailed) as err:
        rt.prefill("done-then-failed", list(range(10, 40)), greedy(4))
    assert err.value.code == "engine_error"
    wait_until(lambda: not rt.engine.seqs)  # the prefilled sequence went with its request
    assert rt.ledger.num_free() == 64 and "done-then-failed" not in rt._host._held  # nothing renewed for it
    assert rt.prefill("after", list(range(10, 40)), greedy(4)).verdict is Verdict.OK
    rt.ledger.check_integrity()


def test_verified_decodes_waiting_for_pages_join_the_tenant_holding_fewest_first(redis_client, ledger_prefix,
                                                                                 tiny_model):
    """Tenant A runs one decode and has a second waiting for pages; tenant B's decode, queued after it, joins the
    batch first (B holds nothing here), and A's waits until pages free: the scheduler's order, on the handoffs
    waiting in the decode worker."""
    opts = RuntimeOptions(prefix=ledger_prefix, lease_ttl_s=30, registry_ttl_s=15)
    cfg = dict(page_size=16, window=128, probe_reserve_pages=0)
    prefill = WorkerRuntime("prefill", redis_client, KEY, model=tiny_model, config=EngineConfig(num_pages=16, **cfg),
                            options=opts)
    decode = WorkerRuntime("decode", redis_client, KEY, model=tiny_model, config=EngineConfig(num_pages=8, **cfg),
                           options=opts)
    tenants = {"a0": "A", "a1": "A", "b0": "B"}
    prompts = {rid: list(range(10 + i, 50 + i)) for i, rid in enumerate(tenants)}  # 3 pages each
    params = {rid: greedy(80 if rid == "a0" else 40, tenant=t) for rid, t in tenants.items()}
    box, threads = {}, []

    def run(rid):
        box[rid] = decode.decode(rid, prompts[rid], params[rid], handoffs[rid])

    def start(rid):
        threads.append(threading.Thread(target=run, args=(rid,), daemon=True))
        threads[-1].start()

    try:
        handoffs = {rid: prefill.prefill(rid, prompts[rid], params[rid]).to_dict() for rid in tenants}
        start("a0")
        next(decode.outputs.read("a0", timeout_s=30))

        def queued():  # the heartbeat may queue commands of its own meanwhile
            return [c.request_id for c in list(decode._commands.queue) if isinstance(c, DecodeCommand)]

        with Held(decode) as held:  # a1, then b0, reach the loop together while a0 runs
            assert held.parked.wait(30) and len(decode.engine.seqs) == 1 and not queued()
            for n, rid in enumerate(("a1", "b0"), start=1):
                start(rid)
                wait_until(lambda: len(queued()) == n)
        wait_until(lambda: decode.engine.has_request("b0") or decode.engine.has_request("a1"))
        assert decode.engine.has_request("b0") and not decode.engine.has_request("a1")  # 3 + 3 of 8 pages held
        for t in threads:
            t.join(60)
        assert {rid: seq.status for rid, seq in box.items()} == {rid: SeqStatus.FINISHED for rid in tenants}
        assert decode.ledger.num_free() == 8
        decode.ledger.check_integrity()
    finally:
        prefill.stop()
        decode.stop()


def test_auto_precision_is_timed_once_per_deployment_and_adopted_by_every_worker(runtimes, redis_client, ledger_prefix,
                                                                                 tiny_model):
    """The first worker of a scope (model, device, CPU) times `auto` and proposes its mode; the others adopt it
    without timing, so prefill and decode run one precision and their handoffs match."""
    from inference.precision import precision_scope
    from inference.registry import Registry

    registry = Registry(redis_client, prefix=ledger_prefix)
    scope = precision_scope(tiny_model.fingerprint, torch.device("cpu"))
    assert registry.precision_agreed(scope) is None
    prefill = runtimes("prefill", precision="auto")
    assert registry.precision_agreed(scope) == prefill.engine.precision and prefill.engine.precision != "auto"
    other = "fp16w" if prefill.engine.precision != "fp16w" else "bf16"
    redis_client.set(registry.key("precision", scope), other)  # as if another host had proposed first
    decode = runtimes("decode", precision="auto")
    assert decode.engine.precision == other and decode.info().precision == other
    assert registry.precision_propose(scope, "fp32") == other  # the first proposal stands
    assert runtimes("decode", precision="fp32").engine.precision == "fp32"  # a pinned mode is the worker's own


def test_workers_starting_together_time_auto_one_at_a_time_and_all_adopt_the_one_timing(redis_client, ledger_prefix):
    """Four workers of one scope reach precision_agree at once (a host's workers start together): one holds the
    timing claim and times, the others wait for its proposal instead of timing on the same cores beside it."""
    from types import SimpleNamespace

    from inference.precision import Choice
    from inference.registry import Registry
    from inference.worker import precision_agree

    registry = Registry(redis_client, prefix=ledger_prefix)
    model, config = SimpleNamespace(fingerprint="f-" + ledger_prefix), SimpleNamespace(device="cpu")
    active, calls, peak, lock = [0], [], [0], threading.Lock()
    go = threading.Barrier(4)

    def time_choice(m, c):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            calls.append(threading.get_ident())
        time.sleep(0.3)  # a timing takes a while: the others arrive meanwhile
        with lock:
            active[0] -= 1
        return Choice("bf16", {"fp32": 2.0, "bf16": 1.0}, "timed")

    got = []

    def worker():
        go.wait()
        got.append(precision_agree(registry, model, config, time_choice=time_choice, poll_s=0.02))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == ["bf16"] * 4
    assert len(calls) == 1 and peak[0] == 1  # timed once, by one worker alone
    assert not list(redis_client.scan_iter(match=registry.key("precision-timing") + "*"))  # the claim released


def test_a_timing_claim_left_by_a_dead_worker_lapses_and_the_next_worker_times(redis_client, ledger_prefix):
    """A worker that died while timing leaves its claim; it lapses after its TTL and the next worker times: start
    is delayed, never stuck. Another's claim is never released by a worker that does not hold it."""
    from types import SimpleNamespace

    from inference.precision import Choice, precision_scope
    from inference.registry import Registry
    from inference.worker import precision_agree

    registry = Registry(redis_client, prefix=ledger_prefix)
    model, config = SimpleNamespace(fingerprint="f-" + ledger_prefix), SimpleNamespace(device="cpu")
    scope = precision_scope(model.fingerprint, torch.device("cpu"))
    assert registry.precision_timing_claim(scope, "dead-worker", ttl_s=0.4)
    assert not registry.precision_timing_claim(scope, "other", ttl_s=5)  # held
    registry.precision_timing_release(scope, "other")  # not its claim: stays
    assert not registry.precision_timing_claim(scope, "other", ttl_s=5)
    assert registry.precision_timing_claim(scope, "dead-worker", ttl_s=0.4)  # its own, again (a repeated SET)
    polls = []
    t0 = time.monotonic()
    mode = precision_agree(registry, model, config, poll_s=0.05, sleep=lambda s: (polls.append(s), time.sleep(s)),
                           time_choice=lambda m, c: Choice("fp16w", {}, "timed"))
    assert mode == "fp16w" and registry.precision_agreed(scope) == "fp16w"
    assert len(polls) >= 3 and 0.3 < time.monotonic() - t0 < 10  # waited for the lapse, then timed


def test_a_worker_without_work_lends_its_cores_before_it_waits_for_the_next_command(redis_client, ledger_prefix,
                                                                                     tiny_model, tmp_path):
    """The loop marks itself idle in the host's budget as soon as its engine has nothing to step, not after its wait
    for a command (up to 0.5 s) ends: with one client a prefill worker otherwise held half the cores most of the
    time (it waits right after each prefill), and the decode worker never got both."""
    from inference.threads import CoreBudget

    cores = CoreBudget(tmp_path / "cores", 2)
    peer = CoreBudget(tmp_path / "cores", 2, pid=os.getppid())  # the host's other worker, with work
    opts = RuntimeOptions(prefix=ledger_prefix, lease_ttl_s=30, registry_ttl_s=15)
    rt = WorkerRuntime("prefill", redis_client, KEY, model=tiny_model, options=opts, cores=cores,
                       config=EngineConfig(num_pages=64, page_size=16, window=1024))
    try:
        for i in range(3):
            rt.prefill(f"r{i}", list(range(10, 50)), greedy(4))
            wait_until(lambda: peer.threads_for_step() == 2, timeout_s=0.4)  # well inside the 0.5 s wait
    finally:
        rt.stop()
    assert cores.path.exists()  # stop gave its slot back; the peer still holds one
    peer.close()
    assert not cores.path.exists()  # the last one out removes the file

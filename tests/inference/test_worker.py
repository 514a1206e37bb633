"""WorkerRuntime in-process against real Redis: the prefill→decode path, the handoff refusals, the
window check and lease reaping. The Celery processes around it are covered in tests/e2e."""
import dataclasses
import time

import pytest

from inference.engine import EngineConfig
from inference.handoff import HandoffRefused, Verdict
from inference.sequence import SeqStatus
from inference.worker import RuntimeOptions, WindowTooLarge, WorkerRuntime, check_window
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
    assert events[-1]["type"] == "done" and events[-1]["usage"]["completion_tokens"] == 10
    (record,) = decode.outputs.read_records({"r1"})
    assert set(record["owners"]) == {"r1"} and record["page_epochs"] == record["epochs"]


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
    assert decode.ledger.num_free() == 64 and not decode.engine.seqs


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
    time.sleep(0.1)
    rt.beat()  # reaps into dirty and hands the pages to the engine loop to scrub
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

"""The live probes a worker runs on itself (inference.probes), on a real engine: they pass on the real guard and
scrub, fail when either is broken, and leave no page taken, no violation recorded."""
import pytest

from inference.block_manager import BlockManager
from inference.kv_cache import PagePool
from inference.probes import guard_probe, scrub_probe
from tests.inference.helpers import make_engine


@pytest.fixture(params=["auto", "int8"])
def engine(tiny_model, request):
    """The model's own pool, and an int8 one (rows of codes and a scale: the probes read and write its bytes alike)."""
    return make_engine(tiny_model, num_pages=16, kv_dtype=request.param)


def test_the_guard_probe_sees_each_read_raise_in_the_real_guard_and_leaves_nothing_behind(engine):
    result = guard_probe(engine)
    assert result["ok"], result
    assert {c: r["got"] for c, r in result["cases"].items()} == {
        "foreign_page": "foreign_read", "unwritten_tail": "unwritten_read", "stale_epoch": "stale_epoch",
        "choice_shared_page": "foreign_read"}
    assert engine.block_manager.num_free() == 16 and engine.take_violations() == []


@pytest.mark.parametrize("disable", ["check_owner", "check_watermark"])
def test_the_guard_probe_fails_when_a_part_of_the_guard_is_off(engine, disable):
    setattr(engine.block_manager, disable, False)
    result = guard_probe(engine)
    assert not result["ok"] and any(r["got"] == "allowed" for r in result["cases"].values())


def test_the_guard_probe_fails_when_the_guard_is_gone(engine, monkeypatch):
    monkeypatch.setattr(BlockManager, "check_reads", lambda self, seq, num_past, num_new: None)
    result = guard_probe(engine)
    assert not result["ok"] and {r["got"] for r in result["cases"].values()} == {"allowed"}


def test_the_scrub_probe_reads_the_page_bytes_after_a_normal_free(engine):
    result = scrub_probe(engine)
    assert result["ok"] and result["marker_written"] and result["nonzero_after_free"] == 0
    assert engine.block_manager.num_free() == 16


def test_the_scrub_probe_fails_when_freeing_does_not_scrub(engine, monkeypatch):
    monkeypatch.setattr(PagePool, "scrub", lambda self, pages: None)
    result = scrub_probe(engine)
    assert not result["ok"] and result["nonzero_after_free"] > 0 and "still holds" in result["reason"]


def test_the_guard_probe_on_the_redis_ledger_leaves_no_cache_entry_or_read_behind(tiny_model, redis_client,
                                                                                   ledger_prefix):
    from inference.engine import Engine, EngineConfig
    from inference.ledger import RedisLedger

    engine = Engine(tiny_model, EngineConfig(num_pages=16, page_size=4), allocator_factory=lambda n: RedisLedger.register(
        redis_client, "probe", "decode", n, 4, prefix=ledger_prefix))
    result = guard_probe(engine)
    assert result["ok"] and result["cases"]["choice_shared_page"]["got"] == "foreign_read", result
    ledger = engine.block_manager.allocator
    assert ledger.num_free() == 16 and not any(isinstance(s, dict) and "scope" in s for s in ledger.snapshot().values())
    ledger.check_integrity()


import pytest

from inference.allocator import LocalAllocator
from inference.block_manager import BlockManager, OwnershipViolation
from inference.engine import Engine, EngineConfig
from inference.faults import Faults
from inference.kv_cache import PagePool
from inference.sequence import SamplingParams, Sequence


def setup(num_pages=8, scrub="on_free", faults=""):
    pool = PagePool(num_pages, 4, 1, 1, 2)
    return BlockManager(LocalAllocator(num_pages, "p0"), pool, scrub, Faults.parse(faults)), pool


def seq(rid, n_prompt=5, max_tokens=3):
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens))


def test_allocate_gives_fifo_pages_and_epochs_and_free_returns_them_to_the_tail():
    bm, _ = setup()
    a, b = seq("a"), seq("b")
    assert bm.allocate(a, 2) and a.block_table == [0, 1] and a.page_epochs == [1, 2]
    assert bm.allocate(b, 3) and b.block_table == [2, 3, 4]
    bm.deallocate(a)
    assert list(bm.allocator._free) == [5, 6, 7, 0, 1]
    assert bm.owner[:5] == [None, None, "b", "b", "b"]
    c = seq("c")
    assert not bm.allocate(c, 6) and c.block_table == []  # does not fit now: nothing taken
    assert bm.num_free() == 5


def test_watermark_follows_writes_page_by_page():
    bm, _ = setup()
    a = seq("a")
    bm.allocate(a, 3)
    bm.mark_written(a, 6)
    assert bm.written[:3] == [4, 2, 0]
    a.num_cached = 6
    bm.mark_written(a, 9)
    assert bm.written[:3] == [4, 4, 1]


def test_incident_shape_eight_pages_one_written_is_an_unwritten_read():
    bm, _ = setup(num_pages=8)
    victim = seq("placeholder", n_prompt=1, max_tokens=31)  # 32 tokens -> 8 pages of 4
    bm.allocate(victim, 8)
    bm.mark_written(victim, 1)
    with pytest.raises(OwnershipViolation) as err:
        bm.check_reads(victim, num_past=30, num_new=1)  # decode believes 30 prompt tokens are cached
    v = err.value.violation
    assert (v.kind, v.page, v.watermark, v.reader, v.pool) == ("unwritten_read", 0, 1, "placeholder", "p0")


def test_a_read_past_the_block_table_is_an_unwritten_read_at_any_page_size():
    """cdiv(num_past + num_new, page_size) pages are read: one past the table's end raises, its last slot does not."""
    bm, _ = setup()
    a = seq("a")
    bm.allocate(a, 2)  # 8 slots of 4
    bm.mark_written(a, 8)
    bm.check_reads(a, num_past=7, num_new=1)
    with pytest.raises(OwnershipViolation) as err:
        bm.check_reads(a, num_past=8, num_new=1)  # slot 9: a third page the sequence does not hold
    v = err.value.violation
    assert (v.kind, v.page, v.reader) == ("unwritten_read", -1, "a")  # -1: no page of its own there


def test_foreign_page_in_block_table_is_a_foreign_read():
    bm, _ = setup()
    a, b = seq("a"), seq("b")
    bm.allocate(a, 2)
    bm.allocate(b, 2)
    bm.mark_written(b, 5)
    a.block_table[1] = b.block_table[0]
    with pytest.raises(OwnershipViolation) as err:
        bm.check_reads(a, 0, 1)
    assert err.value.violation.kind == "foreign_read" and err.value.violation.page_owner == "b"


def test_stale_epoch_is_caught_after_the_page_was_reissued():
    bm, _ = setup()
    a = seq("a")
    bm.allocate(a, 1)
    old_epoch = a.page_epochs[0]
    bm.deallocate(a)
    a2 = seq("a")  # same request id, page handed out again under a new epoch
    bm.allocate(a2, 8)
    a2.block_table, a2.page_epochs = [0], [old_epoch]
    with pytest.raises(OwnershipViolation) as err:
        bm.check_reads(a2, 0, 1)
    assert err.value.violation.kind == "stale_epoch"


def test_guards_only_switch_off_through_fault_injection():
    def corrupt(faults):
        bm, _ = setup(faults=faults)
        a, b = seq("a"), seq("b")
        bm.allocate(a, 2)
        bm.allocate(b, 2)
        a.block_table[0] = b.block_table[0]  # foreign page, and nothing written for a
        return bm, a

    bm, a = corrupt("")
    with pytest.raises(OwnershipViolation):
        bm.check_reads(a, 3, 1)
    bm, a = corrupt("no_ownership_guard,no_watermark_guard")
    assert (bm.check_owner, bm.check_watermark) == (False, False)
    bm.check_reads(a, 3, 1)  # the same read goes through only because both faults are injected


def test_scrub_policies_on_free_on_alloc_and_the_no_scrub_fault():
    for policy, faults, zero_after_free, zero_after_alloc in [
        ("on_free", "", True, True), ("on_alloc", "", False, True), ("on_free", "no_scrub", False, False),
    ]:
        bm, pool = setup(num_pages=1, scrub=policy, faults=faults)
        a = seq("a")
        bm.allocate(a, 1)
        pool.data[0].fill_(3.0)
        bm.deallocate(a)
        assert bool((pool.data[0] == 0).all()) == zero_after_free, policy
        bm.allocate(seq("b"), 1)
        assert bool((pool.data[0] == 0).all()) == zero_after_alloc, policy


def test_unknown_faults_and_policies_are_refused_with_the_known_names():
    with pytest.raises(ValueError, match="no_scrub"):
        Faults.parse("no_scrubbing")
    with pytest.raises(ValueError, match="on_free"):
        setup(scrub="sometimes")


def test_scrub_off_is_refused_unless_the_no_scrub_fault_is_set(monkeypatch, tiny_model):
    with pytest.raises(ValueError, match="KVSERVE_FAULTS=no_scrub"):
        setup(scrub="off")
    bm, _ = setup(scrub="off", faults="no_scrub")
    assert bm.scrub_policy == "off"
    monkeypatch.setenv("KVSERVE_SCRUB", "off")  # the worker's path: the environment, then the engine
    monkeypatch.delenv("KVSERVE_FAULTS", raising=False)
    with pytest.raises(ValueError, match="KVSERVE_SCRUB=off .* set KVSERVE_FAULTS=no_scrub"):
        Engine(tiny_model, EngineConfig.from_env(num_pages=8, device="cpu"))
    monkeypatch.setenv("KVSERVE_FAULTS", "no_scrub")
    assert Engine(tiny_model, EngineConfig.from_env(num_pages=8, device="cpu")).block_manager.scrub_policy == "off"


def test_append_slots_grows_several_sequences_at_once_and_the_mirror_sees_every_grown_page():
    bm, pool = setup(num_pages=6, scrub="on_alloc")
    a, b = seq("a"), seq("b")
    bm.allocate(a, 2)
    bm.allocate(b, 2)
    assert bm.pages_short(a, 8) == 0 and bm.pages_short(a, 9) == 1 and bm.pages_short(a, 13) == 2
    pool.data[4:6].fill_(5.0)  # leftovers: on_alloc scrubs grown pages too
    assert bm.can_append([(a, 1), (b, 1)]) and not bm.can_append([(a, 2), (b, 1)])
    assert not bm.append_slots([(a, 2), (b, 1)]) and a.block_table == [0, 1] and bm.num_free() == 2
    assert bm.append_slots([(a, 1), (b, 1)])
    assert (a.block_table, b.block_table) == ([0, 1, 4], [2, 3, 5]) and (a.page_epochs[-1], b.page_epochs[-1]) == (5, 6)
    assert (bm.owner[4], bm.epoch[4], bm.written[4]) == ("a", 5, 0) and bool((pool.data[4:6] == 0).all())
    bm.mark_written(a, 8)
    a.num_cached = 8
    with pytest.raises(OwnershipViolation) as err:  # the grown page is its own, but nothing was written there
        bm.check_reads(a, num_past=9, num_new=1)
    assert err.value.violation.kind == "unwritten_read" and err.value.violation.page == 4
    bm.check_reads(a, num_past=8, num_new=1)
    bm.allocator.check_integrity()

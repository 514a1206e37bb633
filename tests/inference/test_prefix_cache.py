"""The engine's prefix cache: same answers with and without a hit, only within one scope, LRU eviction
through the scrubbing path, and the read guard on shared pages."""
import pytest
import torch

from inference.allocator import cache_entry
from inference.block_manager import OwnershipViolation
from inference.engine import Engine, EngineConfig
from inference.ledger import RedisLedger
from inference.sequence import SeqStatus
from tests.inference.helpers import greedy, make_engine, run_until_done

A, B = "a" * 64, "b" * 64
SYSTEM = list(range(30, 70))  # 40 tokens = 10 pages of 4


def run(engine, rid, prompt, salt, max_tokens=8):
    seq = engine.add_request(rid, prompt, greedy(max_tokens), salt=salt)
    run_until_done(engine, [seq])
    engine.seqs.pop(rid, None)
    return seq


@pytest.mark.parametrize("chunk_size", [512, 6])
def test_a_hit_gives_the_same_greedy_answer_and_computes_only_the_rest(tiny_model, chunk_size):
    plain = make_engine(tiny_model, page_size=4, chunk_size=chunk_size)
    cached = make_engine(tiny_model, page_size=4, chunk_size=chunk_size, prefix_cache=True)
    first = run(cached, "t1", SYSTEM + [7, 8, 9], A)
    assert first.cached_tokens == 0 and len(cached.prefix_cache) == 10  # its 10 full prompt pages stay
    follow = SYSTEM + [7, 8, 9, 11, 12, 13, 14, 15]
    computed = []
    real_build = cached.runner.build
    cached.runner.build = lambda chunks: computed.extend(c.num_tokens for c in chunks) or real_build(chunks)
    second = run(cached, "t2", follow, A)
    assert second.cached_tokens == 40  # 10 pages read from the cache (the 11th holds tokens 40..43: not full)
    assert sum(computed[: len(computed) - 7]) == len(follow) - 40  # prefill computed only the rest
    assert second.output_ids == run(plain, "p", follow, None).output_ids
    assert first.output_ids == run(plain, "p0", SYSTEM + [7, 8, 9], None).output_ids
    cached.block_manager.allocator.check_integrity()


def test_another_scope_never_hits_and_no_salt_never_caches(tiny_model):
    engine = make_engine(tiny_model, page_size=4, prefix_cache=True)
    run(engine, "a1", SYSTEM + [1], A)
    assert run(engine, "b1", SYSTEM + [1], B).cached_tokens == 0
    assert run(engine, "n1", SYSTEM + [1], None).cached_tokens == 0
    assert run(engine, "a2", SYSTEM + [1], A).cached_tokens == 40
    pc = engine.prefix_cache
    assert pc.pages_by_salt() == {A: 10, B: 10} and pc.queries == {A: 2, B: 1} and pc.hits == {A: 1}


def test_lru_pages_are_evicted_tail_first_and_scrubbed_when_the_pool_needs_them(tiny_model):
    engine = make_engine(tiny_model, page_size=4, num_pages=16, prefix_cache=True)
    run(engine, "a1", SYSTEM + [1], A, max_tokens=4)  # 12 pages, 10 of them cached; 6 free
    chain = [c.page for c in sorted(engine.prefix_cache.lru.values(), key=lambda c: c.page)]
    assert engine.pool.data[chain].abs().sum() > 0
    assert engine.prefix_cache.evict(engine.block_manager.num_free() + 2) == 2
    assert engine.pool.data[chain[-2:]].abs().sum() == 0  # scrubbed on the way out, the chain's tail first
    assert engine.pool.data[chain[:-2]].abs().sum() > 0
    seq = run(engine, "b1", list(range(100, 140)), B, max_tokens=8)  # 12 pages: 8 free + 4 evicted
    assert seq.status is SeqStatus.FINISHED and seq.cached_tokens == 0
    assert engine.prefix_cache.pages_by_salt() == {A: 4, B: 10}
    assert run(engine, "a2", SYSTEM + [1], A).cached_tokens == 16  # the head of its chain still hits
    engine.block_manager.allocator.check_integrity()


def test_a_page_read_by_a_request_is_not_evicted(tiny_model):
    engine = make_engine(tiny_model, page_size=4, num_pages=24, prefix_cache=True)
    run(engine, "a1", SYSTEM + [1], A, max_tokens=4)
    reader = engine.add_request("a2", SYSTEM + [2], greedy(4), salt=A)
    engine.step()
    assert reader.num_shared == 10
    assert engine.prefix_cache.evict(24) == 0  # every cached page has a reader
    run_until_done(engine, [reader])
    assert engine.prefix_cache.evict(24) == 10


def test_the_guard_stops_a_read_of_another_scopes_page_and_a_write_into_a_shared_page(tiny_model):
    engine = make_engine(tiny_model, page_size=4, prefix_cache=True)
    run(engine, "a1", SYSTEM + [1], A)
    bm = engine.block_manager
    hits = [(c.page, c.epoch) for c in engine.prefix_cache.lru.values()][:3]
    intruder = engine.add_request("b1", SYSTEM + [1], greedy(2), salt=B)
    engine.scheduler.remove(intruder)
    intruder.block_table, intruder.page_epochs = [p for p, _ in hits], [e for _, e in hits]
    intruder.num_shared = 3  # as if the index had handed B A's pages
    bm.allocate(intruder, 5)
    with pytest.raises(OwnershipViolation, match="foreign_read: request b1 would read page"):
        bm.check_reads(intruder, 12, 1)
    intruder.salt = A  # same scope, but the chunk would write into the shared third page
    with pytest.raises(OwnershipViolation, match="shared_write"):
        bm.check_reads(intruder, 8, 4)
    bm.check_reads(intruder, 12, 1)  # its own scope, writing after the shared pages: fine


def test_on_the_redis_ledger_cached_pages_carry_their_scope(tiny_model, redis_client, ledger_prefix):
    def allocator(n):
        return RedisLedger.register(redis_client, "pc", "prefill", n, 4, prefix=ledger_prefix)

    engine = Engine(tiny_model, EngineConfig(num_pages=32, page_size=4, prefix_cache=True), allocator_factory=allocator)
    plain = make_engine(tiny_model, page_size=4)
    ledger = engine.block_manager.allocator
    run(engine, "a1", SYSTEM + [5], A)
    reader = engine.add_request("a2", SYSTEM + [5, 6], greedy(6), salt=A)
    engine.step()
    snap = ledger.snapshot()
    scoped = {p: s for p, s in snap.items() if isinstance(s, dict) and "scope" in s}
    assert len(scoped) == 10 and all(s["owner"] == cache_entry(A) and s["readers"] == ["a2"] for s in scoped.values())
    ledger.check_integrity()
    run_until_done(engine, [reader])
    assert reader.output_ids == run(plain, "p", SYSTEM + [5, 6], None, max_tokens=6).output_ids
    assert ledger.reads_of("a2") == [] and ledger.pages_of("a2") == {}
    ledger.check_integrity()
    with torch.no_grad():
        engine.prefix_cache.evict(32)
    assert all(not (isinstance(s, dict) and "scope" in s) for s in ledger.snapshot().values())
    ledger.check_integrity()

"""Pages on demand: a sequence holds what it has written plus the page it writes, a step's growth is one
ledger call, a shortage preempts the most recently admitted sequence (freed and scrubbed like a finish,
recomputed later with the same greedy output), and the scheduler never overcommits the pool."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.allocator import LocalAllocator
from inference.block_manager import OwnershipViolation
from inference.kv_cache import cdiv
from inference.scheduler import RequestTooLarge
from inference.sequence import SamplingParams, Sequence, SeqStatus
from tests.inference.helpers import greedy, make_engine, run_until_done


class CountingAllocator(LocalAllocator):
    """LocalAllocator that records every growth call (owners and counts), to count ledger round trips."""

    def __init__(self, n):
        super().__init__(n)
        self.extend_calls = []

    def extend_many(self, requests):
        self.extend_calls.append(list(requests))
        return super().extend_many(requests)


def counting_engine(model, **config):
    made = []

    def factory(n):
        made.append(CountingAllocator(n))
        return made[0]

    from inference.engine import Engine, EngineConfig
    config.setdefault("num_pages", 64)
    return Engine(model, EngineConfig(**config), allocator_factory=factory), made[0]


def held_pages(engine) -> int:
    return sum(len(s.block_table) for s in engine.seqs.values())


def test_a_sequence_holds_what_it_wrote_plus_the_page_it_writes(tiny_model):
    engine = make_engine(tiny_model, num_pages=64, page_size=4)
    seq = engine.add_request("a", list(range(10, 15)), greedy(40))  # may reach 45 tokens = 12 pages
    engine.step()
    assert seq.status is SeqStatus.RUNNING and len(seq.block_table) == 2  # the 5-token prompt only
    while not seq.is_done:
        engine.step()
        if not seq.is_done:
            assert len(seq.block_table) == cdiv(seq.num_cached, 4)  # grown only when a page boundary was crossed
    assert engine.block_manager.num_free() == 64
    engine.block_manager.allocator.check_integrity()


def test_the_prefill_side_holds_only_the_prompt_pages(tiny_model):
    engine = make_engine(tiny_model, num_pages=16, page_size=4)
    seq = engine.add_request("p", list(range(10, 19)), SamplingParams(max_tokens=50), prefill_only=True)
    engine.step()
    assert seq.status is SeqStatus.PREFILLED and len(seq.block_table) == 3  # 9 tokens, not 9 + 50
    assert engine.block_manager.num_free() == 13


def test_one_ledger_call_grows_every_sequence_crossing_a_page_boundary(tiny_model):
    engine, alloc = counting_engine(tiny_model, num_pages=64, page_size=4)
    seqs = [engine.add_request(f"r{i}", list(range(10 + i, 18 + i)), greedy(9)) for i in range(4)]
    run_until_done(engine, seqs)
    # 8-token prompts: all four cross into a new page at tokens 8 and 12, together (16 is never written)
    grows = [call for call in alloc.extend_calls if call]
    assert grows == [[(f"r{i}", 1) for i in range(4)]] * 2
    assert engine.scheduler.num_preemptions == 0


def test_a_shortage_preempts_the_newest_and_its_recompute_gives_the_same_greedy_output(tiny_model):
    prompts = [list(range(10 + 3 * i, 19 + 3 * i)) for i in range(3)]
    alone = [make_engine(tiny_model, page_size=4).generate([p], greedy(14))[0].output_ids for p in prompts]
    engine = make_engine(tiny_model, num_pages=14, page_size=4)  # 3 x 6 pages at the end: they cannot all fit
    seqs = [engine.add_request(f"r{i}", p, greedy(14)) for i, p in enumerate(prompts)]
    seen_waiting = []
    for _ in range(500):
        if all(s.is_done for s in seqs):
            break
        engine.step()
        engine.block_manager.allocator.check_integrity()
        assert held_pages(engine) <= 14
        seen_waiting += [s.request_id for s in engine.scheduler.preempted]
    assert seen_waiting and seen_waiting[0] == "r2"  # the most recently admitted goes first
    assert [s.output_ids for s in seqs] == alone
    assert engine.scheduler.num_preemptions == len(seen_waiting) == sum(s.num_preemptions for s in seqs)
    for s in seqs:  # a resumed sequence read only pages granted to it, at their epochs, within what it wrote
        r = s.read_record
        assert set(r["owners"]) == {s.request_id} and r["page_epochs"] == r["epochs"]
        assert sum(r["written"]) >= r["read_len"]
    assert engine.block_manager.num_free() == 14


def test_a_preempted_sequences_pages_go_to_another_tenant_scrubbed_and_the_old_owner_cannot_read_them(tiny_model):
    engine = make_engine(tiny_model, num_pages=8, page_size=4)
    bm, pool = engine.block_manager, engine.pool
    victim = engine.add_request("tenant-a", list(range(10, 22)), greedy(8))
    for _ in range(3):
        engine.step()
    old_pages, old_epochs = list(victim.block_table), list(victim.page_epochs)
    assert len(old_pages) == 4 and all(bool(pool.data[p].abs().sum() > 0) for p in old_pages)  # its K/V
    engine.scheduler.preempt(victim)
    assert victim.status is SeqStatus.WAITING and victim.block_table == [] and victim.num_cached == 0
    assert engine.scheduler.waiting.peek() is victim
    assert all(bool((pool.data[p] == 0).all()) for p in old_pages)  # scrubbed by the free path
    assert all(bm.owner[p] is None and bm.written[p] == 0 for p in old_pages)
    other = Sequence("tenant-b", list(range(30, 40)), greedy(4))
    assert bm.allocate(other, 8)  # the whole pool, the victim's old pages included
    assert set(old_pages) <= set(other.block_table)
    assert all(bool((pool.data[p] == 0).all()) for p in other.block_table)  # nothing of tenant-a is left
    victim.block_table, victim.page_epochs = old_pages, old_epochs  # the old owner's stale table
    with pytest.raises(OwnershipViolation) as err:
        bm.check_reads(victim, 4, 1)
    assert err.value.violation.kind == "foreign_read" and err.value.violation.page_owner == "tenant-b"
    bm.allocator.check_integrity()


def test_a_stale_table_after_preemption_fails_closed_in_a_step_and_only_the_reader_fails(tiny_model):
    engine = make_engine(tiny_model, num_pages=6, page_size=4)
    victim = engine.add_request("a", list(range(10, 18)), greedy(8))  # pages 0, 1
    engine.step()
    stale = (list(victim.block_table), list(victim.page_epochs))
    engine.scheduler.preempt(victim)
    engine.scheduler.waiting.remove(victim)
    other = engine.add_request("b", list(range(40, 60)), greedy(4))  # 5 pages: 2..5 and the victim's page 0
    engine.step()
    assert other.status is SeqStatus.RUNNING and stale[0][0] in other.block_table
    victim.block_table, victim.page_epochs = stale
    victim.num_cached, victim.status = 7, SeqStatus.RUNNING  # believes it still holds its prompt
    engine.scheduler.active.insert(0, victim)
    events = engine.step()
    assert [ev.seq for ev in events if ev.token is None] == [victim] and victim.status is SeqStatus.FAILED
    (violation,) = engine.take_violations()
    assert violation.kind == "foreign_read" and violation.page_owner == "b"
    assert other.status is SeqStatus.RUNNING  # only the reader fails
    run_until_done(engine, [other])
    assert engine.block_manager.num_free() == 6


def test_admission_leaves_the_watermark_free_while_something_runs(tiny_model):
    engine = make_engine(tiny_model, num_pages=10, page_size=4, watermark=0.4)  # 4 pages kept for growth
    assert engine.scheduler.watermark_pages == 4
    first = engine.add_request("a", list(range(10, 34)), greedy(4))  # 6 pages: alone, the watermark does not apply
    second = engine.add_request("b", list(range(10, 14)), greedy(4))  # 1 page would leave 3 of the 4 free: waits
    engine.step()
    assert first.block_table and second.status is SeqStatus.WAITING
    run_until_done(engine, [first, second])
    assert second.finish_reason == "length"


def test_admission_still_refuses_what_can_never_fit_before_taking_anything(tiny_model):
    engine = make_engine(tiny_model, num_pages=4, page_size=4)
    with pytest.raises(RequestTooLarge):
        engine.add_request("big", list(range(10, 14)), greedy(13))  # 4-token prompt fits, 17 tokens never
    assert engine.block_manager.num_free() == 4 and not engine.has_work


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 20), st.integers(0, 6)), min_size=1, max_size=6),
       st.integers(8, 16))
def test_the_scheduler_never_overcommits_and_every_request_ends(tiny_model, requests, num_pages):
    engine = make_engine(tiny_model, num_pages=num_pages, page_size=4, chunk_size=16)
    seqs, pending = [], list(requests)
    for step in range(2000):
        while pending and pending[0][2] <= step:
            n_prompt, max_tokens, _ = pending.pop(0)
            max_tokens = min(max_tokens, num_pages * 4 - n_prompt)
            seqs.append(engine.add_request(f"r{len(seqs)}", list(range(10, 10 + n_prompt)), greedy(max_tokens)))
        if not pending and all(s.is_done for s in seqs):
            break
        engine.step()
        assert held_pages(engine) + engine.block_manager.num_free() == num_pages
        for s in engine.scheduler.active:
            if s.status is SeqStatus.RUNNING:  # what it wrote plus at most the page it writes next
                assert cdiv(s.num_cached, 4) <= len(s.block_table) <= cdiv(s.num_cached + 1, 4)
        engine.block_manager.allocator.check_integrity()
    assert all(s.finish_reason == "length" and len(s.output_ids) == s.params.max_tokens for s in seqs)
    assert engine.block_manager.num_free() == num_pages


def test_a_verified_handoff_waits_while_a_preempted_sequence_waits_to_resume(tiny_model):
    prefill = make_engine(tiny_model, num_pages=8, page_size=4)
    p = prefill.add_request("h", list(range(50, 58)), greedy(4), prefill_only=True)
    prefill.step()
    blob, _ = prefill.export_kv(p)
    engine = make_engine(tiny_model, num_pages=14, page_size=4)
    seqs = [engine.add_request(f"r{i}", list(range(10 + 3 * i, 19 + 3 * i)), greedy(14)) for i in range(3)]
    while not engine.scheduler.preempted:
        engine.step()
    assert engine.block_manager.num_free() >= 2  # the handoff's 2 pages would fit, but r2 resumes first
    assert engine.add_prefilled("h", p.prompt_ids, p.output_ids[0], blob, greedy(4)) is None
    run_until_done(engine, seqs)
    d = engine.add_prefilled("h", p.prompt_ids, p.output_ids[0], blob, greedy(4))
    assert d is not None and len(d.block_table) == 2  # the prompt's pages only; it grows as it decodes


def test_another_tenants_handoff_does_not_wait_behind_a_preempted_sequence_of_a_tenant_holding_more(tiny_model):
    """Work-conserving fairness on the decode side: tenant A fills the pool until one of its sequences is
    preempted; tenant B, holding nothing here, joins at once when its pages fit, while a handoff of A's own
    still waits for A's preempted sequence to resume (the order the waiting queue would pick)."""
    prefill = make_engine(tiny_model, num_pages=8, page_size=4)
    handoffs = {}
    for rid, tenant in (("hb", "B"), ("ha", "A")):
        p = prefill.add_request(rid, list(range(50, 58)), greedy(4, tenant=tenant), prefill_only=True)
        prefill.step()
        handoffs[rid] = (p, prefill.export_kv(p)[0])
        prefill.release(p)
    engine = make_engine(tiny_model, num_pages=14, page_size=4)
    seqs = [engine.add_request(f"r{i}", list(range(10 + 3 * i, 19 + 3 * i)), greedy(14, tenant="A"))
            for i in range(3)]
    while not engine.scheduler.preempted:
        engine.step()
    assert engine.block_manager.num_free() >= 2 and engine.scheduler.waiting
    p, blob = handoffs["ha"]
    assert engine.add_prefilled("ha", p.prompt_ids, p.output_ids[0], blob, greedy(4, tenant="A")) is None
    p, blob = handoffs["hb"]
    b = engine.add_prefilled("hb", p.prompt_ids, p.output_ids[0], blob, greedy(4, tenant="B"))
    assert b is not None and len(b.block_table) == 2
    run_until_done(engine, [*seqs, b])
    assert engine.block_manager.num_free() == 14
    engine.block_manager.allocator.check_integrity()


# ---- the pick order from `waiting`: round-robin across tenants (inference.fair_queue) -------------------

def bare_scheduler(num_pages=64, max_num_seqs=64, chunk_size=10_000):
    from inference.block_manager import BlockManager
    from inference.faults import Faults
    from inference.kv_cache import PagePool
    from inference.scheduler import Scheduler

    pool = PagePool(num_pages, 4, 1, 1, 2)
    bm = BlockManager(LocalAllocator(num_pages, "p0"), pool, "on_free", Faults.parse(""))
    return Scheduler(bm, chunk_size=chunk_size, max_num_seqs=max_num_seqs)


def tenant_seq(rid, tenant, n_prompt=4, max_tokens=4):
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, tenant=tenant))


def admitted(s) -> list[str]:
    """Request ids the next schedule() takes from `waiting`, in pick order."""
    before = set(map(id, s.active))
    s.schedule()
    return [q.request_id for q in s.active if id(q) not in before and q.status is SeqStatus.PREFILLING]


def test_waiting_requests_are_admitted_round_robin_across_tenants():
    s = bare_scheduler(max_num_seqs=4)
    for i in range(6):
        s.add(tenant_seq(f"a{i}", "A"))
    s.add(tenant_seq("b0", "B"))
    s.add(tenant_seq("c0", "C"))
    assert admitted(s) == ["a0", "b0", "c0", "a1"]  # FIFO would admit a0..a3


def test_smaller_requests_pass_a_head_that_does_not_fit_for_as_many_pages_as_it_needs_then_it_goes_first():
    s = bare_scheduler(num_pages=8)  # pages of 4 tokens
    hog = tenant_seq("hog", "A", n_prompt=24, max_tokens=4)  # admitted with its 6 prompt pages
    s.add(hog)
    assert admitted(s) == ["hog"]
    big = tenant_seq("big", "B", n_prompt=20, max_tokens=4)  # 5 prompt pages: does not fit the 2 free
    s.add(big)
    for i in range(8):
        s.add(tenant_seq(f"a{i}", "A", n_prompt=2, max_tokens=2))  # 1 page each
    passed = []
    for _ in range(4):  # each round the small ones admitted finish, and more may pass
        now = admitted(s)
        passed += now
        for seq in [q for q in s.active if q.request_id in now]:
            s.finish(seq)
    assert passed == ["a0", "a1", "a2", "a3", "a4"]  # 5 pages in all: what the head needs, then nothing more
    assert s.waiting.peek() is big and big.status is SeqStatus.WAITING
    s.finish(hog)
    assert admitted(s) == ["big", "a5", "a6", "a7"]  # the head first, then the rest in turn


def test_a_head_is_not_starved_by_a_stream_of_smaller_requests_that_keeps_its_pages_busy():
    """Small requests that overlap (each lives two steps, one arrives each step) would keep a page busy forever,
    so a head needing every page left would never fit; the bypass's bound stops admitting them."""
    s = bare_scheduler(num_pages=8)
    s.add(tenant_seq("hog", "A", n_prompt=12, max_tokens=4))  # 3 pages, held throughout
    s.add(tenant_seq("c0", "C", n_prompt=2, max_tokens=2))
    assert admitted(s) == ["hog", "c0"]
    big = tenant_seq("big", "B", n_prompt=20, max_tokens=4)  # 5 pages: all that is left once c0 is done
    s.add(big)
    alive, passed = [s.active[-1]], []
    for step in range(1, 40):
        if big.status is not SeqStatus.WAITING:
            break
        s.add(tenant_seq(f"c{step}", "C", n_prompt=2, max_tokens=2))
        now = admitted(s)
        passed += [r for r in now if r != "big"]
        for seq in alive:  # the one admitted a step ago finishes now
            s.finish(seq)
        alive = [q for q in s.active if q.request_id in now and q is not big]
    assert big.status is SeqStatus.PREFILLING, "the big head was starved by the small stream"
    assert 1 <= len(passed) <= 5  # small ones passed it, within the pages it needs


def test_a_tenant_holding_few_pages_gets_the_prefill_budget_before_another_tenants_long_prompts():
    s = bare_scheduler(num_pages=64, chunk_size=16)
    for i in range(3):
        s.add(tenant_seq(f"a{i}", "A", n_prompt=40, max_tokens=4))  # 10 pages each, 40 tokens to prefill
    assert admitted(s) == ["a0"]  # 16 tokens of its 40
    s.add(tenant_seq("b0", "B", n_prompt=8, max_tokens=4))
    chunks = s.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in chunks][0] == ("b0", 8)  # B holds nothing: first


def test_a_shortage_preempts_the_newest_sequence_of_the_tenant_holding_the_most_pages():
    s = bare_scheduler(num_pages=12)  # pages of 4 tokens
    for rid, tenant in (("a0", "A"), ("a1", "A"), ("a2", "A"), ("b0", "B")):
        s.add(tenant_seq(rid, tenant, n_prompt=8, max_tokens=8))  # 2 pages each
    assert admitted(s) == ["a0", "b0", "a1", "a2"]  # B holds least once A has one: its turn comes second
    s.add(tenant_seq("b1", "B", n_prompt=8, max_tokens=8))
    assert admitted(s) == ["b1"]  # the newest of all; A holds 6 pages, B 4, 2 are free
    for seq in s.active:  # every prompt written: each needs its third page, 5 pages for the 2 free
        seq.num_cached, seq.status = 8, SeqStatus.RUNNING
    s.schedule()
    assert [q.request_id for q in s.preempted] == ["a2"]  # not b1: A is the most over its share
    assert s.block_manager.num_free() == 0 and all(len(q.block_table) == 3 for q in s.active)


def test_a_tenant_alone_fills_the_pool_and_is_preempted_for_another_tenants_head_under_its_share():
    s = bare_scheduler(num_pages=12)  # pages of 4 tokens
    for i in range(6):
        s.add(tenant_seq(f"a{i}", "A", n_prompt=8, max_tokens=8))  # 2 pages each: the whole pool
    assert admitted(s) == [f"a{i}" for i in range(6)] and s.block_manager.num_free() == 0  # alone: all of it
    b = tenant_seq("b0", "B", n_prompt=8, max_tokens=8)
    s.add(b)
    s.schedule()  # does not fit: B's head waits this step
    assert b.status is SeqStatus.WAITING and s.blocked is b
    s.schedule()  # B is under its share (6 pages of 12), A over it: A's newest makes room
    assert [q.request_id for q in s.preempted] == ["a5"] and b.status is SeqStatus.PREFILLING
    assert s.waiting.peek().request_id == "a5"  # recomputed later, first of A's


def test_a_tenant_alone_fills_every_slot_and_gives_one_up_to_another_tenant():
    s = bare_scheduler(max_num_seqs=4)
    for i in range(5):
        s.add(tenant_seq(f"a{i}", "A"))
    assert admitted(s) == ["a0", "a1", "a2", "a3"]
    assert admitted(s) == []  # alone: a4 waits for a slot, nothing is preempted for A's own
    s.add(tenant_seq("b0", "B"))
    s.schedule()
    assert [q.request_id for q in s.preempted] == ["a3"] and [q.request_id for q in s.active][-1] == "b0"
    s.add(tenant_seq("b1", "B"))
    s.schedule()  # B holds 1 of 4 slots, A 3: one more for B (2 each)
    assert [q.request_id for q in s.preempted] == ["a2"]
    s.add(tenant_seq("b2", "B"))
    s.schedule()  # B at its share of 2 slots: no more preemption for it
    assert s.preempted == [] and sorted(q.tenant for q in s.active) == ["A", "A", "B", "B"]


def test_no_preemption_for_a_head_that_would_take_its_tenant_over_its_share():
    s = bare_scheduler(num_pages=12)
    for i in range(6):
        s.add(tenant_seq(f"a{i}", "A", n_prompt=8, max_tokens=8))
    admitted(s)
    big = tenant_seq("big", "B", n_prompt=32, max_tokens=4)  # 8 pages: more than B's share of 6
    s.add(big)
    for _ in range(3):
        s.schedule()
        assert s.preempted == [] and big.status is SeqStatus.WAITING  # it waits for pages A frees


def test_the_probe_reserve_admits_a_canary_probe_on_a_pool_full_for_everyone_else(tiny_model):
    """Two ordinary sequences run and grow until one is preempted: growth and admission leave the reserve free
    while both run, and a canary probe's handoff is admitted at once, ahead of the preempted sequence."""
    prefill = make_engine(tiny_model, num_pages=8, page_size=4)
    p = prefill.add_request("canary-probe-h", list(range(50, 58)), greedy(4), prefill_only=True)
    prefill.step()
    blob, _ = prefill.export_kv(p)
    engine = make_engine(tiny_model, num_pages=14, page_size=4, probe_reserve_pages=3)
    seqs = [engine.add_request(f"r{i}", list(range(10 + 3 * i, 19 + 3 * i)), greedy(14)) for i in range(3)]
    while not engine.scheduler.preempted:
        engine.step()
        if len(engine.scheduler.active) > 1:
            assert engine.block_manager.num_free() >= 3
    assert engine.scheduler.waiting  # a preempted sequence waits to resume: an ordinary handoff would wait too
    probe = engine.add_prefilled("canary-probe-h", p.prompt_ids, p.output_ids[0], blob, greedy(4))
    assert probe is not None and len(probe.block_table) == 2
    run_until_done(engine, [*seqs, probe])
    assert engine.block_manager.num_free() == 14
    engine.block_manager.allocator.check_integrity()

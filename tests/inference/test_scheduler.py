"""The scheduler's pick order from `waiting`: round-robin across tenants; a head that does not fit keeps
its turn until pages are freed (no starvation)."""
from inference.allocator import LocalAllocator
from inference.block_manager import BlockManager
from inference.faults import Faults
from inference.kv_cache import PagePool
from inference.scheduler import Scheduler
from inference.sequence import SamplingParams, Sequence, SeqStatus


def setup(num_pages=64, max_num_seqs=64, chunk_size=10_000):
    pool = PagePool(num_pages, 4, 1, 1, 2)
    bm = BlockManager(LocalAllocator(num_pages, "p0"), pool, "on_free", Faults.parse(""))
    return Scheduler(bm, chunk_size=chunk_size, max_num_seqs=max_num_seqs)


def seq(rid, tenant, n_prompt=4, max_tokens=4):
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, tenant=tenant))


def admitted(s: Scheduler) -> list[str]:
    """Request ids the next schedule() takes from `waiting`, in pick order."""
    before = set(map(id, s.active))
    s.schedule()
    return [q.request_id for q in s.active if id(q) not in before and q.status is SeqStatus.PREFILLING]


def test_waiting_requests_are_admitted_round_robin_across_tenants():
    s = setup(max_num_seqs=4)
    for i in range(6):
        s.add(seq(f"a{i}", "A"))
    s.add(seq("b0", "B"))
    s.add(seq("c0", "C"))
    assert admitted(s) == ["a0", "b0", "c0", "a1"]  # FIFO would admit a0..a3


def test_a_head_that_does_not_fit_keeps_its_turn_and_is_served_when_pages_free():
    s = setup(num_pages=8)  # pages of 4 tokens
    hog = seq("hog", "A", n_prompt=12, max_tokens=12)  # 6 pages
    s.add(hog)
    assert admitted(s) == ["hog"]
    big = seq("big", "B", n_prompt=12, max_tokens=8)  # 5 pages: does not fit the 2 free
    s.add(big)
    for i in range(3):
        s.add(seq(f"a{i}", "A", n_prompt=2, max_tokens=2))  # 1 page each: would fit, but it is B's turn
    assert admitted(s) == []
    s.finish(hog)
    assert admitted(s) == ["big", "a0", "a1", "a2"]

"""The native kernels' own threads (inference/native/pool.cpp): a job's chunks run on whichever thread is free, so
the results do not depend on how many threads took part, two callers at once both finish, and a forked child
(no helpers) still runs every job."""
import multiprocessing
import threading

import pytest
import torch

from inference import native
from inference.precision import _coded_weight, group8_quantize, group_quantize

pytestmark = pytest.mark.skipif(not native.fused_available(), reason="the native library is built by make install")


@pytest.fixture
def threads():
    before = native.threads()
    yield native.set_threads
    native.set_threads(before)


def coded(n, k, q8=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    return _coded_weight(w, (group8_quantize if q8 else group_quantize)(w), lambda t: None, 1 << 30)


def product(x, p):
    if p.interleaved:
        return native.interleaved_linear(x, p.codes, p.scale, p.mins)
    if p.mins is None:
        return native.w8a8_linear(x, p.codes, p.scale)
    return native.w4a8_linear(x, p.codes, p.scale, p.mins)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_every_thread_count_computes_the_same_bits(threads, rows):
    """Each output is computed whole by one thread, whichever: 1, 2 or 4 threads give identical products."""
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    for p in (coded(960, 576), coded(4096, 576, q8=True)):
        threads(1)
        want = product(x, p)
        for n in (2, 4):
            threads(n)
            assert torch.equal(product(x, p), want), n
        assert native.threads() == 4


def test_two_callers_at_once_both_get_their_products(threads):
    """One caller holds the pool, the other runs its job on its own thread: neither waits for the other's chunks
    nor takes them."""
    threads(2)
    p = coded(1536, 576)
    xs = [torch.randn(3, 576, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    threads(1)
    want = [product(x, p) for x in xs]
    threads(2)
    got, errors = [[], []], []

    def call(i):
        try:
            for _ in range(200):
                got[i].append(product(xs[i], p))
        except Exception as exc:  # noqa: BLE001  reported below
            errors.append(exc)

    workers = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in workers)
    assert all(torch.equal(g, want[i]) for i in range(2) for g in got[i])


_FORKED = {}


def _forked_product(queue):
    """In the child: only the native job (torch's own OpenMP pool is not fork-safe; the inputs come from the parent)."""
    native.set_threads(2)
    queue.put(product(_FORKED["x"], _FORKED["p"]).sum().item())


def test_a_forked_child_runs_its_jobs_without_the_parents_helpers(threads):
    threads(2)
    _FORKED.update(p=coded(960, 576), x=torch.ones(2, 576))
    want = product(_FORKED["x"], _FORKED["p"]).sum().item()  # the parent's helpers exist now
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_forked_product, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, "the child hung or died running a job"
    assert queue.get(timeout=5) == want


def test_the_thread_count_is_bounded():
    with pytest.raises(RuntimeError, match="1..64 threads"):
        native.set_threads(0)
    with pytest.raises(RuntimeError, match="1..64 threads"):
        native.set_threads(65)

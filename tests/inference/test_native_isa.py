"""Each build of the paged-attention kernel's loop (avx512, avx2, generic: `kvserve_paged::set_isa`,
KVSERVE_ATTN_ISA at load) against the SDPA reference and against each other: ragged contexts, GQA and
MHA, head dims with and without a 16-multiple, page boundaries, prefill chunks (q > 1) and decode rows."""
import os
import subprocess
import sys

import pytest
import torch

from inference import native
from inference.attention import BACKENDS, AttentionBatch, SeqBatch
from inference.kv_cache import PagePool, cdiv
from tests.inference.helpers import fill_pool_randn, kernel_tolerance
from tests.inference.test_attention import random_case

SHAPES = [(9, 3, 64), (4, 2, 16), (4, 4, 32), (8, 1, 128), (6, 2, 24), (9, 3, 80), (4, 2, 160), (10, 2, 48)]


def runnable_isas() -> list[str]:
    best = native.set_isa("")
    return ["generic", "avx2", "avx512"][: ["generic", "avx2", "avx512"].index(best) + 1]


@pytest.fixture(autouse=True)
def best_isa_after():
    assert native.load(), f"the paged-attention kernel is not built ({native.load_error()}): run `make install`"
    yield
    native.set_isa("")


def test_the_best_isa_of_this_cpu_is_the_default():
    flags = open("/proc/cpuinfo").read().split()
    expected = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags and "fma" in flags else "generic"
    assert native.set_isa("") == expected == native.isa()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("h,kvh,d", SHAPES)
def test_every_isa_matches_sdpa_and_the_others(h, kvh, d, page_size, dtype):
    pool, batch, q, k, v = random_case(h, kvh, d, page_size=page_size, seed=page_size + d, num_pages=400,
                                       dtype=dtype)
    ref = BACKENDS["sdpa"](q, k, v, pool, 2, AttentionBatch(**{**batch.__dict__, "cache": {}}))
    outs = {}
    for isa in runnable_isas():
        assert native.set_isa(isa) == isa
        outs[isa] = BACKENDS["native"](q, k, v, pool, 2, batch)
        assert torch.isfinite(outs[isa]).all()
        torch.testing.assert_close(outs[isa], ref, **kernel_tolerance(dtype))
    for isa, out in outs.items():
        torch.testing.assert_close(out, outs["generic"], **(kernel_tolerance(dtype) if dtype == torch.int8 else
                                                             {"rtol": 1e-5, "atol": 1e-5}))


def decode_batch(pool, heads, lens, qlens, gen):
    """Sequences of `lens` keys (the last `qlens` of each this step's queries) on shuffled pages of `pool`, null-page
    padded; with random queries and the SDPA reference's output."""
    ps = pool.page_size
    perm = torch.randperm(pool.num_pages, generator=gen).tolist()
    width = max(cdiv(n, ps) for n in lens)
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at: at + cdiv(n, ps)] + [pool.null_page] * (width - cdiv(n, ps)))
        at += cdiv(n, ps)
    starts = [sum(qlens[:i]) for i in range(len(qlens))]
    rows = sum(qlens)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    batch = AttentionBatch(torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long),
                           paged=SeqBatch(i32(tables), i32(lens), i32(starts), i32(qlens), lens, starts, qlens),
                           page_size=ps, null_page=pool.null_page)
    q = torch.randn(rows, heads, pool.head_dim, generator=gen)
    k = v = torch.zeros(rows, pool.num_kv_heads, pool.head_dim)
    ref = BACKENDS["sdpa"](q, k, v, pool, 1, AttentionBatch(**{**batch.__dict__, "cache": {}}))
    return batch, q, k, v, ref


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("ctx", [1, 7, 8, 9, 15, 16, 17, 31, 33, 300])
def test_the_blocked_loops_over_long_ragged_contexts_decode_and_chunks(ctx, dtype, isa):
    """The blocked loops (8 tokens a block on AVX2, 16 on AVX-512): contexts on each side of a block, decode rows and
    a chunk continuing its prefix."""
    if isa not in runnable_isas():
        pytest.skip(f"this CPU cannot run {isa}")
    gen = torch.Generator().manual_seed(ctx)
    ps, h, kvh, d = 16, 9, 3, 64
    pool = PagePool(96, ps, 2, kvh, d, dtype=dtype)
    fill_pool_randn(pool, gen)
    chunk = min(ctx, 7)
    batch, q, k, v, ref = decode_batch(pool, h, [ctx, ctx + 5, max(1, ctx - 3), ctx], [1, 1, 1, chunk], gen)
    native.set_isa(isa)
    torch.testing.assert_close(BACKENDS["native"](q, k, v, pool, 1, batch), ref, **kernel_tolerance(dtype))


def test_an_unknown_isa_is_refused():
    with pytest.raises(RuntimeError, match="KVSERVE_ATTN_ISA must be"):
        native.set_isa("sse9")


def test_the_env_knob_is_read_at_load():
    code = "from inference import native; assert native.load(), native.load_error(); print(native.isa())"
    env = {**os.environ, "KVSERVE_ATTN_ISA": "generic", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "generic"
    env["KVSERVE_ATTN_ISA"] = "bogus"
    code = "from inference import native; assert not native.load(); print(native.load_error())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "KVSERVE_ATTN_ISA" in out.stdout and "avx512" in out.stdout  # the setting named, with its choices


@pytest.mark.parametrize("cap", ["default", "avx2"])
def test_torchs_cpu_capability_caps_every_native_loop(cap):
    """ATEN_CPU_CAPABILITY, torch's own cap, runs this CPU as a narrower one: attention and w4a8's loop alike (so a
    benchmark capped to AVX2 measures the AVX2 kernels), never wider than the CPU."""
    builds = runnable_isas()
    want = "generic" if cap == "default" else builds[min(1, len(builds) - 1)]
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_ATTN_ISA"} | {"ATEN_CPU_CAPABILITY": cap}
    out = subprocess.run([sys.executable, "-c", "from inference import native; native.load(); "
                          "print(native.isa(), native.quant_isa())"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [want, want]


def test_an_item_is_cut_by_its_keys_alone():
    """More than 256 keys: equal parts of at most 256 (one client's 512-token decode row runs on two threads); the
    cut never depends on the threads or the batch, so a sequence's numbers do not either."""
    assert native.attention_parts([256, 257, 512, 1000, 16]) == [1, 2, 2, 4, 1]
    assert native.attention_parts([512] * 32) == [2] * 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("ctx", [257, 300, 512, 1000, 1037])
def test_one_long_sequence_cut_into_parts_matches_the_reference_under_every_isa(ctx, dtype):
    """One decode row alone (and one beside a chunk continuing its prefix): its keys run as parts on the native
    pool's threads and are merged; the same attention as the reference, and bit for bit the same at one thread."""
    gen = torch.Generator().manual_seed(ctx)
    ps, h, kvh, d = 16, 9, 3, 64
    pool = PagePool(cdiv(ctx + 40, ps) * 2 + 4, ps, 2, kvh, d, dtype=dtype)
    fill_pool_randn(pool, gen)
    threads = native.threads()
    try:
        for lens, qlens in (([ctx], [1]), ([ctx, ctx // 2 + 3], [1, 2])):
            batch, q, k, v, ref = decode_batch(pool, h, lens, qlens, gen)
            keys = [n - ql + j + 1 for n, ql in zip(lens, qlens) for j in range(ql)]
            assert max(native.attention_parts(keys)) > 1  # the long row is cut
            for isa in runnable_isas():
                native.set_isa(isa)
                native.set_threads(2)
                two_threads = BACKENDS["native"](q, k, v, pool, 1, batch)
                native.set_threads(1)
                one_thread = BACKENDS["native"](q, k, v, pool, 1, batch)  # the same parts, one after the other
                torch.testing.assert_close(two_threads, ref, **kernel_tolerance(dtype))
                assert torch.equal(two_threads, one_thread)  # the threads change who computes a part, not its numbers
    finally:
        native.set_threads(threads)


@pytest.mark.parametrize("q_scale", [0.0, 1e-6, 30.0])
def test_the_int8_loop_rounds_q_per_head_at_any_size(q_scale):
    """The AVX-512 loop over an int8 pool takes q as int16 over its head's largest |value|: a zero query attends
    uniformly (its zero maximum divides nothing), a tiny one keeps its digits, and one whose scores run to ~100
    stays within what that rounding allows (the error grows with the scores: ~1.5e-5 of each, measured 1.2e-3 at
    this size, where the fp32 loops stay within 2e-5)."""
    if "avx512" not in runnable_isas():
        pytest.skip("this CPU cannot run avx512")
    gen = torch.Generator().manual_seed(5)
    pool = PagePool(96, 16, 2, 3, 64, dtype=torch.int8)
    fill_pool_randn(pool, gen)
    batch, q, k, v, _ = decode_batch(pool, 9, [300, 37, 5], [1, 1, 1], gen)
    q = q * q_scale
    ref = BACKENDS["sdpa"](q, k, v, pool, 1, AttentionBatch(**{**batch.__dict__, "cache": {}}))
    native.set_isa("avx512")
    out = BACKENDS["native"](q, k, v, pool, 1, batch)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5 if q_scale < 1 else 4e-3)
    native.set_isa("generic")
    torch.testing.assert_close(BACKENDS["native"](q, k, v, pool, 1, batch), ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("ctx", [1, 15, 17, 256, 300, 1000])
def test_the_int8_pools_two_pass_loop_and_its_online_loop_match_the_reference(ctx):
    """Over an int8 pool the AVX-512 loop runs in two passes (every score, one softmax per head, then V) unless told
    one: both within the int8 tolerance of the reference, over ragged contexts, a chunk and parts of a long row."""
    if "avx512" not in runnable_isas():
        pytest.skip("this CPU cannot run avx512")
    gen = torch.Generator().manual_seed(ctx)
    pool = PagePool(cdiv(ctx + 40, 16) * 4 + 8, 16, 2, 3, 64, dtype=torch.int8)
    fill_pool_randn(pool, gen)
    batch, q, k, v, ref = decode_batch(pool, 9, [ctx, ctx + 5, max(1, ctx - 3), ctx], [1, 1, 1, min(ctx, 7)], gen)
    native.set_isa("avx512")
    assert native.set_int8_passes() == 2  # the default
    try:
        outs = {}
        for passes in (2, 1):
            assert native.set_int8_passes(passes) == passes
            outs[passes] = BACKENDS["native"](q, k, v, pool, 1, batch)
            torch.testing.assert_close(outs[passes], ref, **kernel_tolerance(torch.int8))
        torch.testing.assert_close(outs[2], outs[1], **kernel_tolerance(torch.int8))
    finally:
        native.set_int8_passes(2)
    with pytest.raises(RuntimeError, match="1 or 2 passes"):
        native.set_int8_passes(3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_paged_read_reads_exactly_the_rows_a_step_attends(dtype):
    """bench.attention's yardstick (native.paged_read): every K and V row, all KV heads, of the keys each item of the
    step sees (a decode row, a chunk's rows each up to its own key, a long row cut into parts), of the layer asked
    for and no other: the sum of their 32-bit words equals torch's over the same rows, at one thread and at two."""
    gen = torch.Generator().manual_seed(7)
    ps, h, layer = 16, 9, 1
    lens, qlens = [300, 17, 40, 1], [1, 1, 3, 1]
    pool = PagePool(sum(cdiv(n, ps) for n in lens) + 8, ps, 3, 3, 64, dtype=dtype)
    fill_pool_randn(pool, gen)
    batch, *_ = decode_batch(pool, h, lens, qlens, gen)
    words = pool.data.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [pages, layers, 2, ps, kvh, row words]
    want = 0
    for i, (n, ql) in enumerate(zip(lens, qlens)):
        table = batch.paged.tables[i].tolist()
        for j in range(ql):
            for t in range(n - ql + j + 1):
                want += int(words[table[t // ps], layer, :, t % ps].sum())
    want = (want + 2**63) % 2**64 - 2**63  # the op's int64
    threads = native.threads()
    try:
        for n_threads in (1, 2):
            native.set_threads(n_threads)
            got = native.paged_read(pool.data, layer, batch.paged.tables, batch.paged.context_lens,
                                    batch.paged.query_start, batch.paged.query_len)
            assert got == want, (n_threads, got, want)
    finally:
        native.set_threads(threads)

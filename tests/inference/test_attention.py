"""The native paged-attention kernel against the SDPA reference (gathered pages), on random block
tables: null-page padding, partial last pages, decode rows, chunks continuing a cached prefix,
fresh chunks, GQA and MHA, the head dims the models use. And: the kernel is what runs by default
on the CPU; without a build the engine falls back loudly."""
import logging
import random

import pytest
import torch

from inference import attention, native
from inference.attention import BACKENDS, AttentionBatch, PrefillSlice, SeqBatch
from inference.engine import Engine, EngineConfig
from inference.kv_cache import PagePool, cdiv
from tests.inference.helpers import fill_pool_randn, kernel_tolerance, poison_page

# (query heads, kv heads, head dim): SmolLM2-135M (9/3/64), the tiny model (4/2/16), MHA, MQA, a
# head dim without a specialised kernel (24)
SHAPES = [(9, 3, 64), (4, 2, 16), (4, 4, 32), (8, 1, 128), (6, 2, 24), (8, 8, 64)]


def random_case(h, kvh, d, *, page_size=4, layers=3, seed=0, num_pages=96, dtype=torch.float32):
    """A pool (of `dtype`) of random K/V, a flat batch of decode rows, continued chunks and fresh chunks with
    random (disjoint) page tables; pages no sequence owns hold NaN, so a stray read shows."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pool = PagePool(num_pages, page_size, layers, kvh, d, dtype=dtype)
    fill_pool_randn(pool, gen)
    free = list(range(num_pages))
    rng.shuffle(free)
    kinds = ["decode"] * 6 + ["continued"] * 3 + ["fresh"] * 2
    rng.shuffle(kinds)
    seqs, fresh, row, owned = [], [], 0, set()
    for kind in kinds:
        n = 1 if kind == "decode" else rng.randint(2, 9)
        past = 0 if kind == "fresh" else rng.randint(1, 23)  # often not a page multiple: partial last page
        ctx = past + n
        pages = [free.pop() for _ in range(cdiv(ctx, page_size))]
        owned.update(pages)
        if kind == "fresh":
            fresh.append(PrefillSlice(row, n))
        else:
            seqs.append((pages, ctx, row, n))
        row += n
    for p in set(range(num_pages)) - owned:
        poison_page(pool, p)
    width = max(len(p) for p, *_ in seqs) + 2  # wider than any: null-page padding on every row
    tables = torch.tensor([p + [pool.null_page] * (width - len(p)) for p, *_ in seqs], dtype=torch.int32)
    lens, starts, qlens = [s[1] for s in seqs], [s[2] for s in seqs], [s[3] for s in seqs]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    batch = AttentionBatch(torch.zeros(row, dtype=torch.long), torch.zeros(row, dtype=torch.long),
                           paged=SeqBatch(tables, i32(lens), i32(starts), i32(qlens), lens, starts, qlens),
                           fresh=fresh, page_size=page_size, null_page=pool.null_page)
    q = torch.randn(row, h + kvh, d, generator=gen)[:, :h]  # a view with a row stride, like the model's
    k, v = torch.randn(row, kvh, d, generator=gen), torch.randn(row, kvh, d, generator=gen)
    return pool, batch, q, k, v


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    assert native.load(), f"the paged-attention kernel is not built ({native.load_error()}): run `make install`"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("h,kvh,d", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_sdpa_over_gathered_pages(h, kvh, d, seed, dtype):
    """A bf16 pool too: its values widen exactly, so the kernel's fp32 math matches the reference's as tightly; and an
    int8 pool, whose reference reads each row as code x scale (kv_cache.dequantize_rows)."""
    pool, batch, q, k, v = random_case(h, kvh, d, seed=seed, dtype=dtype)
    for layer in range(pool.num_layers):
        ours = BACKENDS["native"](q, k, v, pool, layer, batch)
        ref = BACKENDS["sdpa"](q, k, v, pool, layer, AttentionBatch(**{**batch.__dict__, "cache": {}}))
        assert torch.isfinite(ours).all() and torch.isfinite(ref).all()
        torch.testing.assert_close(ours, ref, **kernel_tolerance(dtype))


@pytest.mark.parametrize("page_size", [1, 16])
def test_kernel_with_other_page_sizes_and_one_thread(page_size):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pool, batch, q, k, v = random_case(9, 3, 64, page_size=page_size, seed=3, num_pages=400)
        ref = BACKENDS["sdpa"](q, k, v, pool, 1, batch)
        torch.testing.assert_close(BACKENDS["native"](q, k, v, pool, 1, batch), ref, rtol=1e-5, atol=2e-5)
    finally:
        torch.set_num_threads(threads)


def test_kernel_refuses_a_page_outside_the_pool_and_a_table_too_short():
    pool, batch, q, k, v = random_case(4, 2, 16)
    sb = batch.paged
    bad = sb.tables.clone()
    bad[0, 0] = pool.num_pages + 1  # past the null page
    out = torch.empty_like(q)
    args = (sb.context_lens, sb.query_start, sb.query_len, 0.25)
    with pytest.raises(RuntimeError, match="page id out of range"):
        native.paged_attention(out, q, pool.data, 0, bad, *args)
    with pytest.raises(RuntimeError, match="bad query_len/context_len"):
        native.paged_attention(out, q, pool.data, 0, sb.tables[:, :1].contiguous(), *args)


@pytest.mark.parametrize("op", ["paged_attention", "paged_read"])
def test_kernel_and_its_page_read_refuse_a_bad_step_before_reading(op):
    """The checks of one step's plan (inference/native/paged_attention.cpp: plan_step), which the kernel and
    bench.attention's page read share: a page outside the pool, a table too short, a layer the pool lacks, query rows
    past q, a q or out of the wrong kind (the kernel), index tensors not int32, one length too few. Each refused with its own message, nothing read."""
    pool, batch, q, k, v = random_case(4, 2, 16)
    sb = batch.paged
    out = torch.empty_like(q)

    def call(tables=sb.tables, lens=sb.context_lens, starts=sb.query_start, layer=0):
        if op == "paged_attention":
            native.paged_attention(out, q, pool.data, layer, tables, lens, starts, sb.query_len, 0.25)
        else:
            native.paged_read(pool.data, layer, tables, lens, starts, sb.query_len)

    bad = sb.tables.clone()
    bad[0, 0] = pool.num_pages + 1
    with pytest.raises(RuntimeError, match="page id out of range"):
        call(tables=bad)
    with pytest.raises(RuntimeError, match="bad query_len/context_len"):
        call(tables=sb.tables[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="layer out of range"):
        call(layer=pool.num_layers)
    with pytest.raises(RuntimeError, match="index tensors must be int32"):
        call(lens=sb.context_lens.long())
    with pytest.raises(RuntimeError, match="one context_len, query_start, query_len per sequence"):
        call(lens=sb.context_lens[:-1].contiguous())
    if op == "paged_attention":  # the page read takes no q
        with pytest.raises(RuntimeError, match="query rows out of range"):
            call(starts=sb.query_start + q.shape[0])
        with pytest.raises(RuntimeError, match="q must be fp32"):
            native.paged_attention(out, q.to(torch.bfloat16), pool.data, 0, sb.tables, sb.context_lens,
                                   sb.query_start, sb.query_len, 0.25)
        with pytest.raises(RuntimeError, match="out must be like q"):
            native.paged_attention(out[:-1], q, pool.data, 0, sb.tables, sb.context_lens, sb.query_start,
                                   sb.query_len, 0.25)
    call()  # the same step, well formed, runs


def test_page_read_refuses_rows_that_are_not_whole_32_bit_words():
    """bench.attention's page read sums a token's rows as 32-bit words: a bf16 pool of one KV head of head_dim 1
    (2 bytes a row) is refused rather than summed short."""
    pool = PagePool(4, 4, 1, 1, 1, dtype=torch.bfloat16)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    with pytest.raises(RuntimeError, match="whole 32-bit words"):
        native.paged_read(pool.data, 0, i32([[0]]), i32([3]), i32([0]), i32([1]))


def test_the_kernel_is_what_runs_by_default_on_the_cpu(tiny_model, monkeypatch):
    monkeypatch.delenv("KVSERVE_ATTENTION", raising=False)
    engine = Engine(tiny_model, EngineConfig(num_pages=32))
    assert engine.attention_backend == "native"
    engine.add_request("k", list(range(10, 30)), _greedy(3))
    engine.step()  # prefill
    with torch.profiler.profile() as prof:
        engine.step()  # a decode step
    names = {e.key for e in prof.key_averages()}
    assert "kvserve_paged::paged_attention" in names
    assert not any("scaled_dot_product" in n for n in names)  # decode rows never go through SDPA


def test_without_a_build_the_engine_falls_back_to_sdpa_and_says_so(tiny_model, monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("KVSERVE_ATTENTION", raising=False)
    monkeypatch.setattr(native, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(native, "_loaded", {})
    with caplog.at_level(logging.ERROR):
        engine = Engine(tiny_model, EngineConfig(num_pages=32))
    assert engine.attention_backend == "sdpa"
    assert "PAGED-ATTENTION KERNEL NOT IN USE" in caplog.text and "make install" in caplog.text
    monkeypatch.setenv("KVSERVE_ATTENTION", "native")
    with pytest.raises(RuntimeError, match="kernel cannot run"):
        attention.select_backend(torch.device("cpu"))
    (seq,) = engine.generate([list(range(10, 30))], _greedy(4))  # the fallback still serves
    assert len(seq.output_ids) == 4


def test_native_and_sdpa_engines_generate_the_same_tokens(tiny_model):
    prompts = [list(range(10, 10 + n)) for n in (5, 17, 33, 48)]
    out = {}
    for backend in ("native", "sdpa"):
        engine = Engine(tiny_model, EngineConfig(num_pages=64, page_size=4, chunk_size=16, attention=backend))
        out[backend] = [s.output_ids for s in engine.generate(prompts, _greedy(12))]
    assert out["native"] == out["sdpa"]


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
def test_xformers_inputs_select_exactly_the_keys_the_reference_attends(h, kvh, d, paged):
    """The CUDA path's inputs, checked on the CPU: its bias materialized densely over its K/V views
    (the pool itself for the paged variant) gives the reference's attention."""
    fmha = pytest.importorskip("xformers.ops").fmha
    pool, batch, q, k, v = random_case(h, kvh, d, seed=1)
    pool.data = pool.data.nan_to_num(0.0)
    batch.fresh = []  # on CUDA the runner puts every chunk in `paged`; here only the pool-reading ones
    sb = batch.paged
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(sb.starts, sb.qlens)])
    ref = BACKENDS["sdpa"](q, k, v, pool, 1, batch)[rows]
    packed = AttentionBatch(batch.slot_pages, batch.slot_offsets, page_size=batch.page_size,
                            paged=SeqBatch(sb.tables, sb.context_lens, sb.query_start, sb.query_len, sb.lens,
                                           [int(x) for x in torch.tensor([0] + sb.qlens[:-1]).cumsum(0)], sb.qlens))
    qx, keys, values, bias = attention.xformers_inputs(fmha, q[rows], pool, 1, packed, paged)
    mask = bias.materialize((len(rows), len(sb) * sb.tables.shape[1] * batch.page_size))
    keys, values = keys[0, : mask.shape[-1]], values[0, : mask.shape[-1]]  # [keys, KVH, G, D]
    scores = torch.einsum("qkgd,skgd->kgqs", qx[0], keys) / d ** 0.5 + mask
    out = torch.einsum("kgqs,skgd->qkgd", scores.softmax(-1), values).reshape(len(rows), h, d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)


def _greedy(n):
    from inference.sequence import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_kernel_and_rope_store_refuse_a_pool_neither_fp32_nor_bf16_nor_int8():
    """An fp16 pool read as fp32 would be garbage (and twice its bytes): refused before anything is read or written."""
    pool, batch, q, k, v = random_case(4, 2, 16, dtype=torch.float16)
    sb = batch.paged
    with pytest.raises(RuntimeError, match="fp32, bf16 or int8"):
        native.paged_attention(torch.empty_like(q), q, pool.data, 0, sb.tables, sb.context_lens, sb.query_start,
                               sb.query_len, 0.25)
    qkv = torch.randn(2, (4 + 2 * 2) * 16)
    with pytest.raises(RuntimeError, match="fp32, bf16 or int8"):
        native.rope_store(qkv, torch.ones(2, 16), torch.ones(2, 16), pool.data, 0, torch.tensor([1, 2]),
                          torch.tensor([0, 0]), 4, 2)


def test_kernel_and_rope_store_refuse_int8_rows_without_their_scale():
    """An int8 pool's row is head_dim codes and a 4-byte scale: a pool of bare codes (rows of head_dim) would have
    its next row's codes read as a scale. Refused, naming the row the pool needs."""
    pool, batch, q, k, v = random_case(4, 2, 16, dtype=torch.int8)
    bare = pool.data[..., :16].contiguous()
    sb = batch.paged
    with pytest.raises(RuntimeError, match=r"head_dim \+ 4"):
        native.paged_attention(torch.empty_like(q), q, bare, 0, sb.tables, sb.context_lens, sb.query_start,
                               sb.query_len, 0.25)
    with pytest.raises(RuntimeError, match="rows of 16"):
        native.rope_store(torch.randn(2, (4 + 2 * 2) * 16), torch.ones(2, 16), torch.ones(2, 16), bare, 0,
                          torch.tensor([1, 2]), torch.tensor([0, 0]), 4, 2)


AVAILABLE = {"native-bf16": native.prefill_bf16_available(), "native-fp32": native.prefill_fp32_available()}
FRESH_KINDS = [k for k in attention.FRESH_KINDS if AVAILABLE.get(k, True)]


@pytest.mark.parametrize("kind,dtype", [(kind, dtype) for kind in FRESH_KINDS
                                        for dtype in (torch.float32, torch.bfloat16, torch.int8)
                                        if dtype != torch.int8 or kind in attention.FP32_KINDS])
def test_a_fresh_prompt_over_a_bf16_pool_attends_in_bf16_only_where_that_is_faster(monkeypatch, kind, dtype):
    """Where a bf16 path measured faster (torch's bf16 SDPA on AMX, the native bf16 kernel on AVX512-BF16), a fresh
    chunk over a bf16 pool attends its K/V as the pool holds them, in bf16: within bf16's rounding of the fp32
    product, not equal to it; where kvserve's fp32 kernel did (an AVX-512 CPU without bf16 dot products), over a
    bf16 or an int8 pool, fp32's numbers within fp32's rounding; elsewhere, and over an fp32 pool, fp32's own."""
    monkeypatch.setattr(attention, "fresh_bf16_kind", lambda: kind)
    monkeypatch.setattr(attention, "fresh_exact_kind", lambda: kind)
    pool, batch, q, k, v = random_case(9, 3, 64, seed=5, dtype=dtype)
    for backend in ("native", "sdpa"):
        out = BACKENDS[backend](q, k, v, pool, 0, AttentionBatch(**{**batch.__dict__, "cache": {}}))
        for s in batch.fresh:
            rows = slice(s.row_start, s.row_start + s.num_rows)
            ref = attention.causal_sdpa(*(x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v)))
            got = out[rows].transpose(0, 1).unsqueeze(0)
            if kind not in attention.FP32_KINDS and dtype == torch.bfloat16:
                assert got.dtype == torch.float32 and not torch.equal(got, ref)
                torch.testing.assert_close(got, ref, rtol=3e-2, atol=3e-2)
            elif kind == "native-fp32" and dtype != torch.float32:
                torch.testing.assert_close(got, ref, rtol=0, atol=5e-6)
            else:
                assert torch.equal(got, ref)


@pytest.mark.parametrize("seconds,kind", [
    ({"fp32": 10.0, "sdpa-bf16": 10.5, "native-bf16": 5.0}, "native-bf16"),  # Zen 4: 10.57 / 11.14 / 5.23 ms
    ({"fp32": 10.0, "sdpa-bf16": 3.3, "native-bf16": 5.0}, "sdpa-bf16"),  # AMX: torch's bf16 SDPA ~3x
    ({"fp32": 10.0, "sdpa-bf16": 9.0, "native-bf16": 8.5}, "fp32"),  # no clear win: bf16's rounding buys nothing
    ({"fp32": 10.0, "sdpa-bf16": 7.0}, "sdpa-bf16"),  # no AVX512-BF16: the native kernel is not timed
    ({"fp32": 10.0}, "fp32"),
    ({"fp32": 10.0, "native-fp32": 4.7, "sdpa-bf16": 24.0}, "native-fp32"),  # Ice Lake: no bf16 dot products
    ({"fp32": 10.0, "native-fp32": 11.0, "sdpa-bf16": 20.0}, "fp32"),  # the exact kinds on time alone
    ({"fp32": 10.0, "native-fp32": 6.0, "sdpa-bf16": 10.5, "native-bf16": 5.0}, "native-fp32"),  # bf16: not 0.8x
    ({"fp32": 10.0, "native-fp32": 6.0, "sdpa-bf16": 10.5, "native-bf16": 4.0}, "native-bf16"),  # ... of the best
])
def test_a_fresh_prompt_takes_the_fastest_exact_path_and_a_bf16_one_only_where_it_clearly_wins(seconds, kind):
    assert attention.fresh_kind_pick(seconds) == kind


@pytest.mark.parametrize("seconds,kind", [
    ({"fp32": 10.0, "native-fp32": 4.7, "sdpa-bf16": 1.0}, "native-fp32"),  # a bf16 kind never serves an int8 pool
    ({"fp32": 3.0, "native-fp32": 4.7, "native-bf16": 1.0}, "fp32"),
    ({"fp32": 3.0, "sdpa-bf16": 1.0}, "fp32"),  # AVX2: torch's fp32 SDPA, the only exact kind
])
def test_an_int8_pools_fresh_prompt_takes_the_fastest_exact_kind(monkeypatch, seconds, kind):
    monkeypatch.setattr(attention, "fresh_timings", lambda: seconds)
    assert attention.fresh_exact_kind() == kind


def test_the_start_time_choice_times_every_path_this_cpu_runs_and_picks_by_the_rule(monkeypatch, caplog):
    seen = {}
    monkeypatch.setattr(attention, "fresh_kind_pick", lambda s: seen.update(s) or "fp32")
    with caplog.at_level(logging.INFO, logger="inference.attention"):
        assert attention.fresh_bf16_kind.__wrapped__() == "fp32"
    assert set(seen) == {"fp32", "sdpa-bf16"} | {kind for kind, here in AVAILABLE.items() if here}
    assert all(t > 0 for t in seen.values())
    assert "a fresh prompt's attention over a bf16 pool runs fp32" in caplog.text

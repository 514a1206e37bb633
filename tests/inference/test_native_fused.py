"""The native fused RMSNorm (inference/native/fused.cpp) against torch's, in fp32 and straight to bf16, and the
model running it on the CPU; SiLU(gate) * up against torch's silu and mul, and where the model runs it; the greedy
rows' argmax against torch's in every build of its loop."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from inference import native

pytestmark = pytest.mark.skipif(not native.fused_available(), reason="the native library is built by make install")


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_is_torchs_in_fp32_and_rounds_to_bf16_like_a_cast(rows):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=gen) * 3, torch.randn(576, generator=gen)
    ref = F.rms_norm(x, (576,), w, 1e-5)
    got = native.rms_norm(x, w, 1e-5, False)
    assert got.dtype == torch.float32 and torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    as_bf16 = native.rms_norm(x, w, 1e-5, True)
    assert as_bf16.dtype == torch.bfloat16
    # the same fp32 value rounded to nearest even; an fp32 ulp apart at a rounding boundary is one bf16 ulp
    assert (as_bf16 == ref.bfloat16()).float().mean() > 0.999
    assert torch.allclose(as_bf16.float(), ref.bfloat16().float(), rtol=2 ** -7, atol=0)


def test_rms_norm_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        native.rms_norm(torch.randn(4, 8).t(), torch.randn(4), 1e-5, False)
    with pytest.raises(RuntimeError, match="w must be fp32"):
        native.rms_norm(torch.randn(4, 8), torch.randn(7), 1e-5, False)


def test_the_cpu_model_norms_natively_into_its_matmuls_dtype(tiny_model, real_model):
    from tests.inference.helpers import make_engine

    fp32 = make_engine(tiny_model).model
    assert fp32._fused_norm and not fp32._norm_bf16
    x = torch.randn(3, tiny_model.config.hidden_size)
    w = fp32.layers[0]["attn_norm"]
    assert torch.allclose(fp32._rms(x, w), F.rms_norm(x, (x.shape[-1],), w, fp32.config.rms_eps), atol=1e-5)
    bf16 = make_engine(real_model, precision="bf16").model
    assert bf16._norm_bf16 and bf16._rms(torch.randn(2, 576), bf16.norm).dtype == torch.bfloat16


def check_silu_mul() -> str:
    """native.silu_mul against torch's silu and mul: within fp32's rounding with AVX-512 (its own exp), torch's
    numbers exactly without; returns which."""
    gen = torch.Generator().manual_seed(3)
    exact = True
    for rows, inter in [(1, 1536), (3, 17), (70, 1000), (500, 1536)]:
        gate_up = torch.randn(rows, 2 * inter, generator=gen) * 6
        gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
        ref = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        got = native.silu_mul(gate_up)
        assert got.shape == (rows, inter) and got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        exact = exact and torch.equal(got, ref)
    nan = torch.ones(2, 64)
    nan[1, 5] = float("nan")
    got = native.silu_mul(nan)
    assert got[1, 5].isnan() and not got[0].isnan().any()
    return "torch" if exact else "own"


def test_silu_mul_is_torchs_within_fp32s_rounding():
    assert check_silu_mul() == ("own" if native.prefill_fp32_available() else "torch")  # both: AVX-512 under the cap


def test_silu_mul_without_avx512_is_torchs_own():
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_ATTN_ISA"} | {"ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", "from tests.inference.test_native_fused import check_silu_mul; "
                          "print(check_silu_mul())"], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "torch"


def test_silu_mul_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        native.silu_mul(torch.randn(8, 4).t())
    with pytest.raises(RuntimeError, match="2 I"):
        native.silu_mul(torch.randn(4, 7))


def test_the_model_fuses_silu_outside_fp32_only(tiny_model, real_model):
    """fp32 is Hugging Face's numbers (torch's silu, bit for bit); w4a8 takes the one pass, in its Python loop as in
    layer.cpp (test_native_layer: the two equal)."""
    from tests.inference.helpers import make_engine

    assert not make_engine(tiny_model).model._fused_silu
    assert make_engine(real_model, precision="w4a8").model._fused_silu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_like_the_model_and_writes_the_pool_like_its_write(tiny_model, dtype):
    """A bf16 pool gets K and V rounded to nearest even, as PagePool.write's cast rounds them."""
    from inference.kv_cache import PagePool
    from inference.model import Llama

    c = tiny_model.config
    llama = Llama(c, tiny_model.weights)
    heads, kvh, d = c.num_heads, c.num_kv_heads, c.head_dim
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, (heads + 2 * kvh) * d, generator=gen)
    positions = torch.tensor([0, 1, 7, 30, 100])
    pages, offsets = torch.tensor([3, 3, 0, 5, 2]), torch.tensor([0, 1, 7, 14, 4])
    cos, sin = llama.cos[positions], llama.sin[positions]
    ref_pool, pool = (PagePool(6, 16, c.num_layers, kvh, d, dtype=dtype) for _ in range(2))
    ref_qk = llama._rope(qkv[:, : (heads + kvh) * d].view(5, heads + kvh, d), cos.unsqueeze(1), sin.unsqueeze(1))
    v = qkv[:, (heads + kvh) * d:].view(5, kvh, d)
    ref_pool.write(1, pages, offsets, ref_qk[:, heads:], v)
    qk = native.rope_store(qkv, cos, sin, pool.data, 1, pages, offsets, heads, kvh)
    assert torch.allclose(qk, ref_qk, atol=1e-6)
    written = pool.data[pages, 1]
    assert written.dtype == dtype and written.abs().sum() > 0
    torch.testing.assert_close(pool.data.float(), ref_pool.data.float(), atol=1e-6,
                               rtol=1e-6 if dtype == torch.float32 else 2 ** -8)  # bf16: at most an ulp apart
    assert pool.data[:, 0].abs().sum() == 0  # another layer untouched


def test_rope_store_writes_an_int8_pool_as_its_write_quantizes(tiny_model):
    """Codes and scale per row, the same rule as PagePool.write (kv_cache.quantize_rows): equal bytes for the same
    rows in (V, as projected), and for K (rotated here and by torch, at most an fp32 ulp apart) values within a step."""
    from inference.kv_cache import PagePool, dequantize_rows, quantize_rows
    from inference.model import Llama

    c = tiny_model.config
    llama = Llama(c, tiny_model.weights)
    heads, kvh, d = c.num_heads, c.num_kv_heads, c.head_dim
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (heads + 2 * kvh) * d, generator=gen) * 3
    qkv[2, (heads + kvh) * d:] = 0  # a V row of zeros: zero bytes, scale included
    qkv[3, (heads + kvh) * d + 1] = float("nan")  # a NaN in V: that row's scale is NaN, its codes 0
    positions = torch.tensor([0, 1, 7, 30, 100])
    pages, offsets = torch.tensor([3, 3, 0, 5, 2]), torch.tensor([0, 1, 7, 14, 4])
    cos, sin = llama.cos[positions], llama.sin[positions]
    ref_pool, pool = (PagePool(6, 16, c.num_layers, kvh, d, dtype=torch.int8) for _ in range(2))
    ref_qk = llama._rope(qkv[:, : (heads + kvh) * d].view(5, heads + kvh, d), cos.unsqueeze(1), sin.unsqueeze(1))
    v = qkv[:, (heads + kvh) * d:].view(5, kvh, d)
    ref_pool.write(1, pages, offsets, ref_qk[:, heads:], v)
    native.rope_store(qkv, cos, sin, pool.data, 1, pages, offsets, heads, kvh)
    k_rows, v_rows = pool.data[pages, 1, 0, offsets], pool.data[pages, 1, 1, offsets]
    assert torch.equal(v_rows, quantize_rows(v)) and torch.equal(v_rows, ref_pool.data[pages, 1, 1, offsets])
    assert v_rows[2].view(torch.uint8).count_nonzero() == 0
    assert dequantize_rows(v_rows[3, 0]).isnan().all() and not dequantize_rows(v_rows[3, 1:]).isnan().any()
    scale = k_rows[..., d:].contiguous().view(torch.float32)
    assert (dequantize_rows(k_rows) - ref_qk[:, heads:]).abs().le(scale * 0.5 + 1e-5).all()
    assert (k_rows == ref_pool.data[pages, 1, 0, offsets]).float().mean() > 0.99
    assert pool.data[:, 0].count_nonzero() == 0  # another layer untouched


@pytest.mark.parametrize("page, offset", [(6, 0), (7, 0), (-1, 0), (0, 16)])
def test_rope_store_refuses_a_slot_that_is_not_a_page_of_the_pool(tiny_model, page, offset):
    """Row 6 of a 6-page pool is its null page (always zero); 7 and -1 are outside; offset 16 is past the page."""
    from inference.kv_cache import PagePool

    c = tiny_model.config
    pool = PagePool(6, 16, c.num_layers, c.num_kv_heads, c.head_dim)
    qkv = torch.randn(2, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
    cos = sin = torch.ones(2, c.head_dim)
    with pytest.raises(RuntimeError, match="not a page of the pool"):
        native.rope_store(qkv, cos, sin, pool.data, 0, torch.tensor([1, page]), torch.tensor([0, offset]),
                          c.num_heads, c.num_kv_heads)
    assert pool.data.abs().sum() == 0  # refused before anything was written


def argmax_cases() -> list[torch.Tensor]:
    """Rows torch.argmax answers: random, many ties, lanes' tails, all -inf, +inf, NaNs (a NaN is the largest)."""
    gen = torch.Generator().manual_seed(7)
    cases = [torch.randn(rows, n, generator=gen) for rows, n in [(1, 1), (3, 7), (5, 17), (2, 300), (32, 49152)]]
    cases += [torch.randint(-3, 3, (rows, n), generator=gen).float() for rows, n in [(4, 9), (6, 1000), (3, 49152)]]
    inf = torch.full((3, 500), float("-inf"))
    inf[1, 333], inf[2, 499] = 1.0, float("inf")
    nan = torch.randn(4, 700, generator=gen)
    nan[0, 5] = nan[0, 600] = nan[2, 699] = nan[3, 3] = float("nan")
    nan[3, 0] = float("inf")
    return cases + [inf, nan, torch.full((2, 5), float("nan"))]


def check_argmax() -> str:
    for x in argmax_cases():
        got = native.argmax_rows(x)
        assert got.dtype == torch.long and torch.equal(got, x.argmax(dim=-1)), (x.shape, got, x.argmax(dim=-1))
    return native.set_isa("")  # the widest build under the cap: argmax's, as attention's (cap.h best_simd)


def test_argmax_rows_is_torchs_argmax():
    check_argmax()


@pytest.mark.parametrize("cap", ["default", "avx2"])
def test_argmax_rows_is_torchs_argmax_in_every_build(cap):
    """The avx2 and generic loops (ATEN_CPU_CAPABILITY caps every native loop) give torch's answers too."""
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_ATTN_ISA"} | {"ATEN_CPU_CAPABILITY": cap}
    out = subprocess.run([sys.executable, "-c", "from tests.inference.test_native_fused import check_argmax; "
                          "print(check_argmax())"], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    avx2 = "avx2" in open("/proc/cpuinfo").read().split()
    assert out.stdout.split()[-1] == ("avx2" if cap == "avx2" and avx2 else "generic")  # the cap took hold


def test_argmax_rows_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        native.argmax_rows(torch.randn(4, 8).t())
    with pytest.raises(RuntimeError, match="1 to 2"):
        native.argmax_rows(torch.randn(4, 0))

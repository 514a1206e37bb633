"""A fresh prompt's causal attention in bf16 dot products (prefill.cpp, kvserve_paged::prefill_attention_bf16) and
in fp32 FMAs (::prefill_attention_fp32) against torch's SDPA: the bf16 kernel within bf16's rounding of the fp32
product (no worse than torch's own bf16 SDPA), the fp32 one within fp32's rounding; causal to the key, each query
head on its own KV head, every length around a 16- and 32-key block, head dims 32, 64 and 128, rows read in place
from a fused projection's output."""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from inference import native

needs_bf16 = pytest.mark.skipif(not native.prefill_bf16_available(),
                                reason="no AVX512-BF16 here (or AVX-512 capped away): the kernel is not used")
needs_avx512 = pytest.mark.skipif(not native.prefill_fp32_available(),
                                  reason="no AVX-512 here (or capped away): the fp32 kernel is not used")
KERNELS = [pytest.param(native.prefill_attention_bf16, marks=needs_bf16, id="bf16"),
           pytest.param(native.prefill_attention_fp32, marks=needs_avx512, id="fp32")]


def case(n, h, kvh, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, heads, d, generator=gen) for heads in (h, kvh, kvh))


def sdpa(q, k, v, dtype=torch.float32):
    qp, kp, vp = (x.transpose(0, 1).unsqueeze(0).to(dtype) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1).float()


def run(op, q, k, v):
    out = torch.full(q.shape, float("nan"))
    op(out, q, k, v, 1 / math.sqrt(q.shape[-1]))
    return out


@needs_bf16
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 33, 130, 500])
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (15, 5, 64), (6, 1, 64)])
def test_the_bf16_kernel_matches_sdpa_within_bf16s_rounding(n, h, kvh, d):
    q, k, v = case(n, h, kvh, d, seed=n + d)
    got, ref = run(native.prefill_attention_bf16, q, k, v), sdpa(q, k, v)
    assert torch.isfinite(got).all()  # every row written
    err, torch_bf16_err = (got - ref).abs().max().item(), (sdpa(q, k, v, torch.bfloat16) - ref).abs().max().item()
    assert err < 2e-2 and err <= 1.5 * torch_bf16_err + 2e-3, (err, torch_bf16_err)


@needs_avx512
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 32, 33, 130, 500])
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (15, 5, 64), (6, 1, 64)])
def test_the_fp32_kernel_matches_sdpa_within_fp32s_rounding(n, h, kvh, d):
    q, k, v = case(n, h, kvh, d, seed=n + d)
    got, ref = run(native.prefill_attention_fp32, q, k, v), sdpa(q, k, v)
    assert torch.isfinite(got).all()  # every row written
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-6)  # bf16's rounding would be ~1e-2


@pytest.mark.parametrize("op", KERNELS)
def test_rows_are_read_in_place_from_a_fused_projection(op):
    """q, k and v as views into one [T, (H + 2 KVH) D] output (as the model's qkv projection hands them over): the
    same numbers as from contiguous copies."""
    qkv = torch.randn(70, (9 + 2 * 3) * 64, generator=torch.Generator().manual_seed(4))
    q, k, v = qkv[:, :576].view(70, 9, 64), qkv[:, 576:768].view(70, 3, 64), qkv[:, 768:].view(70, 3, 64)
    assert not q.is_contiguous()
    assert torch.equal(run(op, q, k, v), run(op, q.contiguous(), k.contiguous(), v.contiguous()))


@pytest.mark.parametrize("op", KERNELS)
def test_a_later_key_changes_no_earlier_query_and_every_later_one(op):
    q, k, v = case(70, 9, 3, 64, seed=1)
    before = run(op, q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[40] += 3.0
    v2[40] -= 5.0
    after = run(op, q, k2, v2)
    assert torch.equal(after[:40], before[:40])
    assert (after[40:] - before[40:]).abs().amax(dim=(1, 2)).min() > 1e-3


@pytest.mark.parametrize("op", KERNELS)
def test_each_query_head_reads_its_own_kv_head(op):
    q, k, v = case(40, 6, 2, 64, seed=2)
    before = run(op, q, k, v)
    v2 = v.clone()
    v2[:, 1] += 4.0  # KV head 1 serves query heads 3, 4, 5
    after = run(op, q, k, v2)
    assert torch.equal(after[:, :3], before[:, :3])
    torch.testing.assert_close(after[:, 3:], before[:, 3:] + 4.0, rtol=0, atol=5e-2)


@pytest.mark.parametrize("op", KERNELS)
def test_bad_shapes_and_head_dims_are_refused(op):
    q, k, v = case(8, 4, 2, 64)
    with pytest.raises(RuntimeError, match="multiple of KVH"):
        op(torch.empty_like(q), q, k[:, :1].repeat(1, 3, 1).contiguous(), v[:, :1].repeat(1, 3, 1).contiguous(),
           0.125)
    with pytest.raises(RuntimeError, match="fp32 CPU tensors"):
        op(torch.empty_like(q), q.bfloat16(), k, v, 0.125)
    with pytest.raises(RuntimeError, match="heads contiguous"):
        op(torch.empty_like(q), q.transpose(1, 2).contiguous().transpose(1, 2), k, v, 0.125)
    with pytest.raises(RuntimeError, match="out must be contiguous"):
        op(torch.empty(8, 8, 64)[:, :4], q, k, v, 0.125)
    q80, k80, v80 = case(8, 4, 2, 80)
    with pytest.raises(RuntimeError, match="head_dim 32, 64 or 128"):
        op(torch.empty_like(q80), q80, k80, v80, 0.1)


@pytest.mark.parametrize("name", ["prefill_bf16_available", "prefill_fp32_available"])
def test_torchs_avx2_cap_turns_them_off(name):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    code = f"from inference import native; print('available', native.{name}())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "available False" in proc.stdout

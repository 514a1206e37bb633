"""A fresh prompt's causal attention in bf16 dot products (prefill.cpp, kvserve_paged::prefill_attention_bf16)
against torch's SDPA: within bf16's rounding of the fp32 product (no worse than torch's own bf16 SDPA), causal to
the key, each query head on its own KV head, every length around a 16-key block, head dims 32, 64 and 128."""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from inference import native

pytestmark = pytest.mark.skipif(not native.prefill_bf16_available(),
                                reason="no AVX512-BF16 here (or AVX-512 capped away): the kernel is not used")


def case(n, h, kvh, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, heads, d, generator=gen) for heads in (h, kvh, kvh))


def sdpa(q, k, v, dtype=torch.float32):
    qp, kp, vp = (x.transpose(0, 1).unsqueeze(0).to(dtype) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1).float()


def kernel(q, k, v):
    out = torch.full_like(q, float("nan"))
    native.prefill_attention_bf16(out, q, k, v, 1 / math.sqrt(q.shape[-1]))
    return out


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 33, 130, 500])
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (15, 5, 64), (6, 1, 64)])
def test_it_matches_sdpa_within_bf16s_rounding(n, h, kvh, d):
    q, k, v = case(n, h, kvh, d, seed=n + d)
    got, ref = kernel(q, k, v), sdpa(q, k, v)
    assert torch.isfinite(got).all()  # every row written
    err, torch_bf16_err = (got - ref).abs().max().item(), (sdpa(q, k, v, torch.bfloat16) - ref).abs().max().item()
    assert err < 2e-2 and err <= 1.5 * torch_bf16_err + 2e-3, (err, torch_bf16_err)


def test_a_later_key_changes_no_earlier_query_and_every_later_one():
    q, k, v = case(70, 9, 3, 64, seed=1)
    before = kernel(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[40] += 3.0
    v2[40] -= 5.0
    after = kernel(q, k2, v2)
    assert torch.equal(after[:40], before[:40])
    assert (after[40:] - before[40:]).abs().amax(dim=(1, 2)).min() > 1e-3


def test_each_query_head_reads_its_own_kv_head():
    q, k, v = case(40, 6, 2, 64, seed=2)
    before = kernel(q, k, v)
    v2 = v.clone()
    v2[:, 1] += 4.0  # KV head 1 serves query heads 3, 4, 5
    after = kernel(q, k, v2)
    assert torch.equal(after[:, :3], before[:, :3])
    torch.testing.assert_close(after[:, 3:], before[:, 3:] + 4.0, rtol=0, atol=5e-2)


def test_bad_shapes_and_head_dims_are_refused():
    q, k, v = case(8, 4, 2, 64)
    with pytest.raises(RuntimeError, match="multiple of KVH"):
        native.prefill_attention_bf16(torch.empty_like(q), q, k[:, :1].repeat(1, 3, 1).contiguous(),
                                      v[:, :1].repeat(1, 3, 1).contiguous(), 0.125)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        native.prefill_attention_bf16(torch.empty_like(q), q.bfloat16(), k, v, 0.125)
    q80, k80, v80 = case(8, 4, 2, 80)
    with pytest.raises(RuntimeError, match="head_dim 32, 64 or 128"):
        native.prefill_attention_bf16(torch.empty_like(q80), q80, k80, v80, 0.1)


def test_torchs_avx2_cap_turns_it_off():
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    code = "from inference import native; print('available', native.prefill_bf16_available())"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "available False" in proc.stdout

"""The native fused RMSNorm (inference/native/fused.cpp) against torch's, in fp32 and straight to bf16, and the
model running it on the CPU."""
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

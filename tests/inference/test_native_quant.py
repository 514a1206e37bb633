"""w4a8's integer matmul (inference/native/quant.cpp), both builds of its loop, against the same sums written in
torch: activations rounded to int8 per 32, exact integer dot products per block, fp32 scales; and what it refuses."""
import pytest
import torch

from inference import native
from inference.precision import CONTRACTS, GROUP, group8_quantize, group_quantize

pytestmark = pytest.mark.skipif(not native.fused_available(), reason="the native library is built by make install")
BUILDS = ["generic", "avx2", "avx512"]
ISAS = BUILDS[: BUILDS.index(native.quant_isa("best")) + 1]


@pytest.fixture(params=ISAS)
def isa(request):
    native.quant_isa(request.param)
    yield request.param
    native.quant_isa("best")


def reference(x, codes, d, m):
    """sum_b d * s * (codes . qa) + m * s * sum(qa), with qa = round(x / s), s = max|x| / 127 per block of 32."""
    r, k = x.shape
    xb = x.reshape(r, k // GROUP, GROUP).double()
    s = xb.abs().amax(-1) / 127
    qa = torch.where(s[..., None] > 0, torch.round(xb / s.clamp_min(1e-300)[..., None]), torch.zeros_like(xb))
    n = codes.shape[0]
    dots = torch.einsum("rbi,nbi->rnb", qa, codes.reshape(n, k // GROUP, GROUP).double())  # exact in float64
    out = (dots * d.double()[None] * s[:, None]).sum(-1)
    if m is not None:
        out += (m.double()[None] * (s * qa.sum(-1))[:, None]).sum(-1)
    return out.float()


def nibbles_of(q):
    """A GGUF Q4 block's byte order: byte j holds code j in its low nibble and code j + 16 in its high one."""
    n, k = q.shape
    g = q.reshape(n, k // GROUP, GROUP)
    return (g[..., :16] | (g[..., 16:] << 4)).reshape(n, k // 2).contiguous()


def q4(n, k, gen, zero_point: bool):
    quant = group_quantize(torch.randn(n, k, generator=gen))
    mins = quant.zero - 8 * quant.scale if zero_point else -8 * quant.scale  # Q4_1, or Q4_0's m = -8d
    return quant.q, nibbles_of(quant.q), quant.scale.contiguous(), mins.contiguous()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_coded_linear_is_the_blockwise_integer_sum(isa, rows, kind):
    gen = torch.Generator().manual_seed(rows)
    n, k = 70, 96
    x = torch.randn(rows, k, generator=gen) * 2
    x[0, :GROUP] = 0  # a block of zeros: scale 0, codes 0
    if kind == "Q8_0":
        quant = group8_quantize(torch.randn(n, k, generator=gen))
        got = native.w8a8_linear(x, quant.q, quant.scale)
        want = reference(x, quant.q.float(), quant.scale, None)
    else:
        codes, nibbles, d, m = q4(n, k, gen, zero_point=kind == "Q4_1")
        got = native.w4a8_linear(x, nibbles, d, m)
        want = reference(x, codes.float(), d, m)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4 * want.abs().max().item()), (got - want).abs().max()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_coded_linear_keeps_the_kernel_contract_against_the_dequantized_weights(isa, kind):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 576, generator=gen)
    w = torch.randn(1536, 576, generator=gen) / 24
    if kind == "Q8_0":
        quant = group8_quantize(w)
        got = native.w8a8_linear(x, quant.q, quant.scale)
    else:
        quant = group_quantize(w)
        got = native.w4a8_linear(x, nibbles_of(quant.q), quant.scale, (quant.zero - 8 * quant.scale).contiguous())
    ref = x @ quant.dequantize().T
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < CONTRACTS["w4a8"].max_kernel_rel_err / 2, err


def test_the_low_nibbles_are_a_blocks_first_sixteen_weights():
    """A GGUF Q4 block's byte j holds weight j (low nibble) and j + 16 (high): a one-hot activation reads each."""
    nibbles = torch.tensor([[0x21] * 16], dtype=torch.uint8)  # weights 0..15 code 1, weights 16..31 code 2
    d, m = torch.ones(1, 1), torch.zeros(1, 1)
    for j, code in ((0, 1.0), (15, 1.0), (16, 2.0), (31, 2.0)):
        x = torch.zeros(1, 32)
        x[0, j] = 1.0
        assert native.w4a8_linear(x, nibbles, d, m).item() == code, j


def test_coded_linear_refuses_what_it_cannot_read():
    x = torch.randn(2, 64)
    nibbles, d = torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 2)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        native.w4a8_linear(torch.randn(2, 48), torch.zeros(8, 24, dtype=torch.uint8), torch.ones(8, 1), torch.ones(8, 1))
    with pytest.raises(RuntimeError, match="weight codes must be"):
        native.w4a8_linear(x, torch.zeros(8, 64, dtype=torch.uint8), d, d)  # a Q8 row's width
    with pytest.raises(RuntimeError, match="weight codes must be"):
        native.w8a8_linear(x, torch.zeros(8, 64, dtype=torch.uint8), d)  # unsigned codes for Q8_0
    with pytest.raises(RuntimeError, match="scales must be"):
        native.w4a8_linear(x, nibbles, torch.ones(8, 3), d)
    with pytest.raises(RuntimeError, match="mins must be"):
        native.w4a8_linear(x, nibbles, d, torch.ones(7, 2))
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        native.w4a8_linear(x.t().contiguous().t(), nibbles, d, d)
    with pytest.raises(RuntimeError, match="not avx512, avx2, generic"):
        native.quant_isa("avx1024")


# ---- the interleaved layouts (x16: AVX-512 VNNI, x8: AVX2): the same sums from codes repacked W outputs at a time --
LAYOUTS = [w for w, isa in ((16, "avx512"), (8, "avx2")) if isa in ISAS]  # ISAS: the builds this CPU runs


@pytest.fixture(params=LAYOUTS, ids=lambda w: f"x{w}")
def width(request):
    """Packs (and so multiplies) the x16 or x8 layout; the widest this CPU runs unless forced narrower."""
    native.quant_isa("avx512" if request.param == 16 else "avx2")
    yield request.param
    native.quant_isa("best")


def interleaved(quant, width):
    from inference.precision import _coded_weight

    packed = _coded_weight(quant.dequantize(), quant, lambda w: None, 1 << 30)
    assert packed.interleaved == width, "the quantizers' fp16 scales and a width of W outputs take the layout"
    return packed


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_interleaved_layouts_are_the_blockwise_integer_sum(width, rows, kind):
    gen = torch.Generator().manual_seed(rows)
    n, k = 48, 160  # 3 groups of 16 outputs (6 of 8), 5 blocks
    x = torch.randn(rows, k, generator=gen) * 2
    x[0, :GROUP] = 0
    if kind == "Q8_0":
        quant = group8_quantize(torch.randn(n, k, generator=gen))
        quant.q[0, :GROUP] = torch.tensor([-127, 127] * 16, dtype=torch.int8)  # the extremes: no int16 sum overflows
        codes, m = quant.q.float(), None
    else:
        quant = group_quantize(torch.randn(n, k, generator=gen))
        if kind == "Q4_0":  # w = d * (q - 8): GroupQuant's zero (m + 8d) is 0
            quant = type(quant)(quant.q, quant.scale, torch.zeros_like(quant.scale))
        quant.q[0, :GROUP] = 15
        codes, m = quant.q.float(), quant.zero - 8 * quant.scale
    x[1 % rows, :GROUP] = 127.0  # activations at their extreme too (one block of the second row)
    packed = interleaved(quant, width)
    got = native.interleaved_linear(x, packed.codes, packed.scale, packed.mins)
    want = reference(x, codes, quant.scale, m)
    assert got.shape == (rows, n)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4 * want.abs().max().item()), (got - want).abs().max()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_interleaved_layouts_sum_what_the_files_layout_sums(width, kind):
    """The same activation codes, the same integer dot products: the layouts differ only by fp32 rounding."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32, 576, generator=gen)
    w = torch.randn(1536, 576, generator=gen) / 24
    quant = group8_quantize(w) if kind == "Q8_0" else group_quantize(w)
    packed = interleaved(quant, width)
    got = native.interleaved_linear(x, packed.codes, packed.scale, packed.mins)
    if kind == "Q8_0":
        want = native.w8a8_linear(x, quant.q, quant.scale)
    else:
        want = native.w4a8_linear(x, nibbles_of(quant.q), quant.scale, (quant.zero - 8 * quant.scale).contiguous())
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_an_interleaved_layout_is_taken_only_where_it_is_exact():
    """Scales that are not fp16 values (a file's always are) or a width that is no multiple of the group: the file's
    layout; the generic build: the file's layout."""
    from inference.precision import _coded_weight

    gen = torch.Generator().manual_seed(5)
    quant = group_quantize(torch.randn(32, 64, generator=gen))
    odd = type(quant)(quant.q, quant.scale * (1 + 1e-6), quant.zero)
    assert not _coded_weight(odd.dequantize(), odd, lambda w: None, 4).interleaved
    narrow = type(quant)(quant.q[:20], quant.scale[:20], quant.zero[:20])
    assert not _coded_weight(narrow.dequantize(), narrow, lambda w: None, 4).interleaved
    assert _coded_weight(quant.dequantize(), quant, lambda w: None, 4).interleaved == (LAYOUTS or [0])[0]
    native.quant_isa("generic")
    try:
        assert not _coded_weight(quant.dequantize(), quant, lambda w: None, 4).interleaved
    finally:
        native.quant_isa("best")


def test_interleaved_linear_refuses_what_it_cannot_read(width):
    x = torch.randn(2, 64)
    codes, half = torch.zeros(2, 2, 16 * width, dtype=torch.uint8), torch.ones(2, 2, width, dtype=torch.float16)
    assert native.interleaved_linear(x, codes, half, half).shape == (2, 2 * width)
    with pytest.raises(RuntimeError, match="codes must be"):
        native.interleaved_linear(x, torch.zeros(2, 2, 8 * width, dtype=torch.uint8), half, half)
    with pytest.raises(RuntimeError, match="codes must be"):
        native.interleaved_linear(torch.randn(2, 96), codes, half, half)  # 3 blocks against 2
    with pytest.raises(RuntimeError, match="scales must be"):
        native.interleaved_linear(x, codes, torch.ones(2, 2, 4, dtype=torch.float16), half)
    with pytest.raises(RuntimeError, match="scales and mins must be"):
        native.interleaved_linear(x, codes, half.float(), half)
    with pytest.raises(RuntimeError, match="scales and mins must be"):
        native.interleaved_linear(x, codes, half, half[:1])
    q8 = torch.zeros(2, 2, 32 * width, dtype=torch.uint8 if width == 8 else torch.int8)  # the other Q8 code type
    with pytest.raises(RuntimeError, match="codes must be"):
        native.interleaved_linear(x, q8, half, half)

"""The matmul precision a Llama runs (fp32, bf16, fp16w, int4w, w4a8), each mode's accuracy contract against fp32, and
the `auto` choice: every candidate timed once at engine start on the model's own projection shapes."""
import logging
import statistics
import time
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from inference import native
from inference.arith import cdiv
from inference.memory import bound_gemm_caches

log = logging.getLogger(__name__)
bound_gemm_caches()  # before the first prepacked weight: a primitive per step shape otherwise stays for good

MODES = ("fp32", "bf16", "fp16w", "int4w", "w4a8")
GROUPED = ("int4w", "w4a8")  # modes that multiply the model file's own blocks (a GGUF with Q4_0 / Q4_1 projections)
GROUP = 32  # weights per scale in a GGUF Q4_0 / Q4_1 / Q8_0 block, and the coded modes' group size
SETTING_CHOICES = ("auto",) + MODES  # KVSERVE_PRECISION (inference/settings.py)
REDUCED_KV = ("bf16", "int4w", "w4a8")  # modes whose matmuls take reduced activations: their KV pool is bf16 (auto)


@dataclass(frozen=True)
class Contract:
    """What a mode must keep against fp32 on the real model (tests/inference/test_precision.py proves it):
    teacher-forced over fp32's greedy continuation, the share of positions whose argmax is fp32's, and the
    largest |logit - fp32 logit|. `max_kernel_rel_err` is the start-time check `auto` runs on each candidate's
    matmul (|out - fp32 out| / |fp32 out|, Frobenius): it catches an ISA the VM advertises but computes wrong."""
    min_argmax_agreement: float
    max_abs_logit_diff: float
    max_kernel_rel_err: float


# Justification. fp32 is the reference itself (the HF-equivalence tests bound it to 2e-3 against transformers). bf16
# keeps an 8-bit mantissa (relative rounding 2^-9 ~ 2e-3) on weights and on the activations entering each matmul, and on
# the K/V it keeps (a bf16 pool, kv_dtype_for: on its own it moves logits by 0.17 and no argmax); accumulation is fp32
# and the residual stream, norms, RoPE, softmax and logits stay fp32, so the error does not compound through the
# residual. Over SmolLM2's 30 layers that moves logits (magnitude ~20) by under 1 (measured on test_precision's 8
# prompts x 16 tokens, read back through the pool: max 0.65) and flips the argmax only where fp32's top two are
# near-tied (measured agreement 0.969, 124/128; 0.953 and 0.65 where, on an AMX CPU, a prompt's own attention runs in
# bf16 over that pool: inference.attention.fresh_bf16_kind); 0.9 / 3.0 leave room for other prompts and oneDNN builds
# and still fail a wrong kernel (int8-cast weights: agreement ~0, logits off by tens). The kernel bound: one bf16 matmul
# on random data errs ~3e-3 relative; 2e-2 is 6x that, while garbage is ~1. fp16w stores weights in fp16 (10-bit
# mantissa) and multiplies in fp32: ~8x tighter than bf16 (measured: max 0.04, agreement 0.992 - one near-tie of 128),
# so its bounds are tighter (0.95 / 0.5). int4w multiplies the file's own 4-bit codes (the fp32 reference is those same
# codes dequantized), with bf16 activations and scales: bf16's error sources and no more (measured: see test_precision),
# so bf16's bounds. w4a8 multiplies the same codes (and the file's Q8_0 lm_head) with activations rounded to int8 per 32
# (relative rounding up to 2^-8 of the block's largest |x|, the rule of llama.cpp's own Q4_1 x Q8_1 kernels): per matmul
# ~5e-3 relative on random data, about twice bf16's, and like bf16 the residual stream, norms, softmax and logits stay
# fp32 (measured: see test_precision), so bf16's bounds; its kernel bound is bf16's too (garbage is ~1).
CONTRACTS = {
    "fp32": Contract(min_argmax_agreement=1.0, max_abs_logit_diff=1e-3, max_kernel_rel_err=1e-5),
    "bf16": Contract(min_argmax_agreement=0.9, max_abs_logit_diff=3.0, max_kernel_rel_err=2e-2),
    "fp16w": Contract(min_argmax_agreement=0.95, max_abs_logit_diff=0.5, max_kernel_rel_err=3e-3),
    "int4w": Contract(min_argmax_agreement=0.9, max_abs_logit_diff=3.0, max_kernel_rel_err=2e-2),
    "w4a8": Contract(min_argmax_agreement=0.9, max_abs_logit_diff=3.0, max_kernel_rel_err=2e-2),
}


@dataclass(frozen=True)
class Agreement:
    argmax_agreement: float
    max_abs_logit_diff: float


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor) -> Agreement:
    """Teacher-forced logits [T, vocab] of fp32 and of a candidate over the same tokens."""
    if reference.shape != candidate.shape:
        raise ValueError(f"logits {list(candidate.shape)} against fp32's {list(reference.shape)}")
    ref, cand = reference.float(), candidate.float()
    agree = (ref.argmax(-1) == cand.argmax(-1)).float().mean().item()
    return Agreement(agree, (ref - cand).abs().max().item())


def precision_contract_holds(mode: str, agreement: Agreement, contracts: dict | None = None) -> bool:
    c = (contracts or CONTRACTS)[mode]
    return (agreement.argmax_agreement >= c.min_argmax_agreement
            and agreement.max_abs_logit_diff <= c.max_abs_logit_diff)


# ---- the matmuls ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Gemm:
    """How a mode stores a linear weight [out, in] (`pack`, once) and multiplies fp32 activations by it
    (`linear`: fp32 in, fp32 out whatever the weight's storage). `pack_group(w, quant)`, where a mode has it,
    packs a weight the model file holds as group-wise codes (GroupQuant) from those codes."""
    mode: str
    kernel: str  # onednn | blas (fp32), onednn-bf16 | blas-bf16, blas-fp16w, int4pack+onednn-bf16
    pack: object
    linear: object
    pack_group: object = None
    activations: torch.dtype = torch.float32  # what `linear` multiplies in: a norm may hand it that dtype already
    head_quantize: object = None  # auto's timing: how a file would hold the lm_head for `pack_group` (else dense)


@dataclass(frozen=True)
class GroupQuant:
    """A weight [N, K] as 4-bit codes in groups of GROUP along K: w = (q - 8) * scale + zero, the convention of
    torch's int4pack kernels. A GGUF Q4_1 block (w = d*q + m) is scale d, zero m + 8d; Q4_0 (w = d*(q - 8)) is
    scale d, zero 0 (inference.loader.gguf_group_weights)."""
    q: torch.Tensor  # uint8 [N, K], 0..15
    scale: torch.Tensor  # fp32 [N, K / GROUP]
    zero: torch.Tensor  # fp32 [N, K / GROUP]

    def dequantize(self) -> torch.Tensor:
        expand = lambda t: t.repeat_interleave(GROUP, dim=1)  # noqa: E731
        return (self.q.float() - 8) * expand(self.scale) + expand(self.zero)

    @classmethod
    def cat(cls, parts: list["GroupQuant"]) -> "GroupQuant":
        """Stacked along N, as the fused qkv and gate_up weights are."""
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")))


def group_quantize(w: torch.Tensor) -> GroupQuant:
    """Min/max 4-bit codes of an fp32 weight (Q4_1's rule): for auto's timing on random weights and for tests;
    a served model's codes come from its file, never from here."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1).half().float(), g.amax(-1)  # d and m in fp16, as a file holds them
    scale = ((hi - lo) / 15).clamp_min(1e-4).half().float()
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    return GroupQuant(q, scale, lo + 8 * scale)


@dataclass(frozen=True)
class Group8Quant:
    """A weight [N, K] as int8 codes in groups of GROUP along K: w = q * scale (a GGUF Q8_0 block, as the default
    model's tied embedding / lm_head is stored; inference.loader.gguf_group8_weights)."""
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # fp32 [N, K / GROUP]

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.repeat_interleave(GROUP, dim=1)

    @classmethod
    def cat(cls, parts: list["Group8Quant"]) -> "Group8Quant":
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale")))


def group8_quantize(w: torch.Tensor) -> Group8Quant:
    """Absmax int8 codes of an fp32 weight (Q8_0's rule): for auto's timing and tests only."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    scale = (g.abs().amax(-1) / 127).clamp_min(1e-4).half().float()  # d in fp16, as a file holds it
    return Group8Quant((g / scale[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(n, k), scale)


@dataclass(frozen=True)
class Int4Weight:
    """int4w's packed weight: the codes for rows <= max_rows, bf16 oneDNN-packed for more (prefill, big batches)."""
    codes: torch.Tensor  # torch's int4pack layout
    scales_zeros: torch.Tensor  # bf16 [K / GROUP, N, 2]
    dense: torch.Tensor
    max_rows: int


def _int4_weight(w: torch.Tensor, quant: GroupQuant, dense_pack, max_rows: int) -> Int4Weight:
    if quant.q.shape != w.shape:
        raise ValueError(f"codes {list(quant.q.shape)} for a weight {list(w.shape)}")
    codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(quant.q.to(torch.int32).contiguous(), 2)
    sz = torch.stack([quant.scale.t(), quant.zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return Int4Weight(codes, sz, dense_pack(w), max_rows)


def _int4_pack(dense_pack):
    return lambda w, quant: _int4_weight(w, quant, dense_pack, int4_max_rows())


def _int4_linear(dense_linear):
    def linear(x: torch.Tensor, w) -> torch.Tensor:
        if isinstance(w, Int4Weight):
            if x.shape[0] > w.max_rows:
                return dense_linear(x, w.dense)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w.codes, GROUP,
                                                              w.scales_zeros).float()
        return dense_linear(x, w)  # a weight the file does not hold as 4-bit groups (the Q8_0 lm_head)
    return linear


@dataclass(frozen=True)
class CodedWeight:
    """w4a8's packed weight: the file's blocks for rows <= max_rows (inference/native/quant.cpp), the dense
    fallback's packed copy above (prefill, big batches; None where the codes take every row count). In the file's
    layout (`interleaved` False): Q4 nibbles uint8 [N, K/2] (the GGUF's byte order), w = scale * code + mins, fp32
    scales; Q8_0 codes int8 [N, K], w = scale * code, mins None. In an interleaved layout, W = 16 (x16, AVX-512 VNNI)
    or 8 (x8, AVX2) outputs' codes per block side by side, [N/W, K/32, 16 W] uint8 (Q4) or [N/W, K/32, 32 W] (Q8_0:
    uint8 code + 128 with mins -128 * scale for x16, the file's int8 with mins 0 for x8), scales and mins the
    file's fp16 [N/W, K/32, W]."""
    codes: torch.Tensor
    scale: torch.Tensor
    mins: torch.Tensor | None
    dense: object
    max_rows: int

    @property
    def interleaved(self) -> int:
        """W, the outputs per group of an interleaved layout; 0 for the file's layout."""
        return self.scale.shape[-1] if self.codes.dim() == 3 else 0


def _coded_weight(w: torch.Tensor, quant, dense_pack, max_rows: int) -> CodedWeight:
    if quant.q.shape != w.shape:
        raise ValueError(f"codes {list(quant.q.shape)} for a weight {list(w.shape)}")
    n, k = w.shape
    scale = quant.scale.float().contiguous()
    q8 = isinstance(quant, Group8Quant)
    mins = torch.zeros_like(scale) if q8 else (quant.zero - 8 * quant.scale).float().contiguous()  # zero is m + 8d
    dense = dense_pack(w) if max_rows < UNBOUNDED_ROWS else None  # codes at every row count: no dense copy
    if packed := _interleaved_layout(quant.q, scale, mins, q8):
        return CodedWeight(*packed, dense, max_rows)
    if q8:
        return CodedWeight(quant.q.contiguous(), scale, None, dense, max_rows)
    g = quant.q.reshape(n, k // GROUP, GROUP)
    nibbles = (g[..., : GROUP // 2] | (g[..., GROUP // 2:] << 4)).reshape(n, k // 2).contiguous()
    return CodedWeight(nibbles, scale, mins, dense, max_rows)


INTERLEAVED = {"avx512": 16, "avx2": 8}  # quant_isa -> outputs per group of the layout its loop reads


def _interleaved_layout(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, q8: bool):
    """(codes, scale, mins) in quant.cpp's x16 (AVX-512 VNNI) or x8 (AVX2) layout, or None where neither applies:
    quant_isa is generic, N is not a multiple of the group, or a scale or min is not an fp16 value (a file's are;
    the layout keeps them in fp16, so it is exact or not used). Only the codes move: output o of group g, block b,
    chunk c, byte j of four: Q4 low nibble code(W g + o, 32 b + 8 c + j), high nibble the code 4 further; Q8
    code(W g + o, 32 b + 4 c + j)."""
    n, k = q.shape
    width = INTERLEAVED.get(native.quant_isa())
    if width is None or n % width:
        return None
    if q8 and width == 16:  # vpdpbusd multiplies unsigned codes: q + 128, and 128 * sum(activations) comes off
        mins = -128 * scale
    half = [t.half() for t in (scale, mins)]
    if not all(torch.equal(h.float(), t) for h, t in zip(half, (scale, mins))):
        return None
    groups, blocks = n // width, k // GROUP
    if q8:
        codes = (q.to(torch.int16) + 128).to(torch.uint8) if width == 16 else q.to(torch.int8)
        codes = codes.reshape(groups, width, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    else:
        v = q.reshape(groups, width, blocks, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)
        codes = v[..., 0, :] | (v[..., 1, :] << 4)
    per_block = lambda t: t.reshape(groups, width, blocks).permute(0, 2, 1).contiguous()  # noqa: E731
    return codes.reshape(groups, blocks, -1).contiguous(), *(per_block(h) for h in half)


def _coded_linear(dense_linear):
    def linear(x: torch.Tensor, w) -> torch.Tensor:
        if isinstance(w, CodedWeight):
            if x.shape[0] > w.max_rows:
                return dense_linear(x, w.dense)
            x = x.float().contiguous()  # a fused norm may hand over bf16 when the dense path is bf16
            if w.interleaved:
                return native.interleaved_linear(x, w.codes, w.scale, w.mins)
            if w.mins is None:
                return native.w8a8_linear(x, w.codes, w.scale)
            return native.w4a8_linear(x, w.codes, w.scale, w.mins)
        return dense_linear(x, w)  # a weight the file holds neither as Q4 nor as Q8_0 blocks
    return linear


@lru_cache(maxsize=1)
def onednn_bf16_prepacks() -> bool:
    """Whether oneDNN prepacks bf16 weights on this CPU (it refuses without AVX512BW/VL/DQ or AVX-NE-CONVERT:
    an AVX2-only EPYC); where it does not, bf16 runs as plain F.linear in bf16."""
    try:
        _onednn_pack(torch.zeros(16, 32, dtype=torch.bfloat16))
        return True
    except RuntimeError:
        return False


def _onednn_pack(w):
    return torch.ops.mkldnn._reorder_linear_weight(w, 32)


def _onednn_linear(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def gemm_for(mode: str, device: torch.device, fp32_kernel: str) -> Gemm:
    """`fp32_kernel`: what inference.model.choose_gemm picked for fp32 (onednn unless KVSERVE_CPU_GEMM=blas);
    bf16 follows it: oneDNN's prepacked bf16 inner product (fastest measured here: bench/RESULTS.md) or else
    plain F.linear in bf16."""
    if mode == "fp32":
        if fp32_kernel == "onednn":
            return Gemm(mode, "onednn", _onednn_pack, _onednn_linear)
        return Gemm(mode, "blas", lambda w: w, F.linear)
    if mode == "bf16":
        bf = torch.bfloat16
        if device.type == "cpu" and fp32_kernel == "onednn" and onednn_bf16_prepacks():
            return Gemm(mode, "onednn-bf16", lambda w: _onednn_pack(w.to(bf)),
                        lambda x, w: _onednn_linear(x.to(bf), w).float(), activations=bf)
        return Gemm(mode, "blas-bf16", lambda w: w.to(bf), lambda x, w: F.linear(x.to(bf), w).float(), activations=bf)
    if mode == "fp16w":
        return Gemm(mode, "blas-fp16w", lambda w: w.to(torch.float16), lambda x, w: F.linear(x, w.float()))
    if mode == "int4w":
        if device.type != "cpu":
            raise ValueError("precision int4w runs on the CPU only (torch's int4pack CPU kernels); use bf16 on "
                             f"{device.type}")
        dense = gemm_for("bf16", device, fp32_kernel)
        return Gemm(mode, f"int4pack+{dense.kernel}", dense.pack, _int4_linear(dense.linear), _int4_pack(dense.pack),
                    activations=torch.bfloat16)
    if mode == "w4a8":
        if device.type != "cpu":
            raise ValueError(f"precision w4a8 runs on the CPU only (inference/native/quant.cpp); use bf16 on {device.type}")
        if not native.fused_available():
            raise ValueError(f"precision w4a8 needs the native kernels: {native.load_error()}")
        dense = _w4a8_dense(device, fp32_kernel)
        return Gemm(mode, f"w4a8-{native.quant_isa()}+{dense.kernel}", dense.pack, _coded_linear(dense.linear),
                    lambda w, quant: _coded_weight(w, quant, dense.pack, w4a8_max_rows(
                        tuple(w.shape), isinstance(quant, Group8Quant))), head_quantize=group8_quantize)
    raise ValueError(f"precision {mode!r}: one of {MODES}")


@lru_cache(maxsize=1)
def int4_max_rows() -> int:
    """The most rows int4w multiplies with its 4-bit codes: KVSERVE_INT4_ROWS, or (auto) timed once per process
    on a [1536, 576] product against bf16: the largest of 1, 2, 4, ... 64 up to which the codes stay faster
    (one stream reads 4-bit weights; a batch's compute favours bf16), 0 where they are slower even at one row."""
    from inference.settings import int4_rows_setting

    pinned = int4_rows_setting()
    if pinned is not None:
        return pinned
    dense = gemm_for("bf16", torch.device("cpu"), _cpu_fp32_kernel())
    best = _codes_max_rows(_int4_linear(dense.linear), lambda w: _int4_weight(w, group_quantize(w), dense.pack, 64),
                           dense.linear)
    log.info("int4w: 4-bit codes up to %d rows, bf16 above (KVSERVE_INT4_ROWS pins it)", best)
    return best


def _w4a8_dense(device: torch.device, fp32_kernel: str) -> Gemm:
    """What w4a8 runs above its rows (w4a8_dense_mode)."""
    return gemm_for(w4a8_dense_mode(fp32_kernel), device, fp32_kernel)


TIMING_SHAPE = (1536, 576)  # [N, K] of the start-up timings' weight: SmolLM2-135M's gate (or up) projection
DENSE_TIMING_ROWS = (64, 256)  # the rows w4a8's dense fallback serves: a batch past the codes' rows, a prefill chunk


@lru_cache(maxsize=2)
def w4a8_dense_mode(fp32_kernel: str) -> str:
    """What w4a8 runs above its rows: "bf16" where oneDNN prepacks bf16 weights and bf16 measures faster than fp32
    here (a TIMING_SHAPE product at DENSE_TIMING_ROWS rows, summed; once per process), else "fp32" (bf16 unpacked is
    slower everywhere measured). Prepacking alone does not tell: oneDNN prepacks bf16 on any AVX-512 CPU and, without
    bf16 instructions (an AVX-512 Xeon before Cooper Lake; here ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI), runs it at ~5x
    fp32's time."""
    if not onednn_bf16_prepacks():
        return "fp32"
    cpu = torch.device("cpu")
    bf16, fp32 = gemm_for("bf16", cpu, fp32_kernel), gemm_for("fp32", cpu, fp32_kernel)
    gen = torch.Generator().manual_seed(0)
    n, k = TIMING_SHAPE
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    xs = [torch.randn(rows, k, generator=gen) for rows in DENSE_TIMING_ROWS]
    with torch.inference_mode():
        wb, wf = bf16.pack(w), fp32.pack(w)
        bf16_ms, fp32_ms = _fastest_ms([lambda: [bf16.linear(x, wb) for x in xs],
                                        lambda: [fp32.linear(x, wf) for x in xs]], 5)
    mode = "bf16" if bf16_ms < fp32_ms else "fp32"
    log.info("w4a8: %s above the codes' rows (%s %.2f ms, %s %.2f ms: a %s weight at %s rows)", mode, bf16.kernel,
             bf16_ms, fp32.kernel, fp32_ms, list(TIMING_SHAPE), " and ".join(map(str, DENSE_TIMING_ROWS)))
    return mode


@lru_cache(maxsize=16)
def w4a8_max_rows(shape: tuple[int, int], q8: bool) -> int:
    """The most rows w4a8 multiplies a weight of `shape` [N, K] with the file's blocks (Q8_0 where `q8`):
    KVSERVE_W4A8_ROWS, or (auto) timed once per process and shape like int4_max_rows against its dense fallback, at
    this process's threads: a 1-thread worker's codes beat fp32 at 32 rows where 2 threads' do not, and the big
    lm_head (memory-bound) keeps its codes to more rows than a layer's projections."""
    from inference.settings import w4a8_rows_setting

    pinned = w4a8_rows_setting()
    if pinned is not None:
        return pinned
    gemm = gemm_for("w4a8", torch.device("cpu"), _cpu_fp32_kernel())
    dense = _w4a8_dense(torch.device("cpu"), _cpu_fp32_kernel())
    quantize = group8_quantize if q8 else group_quantize
    # a prefill chunk is up to 512 rows (EngineConfig.chunk_size); the lm_head sees one row per sampling sequence
    top = 64 if q8 else 512
    best = _codes_max_rows(gemm.linear, lambda w: _coded_weight(w, quantize(w), dense.pack, top), dense.linear,
                           shape, top)
    log.info("w4a8: the file's %s blocks of a %s weight up to %s rows, %s above (KVSERVE_W4A8_ROWS pins it)",
             "Q8_0" if q8 else "Q4", list(shape), "all" if best == UNBOUNDED_ROWS else best, dense.kernel)
    return best


def _cpu_fp32_kernel() -> str:
    return "onednn" if torch.backends.mkldnn.is_available() else "blas"


UNBOUNDED_ROWS = 1 << 30  # the codes won at the top of the ladder: they take every row count
CLEAR_LOSS = 1.25  # codes / dense time past which a rung is lost beyond a shared host's noise
TIMING_BYTES = 8 << 20  # the row ladder's working set of bf16 weights: past a core's L2, as a model's layers are


def _codes_max_rows(linear, pack_codes, dense_linear, shape: tuple[int, int] = TIMING_SHAPE, top: int = 64) -> int:
    """The most rows, one of 1, 4, 16, 32, 64 ... `top`, up to which `linear` over a `shape` weight packed by
    `pack_codes` (codes at any rows) is used rather than `dense_linear` over its dense copy; 0 where the codes lose
    even at one row, and UNBOUNDED_ROWS where they take every rung up to `top`. Each rung is timed (codes / dense);
    the threshold is the one that costs least summed over the rungs (a rung's ratio where the codes take it, 1 where
    dense does), so one rung the codes lose narrowly between rungs they win clearly (a stall on a shared host, a
    kernel's weaker tile) does not hand every larger row count to dense. The ladder stops after two rungs lost by
    more than CLEAR_LOSS. Timed over enough distinct weights of the shape that their dense copies outgrow a core's
    L2 (TIMING_BYTES), as a model's layers do: one weight, resident, flatters the dense path at few rows, where a
    step is bound by the bytes it reads (past 16 rows, compute-bound, one copy is timed).
    32 is a rung of its own: a decode step of 32 sequences, the batch a busy worker runs most."""
    gen = torch.Generator().manual_seed(0)
    copies = max(1, min(32, cdiv(TIMING_BYTES, 2 * shape[0] * shape[1])))
    ladder = [r for r in (1, 4, 16, 32, 64, 128, 256, 512) if r < top] + [top]
    ratios = []  # codes ms / dense ms per rung timed
    with torch.inference_mode():
        packed = [pack_codes(torch.randn(*shape, generator=gen) / shape[1] ** 0.5) for _ in range(copies)]
        for rows in ladder:
            x = torch.randn(rows, shape[1], generator=gen)
            repeats, some = (7, packed) if rows <= 16 else (3, packed[:1])  # past 16 rows the products are compute-bound
            codes_ms, dense_ms = _fastest_ms([lambda: [linear(x, p) for p in some],
                                              lambda: [dense_linear(x, p.dense) for p in some]], repeats)
            ratios.append(codes_ms / dense_ms)
            if len(ratios) >= 2 and min(ratios[-2:]) > CLEAR_LOSS:
                break
    # codes on the first k rungs: cost(k) = sum(ratios[:k]) + (rungs - k); the least, and of equals the fewest codes
    costs = [sum(ratios[:k]) + len(ratios) - k for k in range(len(ratios) + 1)]
    k = costs.index(min(costs))
    if k == len(ladder):
        return UNBOUNDED_ROWS
    return ladder[k - 1] if k else 0


def _fastest_ms(fns, repeats: int) -> list[float]:
    """Each fn's fastest of `repeats` runs (ms), the fns interleaved after one warm-up each: the least disturbed
    run of each, under the same conditions, so one stall on a shared host does not decide between two kernels."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], (time.perf_counter() - t0) * 1e3)
    return best


# ---- auto ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Choice:
    mode: str
    timings_ms: dict  # mode -> ms for one layer's projections + lm_head at 1 and 32 rows, each regime weighed as
    # fp32's share of the total (choose); None: out
    why: str

    def line(self) -> str:
        shown = ", ".join(f"{m}={'out' if t is None else f'{t:.2f}ms'}" for m, t in self.timings_ms.items())
        return f"precision {self.mode}" + (f" ({shown})" if shown else "") + f": {self.why}"


def model_shapes(config) -> list[tuple[int, int]]:
    """[out, in] of one layer's fused projections (qkv, o, gate_up, down) and of lm_head."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return [(q + 2 * kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size),
            (c.hidden_size, c.intermediate_size), (c.vocab_size, c.hidden_size)]


def _pass_ms(gemm: Gemm, pairs) -> float:
    """ms for all (activation, packed weight) products once."""
    t0 = time.perf_counter()
    for x, w in pairs:
        gemm.linear(x, w)
    return (time.perf_counter() - t0) * 1e3


def _time_candidates(runs: dict, repeats: int) -> dict:
    """Median ms per mode and row count of `runs` (mode -> (Gemm, {rows: pairs}); the first mode is the
    yardstick). Two warm-up passes each (the first JITs oneDNN's primitives); a mode whose second pass at any row
    count is over 3x the yardstick's is plainly slower: that pass stands as its time (bounds auto's cost). The
    others are timed in `repeats` rounds, every mode once a round in turn, so a burst of load from another process
    (the other workers of a host start together) lands on every candidate alike, not on one candidate's window."""
    timed, live, base = {}, [], None
    for mode, (gemm, pairs) in runs.items():
        second = {}
        for rows, p in pairs.items():
            _pass_ms(gemm, p)
            second[rows] = _pass_ms(gemm, p)
        base = base or second
        if any(second[r] > 3 * base[r] for r in second):
            timed[mode] = second
        else:
            live.append(mode)
    samples = {mode: {rows: [] for rows in runs[mode][1]} for mode in live}
    for _ in range(repeats):
        for mode in live:
            gemm, pairs = runs[mode]
            for rows, p in pairs.items():
                samples[mode][rows].append(_pass_ms(gemm, p))
    timed.update({mode: {rows: statistics.median(v) for rows, v in by_rows.items()} for mode, by_rows in samples.items()})
    return timed


def choose(shapes, device: torch.device, fp32_kernel: str, *, candidates=MODES, repeats: int = 5,
           contracts: dict | None = None, gemms=None) -> Choice:
    """Times each candidate on `shapes` at 1 and 32 rows, the two weighed alike, in interleaved rounds
    (_time_candidates); a candidate that raises, or whose matmul errs past its
    contract's `max_kernel_rel_err` against fp32, is out. The fastest left wins; fp32 is always left (it is the
    reference: if even it raises, that raises). A mode with `pack_group` (int4w, w4a8) packs every weight but the
    last (model_shapes' lm_head, which no file holds as 4-bit groups) from min/max codes of it, against the codes'
    own fp32 product; the lm_head too where the mode has `head_quantize` (w4a8: as Q8_0 blocks). `gemms`: mode -> Gemm (tests put a broken one here)."""
    contracts = contracts or CONTRACTS
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(device) for n, k in shapes]
    inputs = {rows: [torch.randn(rows, k, generator=gen).to(device) for _, k in shapes] for rows in (1, 32)}
    timings, notes, runs = dict.fromkeys(candidates), [], {}  # timings in candidates' order; None: out
    with torch.inference_mode():
        for mode in candidates:
            gemm = (gemms or {}).get(mode) or gemm_for(mode, device, fp32_kernel)
            try:
                if gemm.pack_group:
                    head = gemm.head_quantize(weights[-1]) if gemm.head_quantize else None
                    quants = [group_quantize(w) for w in weights[:-1]] + [head]
                    used = [w if q is None else q.dequantize() for w, q in zip(weights, quants)]
                    packs = [gemm.pack(w) if q is None else gemm.pack_group(w, q) for w, q in zip(used, quants)]
                else:
                    used, packs = weights, [gemm.pack(w) for w in weights]
                reference = {rows: [F.linear(x, w) for x, w in zip(inputs[rows], used)] for rows in inputs}
                err = max((gemm.linear(x, p) - ref).norm().item() / ref.norm().item()
                          for rows in inputs for x, p, ref in zip(inputs[rows], packs, reference[rows]))
                if not err <= contracts[mode].max_kernel_rel_err:  # NaN is out too
                    raise ArithmeticError(f"matmul off by {err:.1e} relative (contract {contracts[mode].max_kernel_rel_err:g})")
                runs[mode] = (gemm, {rows: list(zip(inputs[rows], packs)) for rows in inputs})
            except Exception as exc:  # an advertised ISA that is slow is timed; one that is broken is out
                if mode == "fp32":
                    raise
                notes.append(f"{mode} out: {type(exc).__name__}: {exc}")
        per_rows = _time_candidates(runs, repeats)
    base_rows = per_rows[next(iter(runs))]  # the first candidate timed (fp32) is the yardstick
    for mode, t in per_rows.items():
        # one stream and a batch of 32 weigh alike: each regime's time as a share of fp32's, scaled back to fp32's
        # total ms; a plain sum would let the 32-row products decide alone
        timings[mode] = statistics.mean(t[r] / base_rows[r] for r in inputs) * sum(base_rows.values())
    timed = {m: t for m, t in timings.items() if t is not None}
    best = min(timed, key=timed.get)
    why = f"fastest of {sorted(timed)}" + (f" by {timed['fp32'] / timed[best]:.2f}x over fp32" if best != "fp32" else "")
    if best == "bf16" and "int4w" in timed and int4_max_rows() > 0:
        # int4w is bf16 above int4_max_rows() rows and measured faster at or below them: the two timings differ
        # by noise on the shared lm_head, not by what they run
        best, why = "int4w", f"int4w over bf16 (the same bf16 matmuls above {int4_max_rows()} rows, the codes at or below)"
    best, why = w4a8_preferred(best, timed) or (best, why)
    return Choice(best, timings, "; ".join([why] + notes))


W4A8_SLACK = 1.25  # auto takes w4a8 over a bf16 or int4w timed faster by less than this factor


def w4a8_preferred(best: str, timed: dict) -> tuple[str, str] | None:
    """(w4a8, why) where auto's matmul timings put bf16 or int4w first by less than W4A8_SLACK; else None. w4a8
    multiplies the file's 4-bit codes as int4w does (one stream bound by the same bytes) and bf16's matmuls past its
    rows as both do, and it alone runs a decode step's layers in one native call, which these timings of single
    products do not see: on an AMX Xeon int4w once timed 9 % faster, and side by side w4a8 decoded one stream at
    276 tok/s to int4w's 97 (bench/RESULTS.md, stop 41)."""
    if best in ("bf16", "int4w") and timed.get("w4a8") is not None and timed["w4a8"] <= W4A8_SLACK * timed[best]:
        return "w4a8", (f"w4a8 over {best} (timed {timed['w4a8'] / timed[best]:.2f}x its ms, within {W4A8_SLACK}x: "
                        "the same codes or matmuls, and a decode step's layers in one native call)")
    return None


@lru_cache(maxsize=8)
def _auto_cached(shapes: tuple, device: str, fp32_kernel: str, candidates: tuple) -> Choice:
    return choose(list(shapes), torch.device(device), fp32_kernel, candidates=candidates)


def resolve_precision(requested: str, config, device: torch.device, dtype, fp32_kernel: str,
                      grouped: bool = False) -> Choice:
    """The mode an engine runs for KVSERVE_PRECISION=`requested`; `auto` is timed once per process per model
    shape and device (a worker's engines and its canary sandbox agree). Non-fp32 modes need an fp32 model;
    int4w and w4a8 need `grouped`: a model file holding its projections as 4-bit groups (inference.loader)."""
    if requested not in SETTING_CHOICES:
        raise ValueError(f"precision {requested!r}: one of {SETTING_CHOICES}")
    if dtype != torch.float32:
        if requested not in ("fp32", "auto"):
            raise ValueError(f"precision {requested} needs KVSERVE_DTYPE=float32 (the model's dtype is {dtype})")
        return Choice("fp32", {}, f"the model runs {dtype}: precision modes apply to fp32 models only")
    if requested in GROUPED and not grouped:
        raise ValueError(f"precision {requested} multiplies the model file's own 4-bit blocks: use a GGUF whose "
                         "projections are Q4_0 or Q4_1, or another precision")
    if requested != "auto":
        return Choice(requested, {}, "set by KVSERVE_PRECISION")
    candidates = tuple(m for m in MODES if m not in GROUPED or (grouped and device.type == "cpu"))
    return _auto_cached(tuple(model_shapes(config)), str(device), fp32_kernel, candidates)


def precision_scope(model_fingerprint: str, device: torch.device) -> str:
    """What two processes' `auto` timings share when they share it: the model file, the device, torch's build,
    the CPU's flags and the ISA caps of its kernels. Workers of one scope adopt one choice (inference.registry
    `precision_agreed`), so a deployment's prefill and decode never disagree on a timing's noise."""
    import hashlib
    import os

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    caps = [os.environ.get(v, "") for v in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "KVSERVE_INT4_ROWS",
                                            "KVSERVE_W4A8_ROWS")]
    parts = [model_fingerprint, device.type, torch.__version__, " ".join(sorted(flags.split())), *caps]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def kv_dtype_for(requested: str, mode: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's element type for KVSERVE_KV_DTYPE=`requested` (auto | float32 | bfloat16 | int8) under
    `mode`. auto: the
    model's own dtype, except on the CPU in the modes whose matmuls already take reduced activations (REDUCED_KV),
    whose pool is bf16: half the bytes per token to hold and, at many sequences, to read each step; the attention
    math stays fp32 (its contract is the mode's, measured through the pool: tests/inference/test_precision.py).
    fp32 keeps fp32 (Hugging Face's text) and so does fp16w (its contract is 8x tighter than bf16's). Another dtype
    than the model's is for an fp32 model on the CPU only (the native kernel reads either; xformers on CUDA takes
    queries and pages in one dtype). int8 is never auto: each row's codes and scale (inference.kv_cache), 0.27 of
    fp32's bytes per token (1.9x a bf16 pool's tokens in the same memory, 0.53 of its bytes read per step) for a
    larger error (measured in tests/inference/test_precision.py), the operator's trade to make."""
    if requested == "auto":
        reduced = device.type == "cpu" and model_dtype == torch.float32 and mode in REDUCED_KV
        return torch.bfloat16 if reduced else model_dtype
    wanted = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}.get(requested)
    if wanted is None:
        raise ValueError(f"KVSERVE_KV_DTYPE={requested!r}: auto, float32, bfloat16 or int8")
    if wanted != model_dtype and not (device.type == "cpu" and model_dtype == torch.float32):
        raise ValueError(f"KVSERVE_KV_DTYPE={requested} with a {str(model_dtype).removeprefix('torch.')} model on "
                         f"{device.type}: a KV dtype other than the model's needs an fp32 model on the CPU; unset it")
    return wanted


def precision_fingerprint(model_fingerprint: str, mode: str) -> str:
    """The model identity a handoff carries: fp32 is the file's own fingerprint (what the API reports and older
    workers register); another mode adds itself, so a decode worker refuses KV a prefill in another precision
    computed."""
    return model_fingerprint if mode == "fp32" else f"{model_fingerprint}+{mode}"

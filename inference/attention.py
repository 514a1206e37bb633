"""Attention over a paged KV pool. Backends: `native` (CPU default: a C++ kernel that reads K/V from
the pool's pages in place), `sdpa` (the reference: torch SDPA over gathered pages, any device) and
`xformers` (CUDA: one memory-efficient-attention call per step over all sequences' block tables).

`AttentionBatch` is built once per step by `inference.runner`. Every sequence in the step is one
entry of `seqs`: its query rows, its context length and its block table. A chunk that starts its
prompt (`fresh`) needs only this step's own K/V; every other one (decode rows, chunks continuing a
cached prefix) reads the pool. Table padding points at the pool's null page (always zeros, never
allocated), so a padded read never touches another request's page.
"""
import logging
import math
import time
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.nn.functional as F

from inference.kv_cache import cdiv, dequantize_rows
from inference.settings import env_choice

log = logging.getLogger(__name__)

BACKEND_NAMES = ("native", "sdpa", "xformers")


@dataclass
class SeqBatch:
    """Sequences attended over the pool, in flat-batch row order (int32 tensors on the pool's device)."""
    tables: torch.Tensor  # [S, P] page ids, null page beyond each sequence's context
    context_lens: torch.Tensor  # [S] tokens attended over, this step's included
    query_start: torch.Tensor  # [S] first row of the sequence's queries in the flat batch
    query_len: torch.Tensor  # [S] query rows (1 for a decode row)
    lens: list[int]  # host copies of context_lens / query_start / query_len
    starts: list[int]
    qlens: list[int]

    def __len__(self) -> int:
        return len(self.lens)


@dataclass
class PrefillSlice:
    """A chunk that starts its prompt: attends causally over this step's own K/V only."""
    row_start: int
    num_rows: int


@dataclass
class AttentionBatch:
    slot_pages: torch.Tensor  # [T] page id each new token's K/V is written to
    slot_offsets: torch.Tensor  # [T] offset inside that page
    paged: SeqBatch | None = None  # sequences that read cached K/V from the pool
    fresh: list[PrefillSlice] = field(default_factory=list)
    page_size: int = 16
    null_page: int = 0
    cache: dict = field(default_factory=dict)  # per-step derived tensors a backend builds once, reuses per layer


def causal_sdpa(q, keys, values):
    """q [B, H, Q, D]; keys/values [B, KVH, S, D], S >= Q; query i attends keys 0 .. S - Q + i
    (bottom-right aligned: the chunk's queries are the last Q positions). Query heads of one KV head
    are folded into the query axis, so grouped-query attention needs no repeated K/V."""
    b, h, nq, d = q.shape
    kvh, nk = keys.shape[1], keys.shape[2]
    groups = h // kvh
    if nq == nk:  # a fresh prompt: the fused causal kernel, no explicit mask
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=groups > 1)
    # SDPA's is_causal aligns top-left; a chunk continuing a cached prefix needs bottom-right
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
    if groups == 1:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    out = F.scaled_dot_product_attention(q.reshape(b, kvh, groups * nq, d), keys, values,
                                         attn_mask=mask.repeat(groups, 1))
    return out.reshape(b, h, nq, d)


def _grouped_sdpa(q, keys, values, mask):
    """One query per sequence: q [B, H, 1, D], keys/values [B, KVH, S, D], mask [B, 1, 1, S]."""
    b, h, _, d = q.shape
    groups = h // keys.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, keys.shape[1], groups, d), keys, values, attn_mask=mask)
    return out.reshape(b, h, 1, d)


def _gather(kv, layer, tables, which, dtype):
    """tables [..., P] -> [..., KVH, P * page_size, D] in `dtype` (a copy of exactly those pages; a bf16 pool's
    values widen exactly to an fp32 model's, an int8 pool's rows are dequantized as the native kernel reads them).

    index_select copies each page's [ps, KVH, D] block (contiguous in the pool) as one slice;
    advanced indexing (`src[tables]`) computed an offset per element and was ~2.5x slower."""
    src = kv.data[:, layer, which]  # [pages, ps, KVH, row]
    pages = src.index_select(0, tables.reshape(-1))  # [n, ps, KVH, row], contiguous
    if pages.dtype == torch.int8:
        pages = dequantize_rows(pages)
    ps, kvh, d = pages.shape[1:]
    flat = pages.to(dtype).view(*tables.shape[:-1], tables.shape[-1] * ps, kvh, d)
    return flat.transpose(-3, -2)


FRESH_KINDS = ("fp32", "native-fp32", "sdpa-bf16", "native-bf16")
FP32_KINDS = ("fp32", "native-fp32")  # kinds that round nothing: they compete on time alone
NATIVE_PREFILL_DIMS = (32, 64, 128)  # the head dims prefill.cpp's kernels are built for
BF16_CLEAR_WIN = 0.8  # a bf16 path is taken only this much faster than the fastest fp32 one: its rounding must buy time


@lru_cache(maxsize=1)
def fresh_timings() -> dict:
    """Seconds of three calls of each fresh-prompt kind this CPU runs (fresh_runs) on a 384-token, 9-head product (3
    KV heads, head_dim 64), alternating, best of two rounds; once per process."""
    gen = torch.Generator().manual_seed(0)
    runs = fresh_runs(*(torch.randn(384, h, 64, generator=gen) for h in (9, 3, 3)))
    best = {}
    for _ in range(2):
        for kind, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(3):
                run()
            best[kind] = min(best.get(kind, math.inf), time.perf_counter() - t0)
    return best


def fresh_exact_kind() -> str:
    """The fastest fresh-prompt kind that rounds nothing (FP32_KINDS, by fresh_timings): an int8 pool's fresh prompt
    attends its fp32 K/V this way (its codes are no bf16 to compute in)."""
    best = fresh_timings()
    return min((kind for kind in best if kind in FP32_KINDS), key=best.get)


def fresh_kind(kv_dtype: torch.dtype) -> str:
    """How an fp32 model's fresh prompt attends on the CPU over a pool of `kv_dtype`: a bf16 pool's way
    (fresh_bf16_kind), an int8 pool's (fresh_exact_kind), else torch's fp32 SDPA (an fp32 pool: Hugging Face's
    numbers). The engine calls it at start so the timing is done (and logged) before the first prompt."""
    if kv_dtype == torch.bfloat16:
        return fresh_bf16_kind()
    if kv_dtype == torch.int8:
        return fresh_exact_kind()
    return "fp32"


@lru_cache(maxsize=1)
def fresh_bf16_kind() -> str:
    """How a fresh prompt attends over a bf16 pool on this CPU: `native-bf16` (inference.native's
    prefill_attention_bf16: AVX512-BF16 dot products; ~2x torch's fp32 SDPA on a Zen 4 EPYC, where torch's bf16 SDPA
    is no faster), `sdpa-bf16` (torch's SDPA in bf16: ~3x fp32 on AMX), `native-fp32` (prefill_attention_fp32: the
    same tiling in fp32 FMAs on any AVX-512 CPU; 2.1x torch's fp32 SDPA on an Ice Lake Xeon, which has no bf16 dot
    products) or `fp32` (torch's SDPA in fp32: AVX2, or where nothing beats it), by fresh_timings; logged."""
    best = fresh_timings()
    kind = fresh_kind_pick(best)
    log.info("a fresh prompt's attention over a bf16 pool runs %s (%s per 3 calls)", kind,
             ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in best.items()))
    return kind


def fresh_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """kind -> a call attending the fresh chunk q [T, H, D] over its own k, v [T, KVH, D] that way, for every kind
    this CPU runs (FRESH_KINDS less the native kernels it lacks); what fresh_bf16_kind times, and bench.attention."""
    from inference import native

    heads_first = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    out, scale = torch.empty_like(q), q.shape[-1] ** -0.5
    runs = {"fp32": lambda: causal_sdpa(*heads_first),
            "sdpa-bf16": lambda: causal_sdpa(*(t.to(torch.bfloat16) for t in heads_first))}
    if native.prefill_fp32_available():
        runs["native-fp32"] = lambda: native.prefill_attention_fp32(out, q, k, v, scale)
    if native.prefill_bf16_available():
        runs["native-bf16"] = lambda: native.prefill_attention_bf16(out, q, k, v, scale)
    return runs


def fresh_kind_pick(seconds: dict) -> str:
    """Of the kinds timed (`seconds`: kind -> time, fp32's included), the fastest that rounds nothing (FP32_KINDS),
    unless a bf16 path beats it by BF16_CLEAR_WIN: then the fastest bf16 path."""
    exact = min((kind for kind in seconds if kind in FP32_KINDS), key=seconds.get)
    bf16 = [kind for kind in seconds if kind not in FP32_KINDS]
    if not bf16:
        return exact
    fastest = min(bf16, key=seconds.get)
    return fastest if seconds[fastest] < BF16_CLEAR_WIN * seconds[exact] else exact


NATIVE_FRESH = {"native-bf16": "prefill_attention_bf16", "native-fp32": "prefill_attention_fp32"}


def _fresh_attention(out, q, k, v, batch, kv_dtype: torch.dtype):
    """A fresh prompt attends its own K/V. Over a bf16 pool on the CPU, where a bf16 path is faster
    (fresh_bf16_kind), it attends them as the pool holds them, rounded to bf16 (q too), softmax and sums in fp32;
    where kvserve's own fp32 kernel is, in fp32 through it; over an int8 pool, the faster fp32 way
    (fresh_exact_kind). An fp32 pool (fp32 mode: Hugging Face's numbers) keeps torch's fp32 SDPA."""
    kind = fresh_kind(kv_dtype) if q.dtype == torch.float32 and q.device.type == "cpu" and batch.fresh else "fp32"
    if kind in NATIVE_FRESH and q.shape[-1] not in NATIVE_PREFILL_DIMS:
        kind = "fp32"
    for s in batch.fresh:
        rows = slice(s.row_start, s.row_start + s.num_rows)
        if kind in NATIVE_FRESH:  # q, k, v as views into the projection's output; straight into out's rows
            from inference import native  # (out: empty_like(q), contiguous; the kernel refuses any other)

            getattr(native, NATIVE_FRESH[kind])(out[rows], q[rows], k[rows], v[rows], q.shape[-1] ** -0.5)
            continue
        dtype = torch.bfloat16 if kind == "sdpa-bf16" else q.dtype
        qp, kp, vp = (x[rows].transpose(0, 1).unsqueeze(0).to(dtype) for x in (q, k, v))
        out[rows] = causal_sdpa(qp, kp, vp).squeeze(0).transpose(0, 1)


def _decode_groups(batch: AttentionBatch, device):
    """Decode rows bucketed by length (up to 8 buckets: little padding to gather, few calls), with
    their tables cut to the bucket's width and an additive mask; built once per step."""
    if "decode_groups" in batch.cache:
        return batch.cache["decode_groups"]
    sb, ps = batch.paged, batch.page_size
    decodes = [i for i in range(len(sb)) if sb.qlens[i] == 1]
    order = sorted(decodes, key=lambda i: sb.lens[i])
    groups = []
    size = max(4, cdiv(len(order), 8))
    for at in range(0, len(order), size):
        members = order[at: at + size]
        idx = torch.tensor(members, device=device)
        width = cdiv(max(sb.lens[i] for i in members), ps)
        tables = sb.tables.index_select(0, idx)[:, :width].long()
        lens = sb.context_lens.index_select(0, idx)
        valid = torch.arange(width * ps, device=device)[None, :] < lens[:, None]
        bias = torch.zeros(valid.shape, dtype=batch.cache["dtype"], device=device).masked_fill_(~valid, float("-inf"))
        groups.append((sb.query_start.index_select(0, idx).long(), tables, bias[:, None, None, :]))
    batch.cache["decode_groups"] = groups
    return groups


def sdpa_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv, layer: int,
                         batch: AttentionBatch) -> torch.Tensor:
    """The reference. q [T, H, D]; k, v [T, KVH, D] are this step's (already written to the pool)."""
    out = torch.empty_like(q)
    sb = batch.paged
    if sb is not None:
        batch.cache.setdefault("dtype", q.dtype)
        for rows, tables, bias in _decode_groups(batch, q.device):
            keys, values = _gather(kv, layer, tables, 0, q.dtype), _gather(kv, layer, tables, 1, q.dtype)
            out[rows] = _grouped_sdpa(q[rows].unsqueeze(2), keys, values, bias).squeeze(2)
        for i in range(len(sb)):
            n, ctx, start = sb.qlens[i], sb.lens[i], sb.starts[i]
            if n == 1:
                continue
            table = sb.tables[i, : cdiv(ctx, batch.page_size)].long()
            keys = _gather(kv, layer, table, 0, q.dtype)[:, :ctx].unsqueeze(0)
            values = _gather(kv, layer, table, 1, q.dtype)[:, :ctx].unsqueeze(0)
            rows = slice(start, start + n)
            out[rows] = causal_sdpa(q[rows].transpose(0, 1).unsqueeze(0), keys, values).squeeze(0).transpose(0, 1)
    _fresh_attention(out, q, k, v, batch, kv.data.dtype)
    return out


def native_paged_attention(q, k, v, kv, layer, batch):
    """The CPU kernel reads every pool-reading sequence's pages in place, in one call; fresh chunks
    use SDPA over their own K/V (a GEMM-shaped problem the kernel would do no better)."""
    from inference import native

    out = torch.empty_like(q)
    sb = batch.paged
    if sb is not None:
        native.paged_attention(out, q, kv.data, layer, sb.tables, sb.context_lens, sb.query_start,
                               sb.query_len, 1.0 / math.sqrt(q.shape[-1]))
    _fresh_attention(out, q, k, v, batch, kv.data.dtype)
    return out


_XFORMERS_PAGED = {}  # dtype -> whether xformers has a paged kernel for this device, page size and dtype


def xformers_paged_attention(q, k, v, kv, layer, batch):  # CUDA only; same semantics as the reference
    """One memory_efficient_attention call per step over every sequence (the runner puts fresh chunks
    in `paged` too on this backend). fp16/bf16: a paged bias over the pool itself (the pool viewed as
    one token axis [(pages * layers * 2) * page_size, KVH, D] makes (page, layer, K|V) an xformers
    page, so nothing is copied). fp32, or when no paged kernel takes this page size: one gather per
    layer into padded rows and a block-diagonal causal bias with per-sequence offsets."""
    from xformers.ops import fmha

    if _XFORMERS_PAGED.get(q.dtype, q.dtype in (torch.float16, torch.bfloat16)):
        try:
            out = _xformers_call(fmha, q, kv, layer, batch, paged=True)
            _XFORMERS_PAGED[q.dtype] = True
            return out
        except (NotImplementedError, ValueError) as exc:
            log.warning("xformers has no paged kernel for %s, page size %d (%s): gathering pages instead",
                        q.dtype, batch.page_size, str(exc).splitlines()[0])
            _XFORMERS_PAGED[q.dtype] = False
    return _xformers_call(fmha, q, kv, layer, batch, paged=False)


def _xformers_call(fmha, q, kv, layer, batch, paged: bool):
    qx, keys, values, bias = xformers_inputs(fmha, q, kv, layer, batch, paged)
    return fmha.memory_efficient_attention_forward(qx, keys, values, attn_bias=bias).reshape(q.shape)


def xformers_inputs(fmha, q, kv, layer, batch, paged: bool):
    """q as [1, T, KVH, G, D], K and V as [1, keys, KVH, G (expanded), D], and the bias."""
    sb, ps = batch.paged, batch.page_size
    t, h, d = q.shape
    kvh = kv.num_kv_heads
    g = h // kvh
    key = ("xformers_bias", paged)
    if key not in batch.cache:
        if paged:
            batch.cache[key] = fmha.attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
                q_seqlen=sb.qlens, kv_seqlen=sb.lens, block_tables=sb.tables, page_size=ps, device=q.device)
        else:
            batch.cache[key] = fmha.attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
                q_seqlen=sb.qlens, kv_padding=sb.tables.shape[1] * ps, kv_seqlen=sb.lens, device=q.device)
    bias = batch.cache[key]
    if paged:
        flat = kv.data.view(-1, kvh, d)  # token axis over (page, layer, K|V, offset)
        tables = sb.tables * (kv.data.shape[1] * 2) + layer * 2  # the xformers page holding (page, layer, K)
        bias = fmha.attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask(
            q_seqinfo=bias.q_seqinfo, k_seqinfo=bias.k_seqinfo, block_tables=tables, page_size=ps)
        keys = flat[:-ps].view(1, -1, kvh, 1, d).expand(-1, -1, -1, g, -1)
        values = flat[ps:].view(1, -1, kvh, 1, d).expand(-1, -1, -1, g, -1)  # page e of this view is V
    else:
        tables = sb.tables.long()
        keys = kv.data[tables, layer, 0].reshape(1, -1, kvh, 1, d).expand(-1, -1, -1, g, -1)
        values = kv.data[tables, layer, 1].reshape(1, -1, kvh, 1, d).expand(-1, -1, -1, g, -1)
    return q.view(1, t, kvh, g, d), keys, values, bias


def backend_wanted() -> str:
    """KVSERVE_ATTENTION, "" when unset (chosen from the device)."""
    return env_choice("KVSERVE_ATTENTION", "", BACKEND_NAMES)


def select_backend(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """`KVSERVE_ATTENTION` (native|sdpa|xformers) overrides; otherwise `native` on the CPU (fp32) and
    xformers on CUDA when its ops load. Falling back to the reference is logged as an error."""
    wanted = backend_wanted()
    if wanted == "sdpa":
        return "sdpa"
    if device.type != "cuda":
        if wanted == "xformers":
            raise ValueError("KVSERVE_ATTENTION=xformers needs a CUDA device; unset it to use the native kernel")
        return _native_or_fallback(dtype, required=wanted == "native")
    if wanted == "native":
        raise ValueError("KVSERVE_ATTENTION=native is the CPU kernel; unset it to use xformers on CUDA")
    try:
        import xformers.ops  # noqa: F401  (imported only on CUDA: on CPU it warns)
    except Exception as exc:  # pragma: no cover - depends on the CUDA build
        if wanted == "xformers":
            raise
        log.error("xformers ops did not load (%s); attention falls back to SDPA over gathered pages (slow)", exc)
        return "sdpa"
    return "xformers"


def _native_or_fallback(dtype: torch.dtype, required: bool) -> str:
    from inference import native

    why = None
    if dtype != torch.float32:
        why = f"the kernel takes an fp32 model's queries (over an fp32 or bf16 pool) and the model is {dtype}"
    elif not native.load():
        why = native.load_error()
    if why is None:
        return "native"
    if required:
        raise RuntimeError(f"KVSERVE_ATTENTION=native but the paged-attention kernel cannot run: {why}")
    log.error("PAGED-ATTENTION KERNEL NOT IN USE (%s): decode attention falls back to SDPA over gathered "
              "pages, a copy of every sequence's K/V per layer per step. Build it with `make install`.", why)
    return "sdpa"


BACKENDS = {"native": native_paged_attention, "sdpa": sdpa_paged_attention, "xformers": xformers_paged_attention}

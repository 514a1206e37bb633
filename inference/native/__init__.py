"""The native CPU kernels: paged attention (paged_attention.cpp), a fresh prompt's attention in bf16 dot products
or fp32 FMAs (prefill.cpp), the fused elementwise ops of a layer (fused.cpp: RMSNorm; RoPE with the K/V pool
write; SiLU * up; the greedy rows' argmax), precision w4a8's integer matmul of the file's own weight blocks
(quant.cpp) and a w4a8 decode step's decoder layers in one call (layer.cpp), built by
`make install` (`python -m inference.native`) into inference/native/build/ as one library, loaded here as
torch.ops.kvserve_paged.

The build is keyed by a hash of the source, the torch version and the flags, so a stale library is
never loaded. Without a built library the engine falls back to SDPA over gathered pages and says so
loudly at engine start (see `inference.attention.select_backend`).

One library holds an AVX-512, an AVX2 and a generic build of each loop, chosen at run time from the
CPU (no -march flag, so the same .so runs anywhere); KVSERVE_ATTN_ISA=avx512|avx2|generic (read at
load) or `set_isa()` forces one for attention, refusing an ISA the CPU lacks; ATEN_CPU_CAPABILITY (torch's own
cap, cap.h) caps every loop, w4a8's included, as if the CPU were that narrow. The kernels' jobs run on their own
threads (pool.cpp, `set_threads`).
"""
import hashlib
import logging
import os
from pathlib import Path

import torch

from inference.settings import attn_isa_setting

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "paged_attention.cpp", HERE / "fused.cpp", HERE / "quant.cpp", HERE / "layer.cpp", HERE / "pool.cpp",
           HERE / "prefill.cpp")
HEADERS = (HERE / "pool.h", HERE / "cap.h", HERE / "arith.h", HERE / "expo.h")
BUILD_DIR = HERE / "build"
CFLAGS = ["-O3", "-fopenmp", "-fopenmp-simd", "-std=c++17"]
LDFLAGS = ["-fopenmp"]
_loaded: dict[str, object] = {}


def library_name() -> str:
    h = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS))
    h.update(f"{torch.__version__} {' '.join(CFLAGS + LDFLAGS)}".encode())
    return f"kvserve_paged_{h.hexdigest()[:12]}"


def library_path() -> Path:
    return BUILD_DIR / f"{library_name()}.so"


def build(verbose: bool = False) -> Path:
    """Compiles the kernel (ninja + the system C++ compiler, ~1 min on 2 cores); returns the library path."""
    from torch.utils import cpp_extension

    try:
        import ninja  # the pinned wheel ships the binary; put it on PATH for cpp_extension
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    for stale in BUILD_DIR.glob("kvserve_paged_*.so"):
        if stale.name != library_path().name:
            stale.unlink()
    cpp_extension.load(name=library_name(), sources=[str(src) for src in SOURCES], build_directory=str(BUILD_DIR),
                       extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), is_python_module=False, verbose=verbose)
    return library_path()


def load() -> bool:
    """Loads the built kernel once; False (and why, in `load_error()`) when it is not built."""
    if "ok" in _loaded:
        return _loaded["ok"]
    path = library_path()
    try:
        if not path.exists():
            raise FileNotFoundError(f"{path} is not built: run `make install` (or `python -m inference.native`)")
        torch.ops.load_library(str(path))
        torch.ops.kvserve_paged.set_isa(attn_isa_setting())  # one this CPU lacks fails the load
        # the kernels' threads start at torch's own count (a process that sets neither uses every core for both);
        # workers set theirs from their role and the host's budget (inference.threads)
        torch.ops.kvserve_paged.set_native_threads(max(1, min(64, torch.get_num_threads())))
        _loaded["ok"] = True
    except Exception as exc:  # a missing or broken build is a fallback, never a crash
        _loaded["ok"], _loaded["error"] = False, f"{type(exc).__name__}: {exc}"
    return _loaded["ok"]


def load_error() -> str | None:
    return _loaded.get("error")


def paged_attention(out, q, pool, layer, tables, context_lens, query_start, query_len, scale) -> None:
    if not _loaded.get("ok") and not load():
        raise RuntimeError(f"the paged-attention kernel is not available: {load_error()}")
    torch.ops.kvserve_paged.paged_attention(out, q, pool, layer, tables, context_lens, query_start, query_len, scale)


def paged_read(pool, layer, tables, context_lens, query_start, query_len) -> int:
    """The bytes paged_attention would read of `layer` for these rows, read (same units, threads, page walk and
    prefetch) with no attention: the sum of their 32-bit words mod 2**64 as a signed int. bench.attention's yardstick
    for the rate a decode step's scattered pages can be read at all."""
    if not _loaded.get("ok") and not load():
        raise RuntimeError(f"the paged-attention kernel is not available: {load_error()}")
    return torch.ops.kvserve_paged.paged_read(pool, layer, tables, context_lens, query_start, query_len)



def prefill_bf16_available() -> bool:
    """Whether prefill_attention_bf16 runs here: the library loaded, AVX-512 not capped away, AVX512-BF16."""
    return bool(fused_available() and torch.ops.kvserve_paged.prefill_bf16_available())


def prefill_attention_bf16(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
    """A fresh prompt's causal attention into out [T, H, D] (prefill.cpp, contiguous): q [T, H, D], k, v [T, KVH, D],
    all fp32, each row's heads contiguous (rows may lie any stride apart: views into a fused projection), rounded to
    bf16 and multiplied in bf16 dot products with fp32 sums (head_dim 32, 64 or 128)."""
    torch.ops.kvserve_paged.prefill_attention_bf16(out, q, k, v, scale)


def prefill_fp32_available() -> bool:
    """Whether prefill_attention_fp32 runs here: the library loaded and AVX-512 not capped away."""
    return bool(fused_available() and torch.ops.kvserve_paged.prefill_fp32_available())


def prefill_attention_fp32(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
    """prefill_attention_bf16's tiling in fp32 FMAs (prefill.cpp): the same arguments, nothing rounded; for an
    AVX-512 CPU without bf16 dot products, where torch's fp32 SDPA is the alternative."""
    if not fused_available():
        raise RuntimeError(f"the native kernels are not available: {load_error()}")
    torch.ops.kvserve_paged.prefill_attention_fp32(out, q, k, v, scale)


def attention_parts(keys: list[int]) -> list[int]:
    """How the kernel cuts items that see `keys` keys each: the parts of each (1: whole), whatever the threads."""
    if not _loaded.get("ok") and not load():
        raise RuntimeError(f"the paged-attention kernel is not available: {load_error()}")
    return list(torch.ops.kvserve_paged.attention_parts(keys))


def fused_available() -> bool:
    """Whether the fused ops are there (the library built and loaded)."""
    return _loaded.get("ok") or load()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a contiguous fp32 [T, 2 I] fused gate|up projection, [T, I] (fused.cpp: one AVX-512 pass;
    without AVX-512, torch's silu and mul)."""
    return torch.ops.kvserve_paged.silu_mul(gate_up)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a contiguous fp32 [rows, n], n > 0 (the first largest; a NaN counts as largest)."""
    return torch.ops.kvserve_paged.argmax_rows(x)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, to_bf16: bool) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dim of a contiguous fp32 [rows, h], in fp32 or bf16."""
    return torch.ops.kvserve_paged.rms_norm(x, w, eps, to_bf16)


def rope_store(qkv, cos, sin, pool, layer: int, pages, offsets, heads: int, kv_heads: int) -> torch.Tensor:
    """RoPE of a step's fused q|k|v [T, (heads + 2 kv_heads) * D] and its K/V written into the fp32 pool at
    (pages, offsets); returns q|k rotated, [T, heads + kv_heads, D] (fused.cpp)."""
    return torch.ops.kvserve_paged.rope_store(qkv, cos, sin, pool, layer, pages, offsets, heads, kv_heads)


def isa() -> str:
    """The build of the loop that runs: avx512, avx2 or generic."""
    if not _loaded.get("ok") and not load():
        raise RuntimeError(f"the paged-attention kernel is not available: {load_error()}")
    return torch.ops.kvserve_paged.isa()


def set_isa(name: str = "") -> str:
    """Forces avx512|avx2|generic ("" = the best this CPU runs); returns the one now in use."""
    if not _loaded.get("ok") and not load():
        raise RuntimeError(f"the paged-attention kernel is not available: {load_error()}")
    return torch.ops.kvserve_paged.set_isa(name)


def set_int8_passes(passes: int = 0) -> int:
    """The int8 pool's AVX-512 loop: 2 passes (the default: every score, one softmax, then V) or 1 (online softmax,
    fp32 and bf16 rows' loop); 0 only reads it. Returns the one in use (bench.attention times both)."""
    if not _loaded.get("ok") and not load():
        raise RuntimeError(f"the paged-attention kernel is not available: {load_error()}")
    return torch.ops.kvserve_paged.set_int8_passes(passes)


def w4a8_linear(x: torch.Tensor, nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [R, K] fp32 times Q4 blocks (nibbles uint8 [N, K/2], w = d * code + m per 32), activations quantized
    to int8 per 32 (quant.cpp); fp32 [R, N]."""
    return torch.ops.kvserve_paged.w4a8_linear(x, nibbles, d, m)


def w8a8_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [R, K] fp32 times Q8_0 blocks (q int8 [N, K], w = d * q per 32), activations int8 per 32; fp32 [R, N]."""
    return torch.ops.kvserve_paged.w8a8_linear(x, q, d)


def interleaved_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [R, K] fp32 times weights in quant.cpp's x16 (AVX-512 VNNI) or x8 (AVX2) layout (16 or 8 outputs
    interleaved per block), activations int8 per 32; fp32 [R, N]."""
    return torch.ops.kvserve_paged.interleaved_linear(x, codes, d, m)


def set_threads(n: int) -> int:
    """How many threads the native kernels' jobs may use (pool.cpp: the caller and n - 1 helpers that take
    chunks when free and are never waited for); returns it."""
    if not _loaded.get("ok") and not load():
        raise RuntimeError(f"the native kernels are not available: {load_error()}")
    return torch.ops.kvserve_paged.set_native_threads(n)


def wake_threads() -> None:
    """A step's jobs are coming: sleeping helpers wake now and spin for them (a step's Python work hides the wake)."""
    if _loaded.get("ok"):
        torch.ops.kvserve_paged.pool_wake()


def threads() -> int:
    if not _loaded.get("ok") and not load():
        return 1
    return torch.ops.kvserve_paged.native_threads()


def quant_isa(name: str = "") -> str:
    """The build of w4a8's loop in use (avx512 | avx2 | generic: packs the x16, the x8 or the file's layout); a name
    forces one ("best": the CPU's best)."""
    if not _loaded.get("ok") and not load():
        raise RuntimeError(f"the native kernels are not available: {load_error()}")
    return torch.ops.kvserve_paged.quant_isa(name)


def decode_layers(x, weights, cos, sin, pool, pages, offsets, paged, scale: float, heads: int, kv_heads: int,
                  eps: float) -> None:
    """Every w4a8 decoder layer over rows that all read the pool (`paged`: inference.attention.SeqBatch), x updated
    in place (layer.cpp); `weights`: Llama._native_layer_weights of each layer, in layer order, as one flat list."""
    torch.ops.kvserve_paged.decode_layers(x, weights, cos, sin, pool, pages, offsets, paged.tables,
                                          paged.context_lens, paged.query_start, paged.query_len, scale, heads,
                                          kv_heads, eps)

"""Small builders shared by the engine tests."""
import torch

from inference.engine import Engine, EngineConfig
from inference.kv_cache import pool_rows
from inference.sequence import SamplingParams


def make_engine(model, **config) -> Engine:
    config.setdefault("num_pages", 64)
    return Engine(model, EngineConfig(**config))


def greedy(max_tokens=16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def run_until_done(engine, seqs):
    while any(not s.is_done for s in seqs):
        engine.step()
    return seqs


def fill_pool_randn(pool, gen: torch.Generator) -> None:
    """Standard-normal K/V in every row of the pool, as it keeps them (an int8 pool: quantized rows and scales)."""
    values = torch.randn(pool.data.shape[:-1] + (pool.head_dim,), generator=gen)
    pool.data.copy_(pool_rows(values, pool.data.dtype))


def poison_page(pool, page: int) -> None:
    """NaN in every value of `page` (an int8 pool: NaN scales), so that a read of it shows in any output."""
    pool.data[page] = pool_rows(torch.full(pool.data.shape[1:-1] + (pool.head_dim,), float("nan")), pool.data.dtype)


def kernel_tolerance(dtype: torch.dtype) -> dict:
    """How close the native kernel's output must be to the fp32 reference over the same pool. fp32 and bf16 rows
    widen exactly (fp32 math; only the order of the sums differs). Over an int8 pool the AVX-512 loop takes q . K as
    int16 q times the codes (q over its largest |value| / 32767 per head: a rounding of at most 1.5e-5 of that value,
    ~250x finer than the codes' own): outputs within 1e-4 on unit-variance data (measured up to 7.3e-5; q truncated
    instead of rounded exceeds it)."""
    return {"rtol": 1e-5, "atol": 1e-4 if dtype == torch.int8 else 2e-5}

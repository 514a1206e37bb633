"""Helpers shared by the benchmarks: thread settings, medians, a plain table and the final JSON line.

Every bench module prints human-readable lines first and ends with exactly ONE JSON line
(`emit_json`), which `bench.all` collects.
"""
import json
import math
import os
import random
import statistics
import sys
import time

from inference.threads import torch_threads_apply

torch_threads_apply()  # every core unless KVSERVE_TORCH_THREADS says otherwise (--threads overrides)


def median(xs) -> float:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else float("nan")


def now() -> float:
    return time.perf_counter()


def _clean(value):
    """NaN/inf become null (strict JSON); floats are rounded to 4 decimals."""
    if isinstance(value, float):
        return round(value, 4) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def emit_json(data: dict) -> None:
    """The module's result: one JSON line, printed last (strict JSON: NaN becomes null), with the CPU's flags."""
    sys.stdout.flush()
    print(json.dumps(_clean({"cpu_flags": cpu_flags(), **data}), sort_keys=True, allow_nan=False), flush=True)


def fmt(value) -> str:
    if isinstance(value, float):
        if value != value:
            return "nan"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def print_table(rows: list[dict], columns: list[str] | None = None, title: str | None = None) -> None:
    if not rows:
        return
    columns = columns or list(rows[0])
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    if title:
        print(title)
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    sys.stdout.flush()


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def chat_prompts(tokenizer, n: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """n chat prompts (chat template applied) of deterministic, mixed lengths in [min_len, max_len]
    tokens: a user message of random vocabulary words, cut to the drawn length, template re-applied."""
    rng = random.Random(seed)
    words = ("the model serves requests from a paged cache while the scheduler batches decode steps "
             "and every page has an owner an epoch and a watermark that the guard checks before reads "
             "ocean river mountain forest city number seven twelve because although however quickly").split()
    overhead = len(tokenizer.encode_chat([{"role": "user", "content": ""}]))
    prompts = []
    for i in range(n):
        target = min_len + (max_len - min_len) * i // max(1, n - 1)  # spread evenly, then shuffled
        target = max(target, overhead + 1)
        text = " ".join(rng.choice(words) for _ in range(target))
        body = tokenizer.encode(text)[: target - overhead]
        ids = tokenizer.encode_chat([{"role": "user", "content": tokenizer.decode(body)}])
        while len(ids) > target:  # re-tokenization can merge differently: trim until it fits
            body = body[:-1]
            ids = tokenizer.encode_chat([{"role": "user", "content": tokenizer.decode(body)}])
        prompts.append(ids)
    rng.shuffle(prompts)
    return prompts


def cpu_flags(wanted=("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                      "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")) -> list[str]:
    """The SIMD flags of this CPU that matter to the kernels (from /proc/cpuinfo; [] where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return []
    have = set(line.split(":", 1)[-1].split())
    return [w for w in wanted if w in have]

"""The paged-attention kernel per decode step, old path (AVX2) vs new (AVX-512) side by side.

    python -m bench.attention [--seqs 32] [--context 512] [--repeats 7] [--no-step] [--quick] [--threads N]

Kernel: a pool shaped like the model (layers, heads, kv heads, head_dim from its config), `--seqs`
decode rows of `--context` tokens each on scattered 16-token pages; one call per layer is one decode
step's attention. Each ISA (`kvserve_paged::set_isa`) is timed in interleaved rounds; the figure is
the median. KV read per step and its rate are printed with it.
Step (unless --no-step): the real engine with `--seqs` prompts of `--context` tokens, prefilled once,
then decode steps timed under each ISA in turn: the kernel's fraction of a decode step.
Ends with one JSON line (ms per ISA, ratio, fractions, CPU flags, threads).
"""
import argparse
import random
import time

import torch

from bench.common import chat_prompts, cpu_flags, emit_json, log, median, print_table
from inference import native
from inference.kv_cache import PagePool, cdiv
from inference.threads import threads_set

PAGE = 16


def isas() -> list[str]:
    best = native.set_isa("")
    order = ["avx2", "avx512"] if best == "avx512" else [best]
    return order


def kernel_case(layers, h, kvh, d, seqs, context, seed=0):
    pages_per = cdiv(context, PAGE)
    pool = PagePool(seqs * pages_per + 8, PAGE, layers, kvh, d)
    pool.data.normal_(generator=torch.Generator().manual_seed(seed))
    ids = list(range(pool.num_pages))
    random.Random(seed).shuffle(ids)
    tables = torch.tensor([ids[i * pages_per:(i + 1) * pages_per] for i in range(seqs)], dtype=torch.int32)
    q = torch.randn(seqs, h, d)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return pool, q, tables, i32([context] * seqs), i32(list(range(seqs))), i32([1] * seqs)


def time_kernel_step(pool, q, tables, lens, starts, qlens) -> float:
    """Seconds for one decode step's attention: one call per layer."""
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    t0 = time.perf_counter()
    for layer in range(pool.num_layers):
        torch.ops.kvserve_paged.paged_attention(out, q, pool.data, layer, tables, lens, starts, qlens, scale)
    return time.perf_counter() - t0


def engine_steps(model, seqs, context, names, repeats) -> dict:
    """Median decode-step seconds with the kernel under each ISA (the same running batch, interleaved)."""
    from inference.engine import Engine, EngineConfig
    from inference.sequence import SamplingParams, SeqStatus

    prompts = chat_prompts(model.tokenizer, seqs, context, context, seed=0)
    steps = repeats * len(names) * 2 + 4
    engine = Engine(model, EngineConfig(num_pages=seqs * cdiv(context + steps + 8, PAGE) + 64, page_size=PAGE,
                                        chunk_size=512, max_num_seqs=max(64, seqs)))
    t0 = time.perf_counter()
    sq = [engine.add_request(f"attn-{i}", p, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
          for i, p in enumerate(prompts)]
    while any(s.status is not SeqStatus.RUNNING for s in sq):
        engine.step()
    log(f"prefilled {seqs} x {len(prompts[0])} tokens in {time.perf_counter() - t0:.1f}s")
    engine.step()
    times = {n: [] for n in names}
    for _ in range(repeats):
        for n in names:
            native.set_isa(n)
            t = time.perf_counter()
            engine.step()
            engine.step()
            times[n].append((time.perf_counter() - t) / 2)
    return {n: median(v) for n, v in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-step", action="store_true", help="kernel only (no model, no engine step)")
    parser.add_argument("--quick", action="store_true", help="8 sequences x 128 tokens, 3 rounds")
    parser.add_argument("--threads", type=int, help="torch threads (default: all CPUs)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seqs, args.context, args.repeats = 8, 128, 3
    if args.threads:
        threads_set(args.threads)
    if not native.load():
        raise SystemExit(f"the kernel is not built: {native.load_error()}")
    model = None
    shape = dict(layers=30, h=9, kvh=3, d=64)  # SmolLM2-135M
    if not args.no_step:
        from inference.loader import load_model

        model = load_model()
        c = model.config
        shape = dict(layers=c.num_layers, h=c.num_heads, kvh=c.num_kv_heads, d=c.head_dim)
    names = isas()
    case = kernel_case(**shape, seqs=args.seqs, context=args.context)
    kv_bytes = 2 * args.seqs * args.context * shape["kvh"] * shape["d"] * 4 * shape["layers"]
    log(f"bench.attention: {args.seqs} x {args.context} tokens, {shape}, ISAs {names}, "
        f"{torch.get_num_threads()} threads, flags {' '.join(cpu_flags())}")
    for n in names:  # warm
        native.set_isa(n)
        time_kernel_step(*case)
    kt = {n: [] for n in names}
    for _ in range(args.repeats):
        for n in names:
            native.set_isa(n)
            kt[n].append(time_kernel_step(*case))
    kernel = {n: median(v) for n, v in kt.items()}
    step = engine_steps(model, args.seqs, args.context, names, max(3, args.repeats // 2)) if model else {}
    native.set_isa("")
    rows = [dict(isa=n, kernel_ms_per_step=kernel[n] * 1e3, kv_gb_s=kv_bytes / kernel[n] / 1e9,
                 step_ms=step.get(n, float("nan")) * 1e3,
                 kernel_fraction_of_step=kernel[n] / step[n] if n in step else float("nan")) for n in names]
    print_table(rows, title=f"bench.attention: {args.seqs} decode rows x {args.context} tokens, {shape['layers']} layers "
                            f"({kv_bytes / 1e6:.0f} MB of K/V per step), medians of {args.repeats}")
    old, new = names[0], names[-1]
    ratio = kernel[old] / kernel[new]
    print(f"{old} -> {new}: kernel {ratio:.2f}x faster per decode step")
    emit_json(dict(quick=args.quick, seqs=args.seqs, context=args.context, **shape, threads=torch.get_num_threads(),
                   cpu_flags=cpu_flags(), isas=names, speedup=ratio,
                   **{f"kernel_ms_{n}": kernel[n] * 1e3 for n in names},
                   **{f"kv_gb_s_{n}": kv_bytes / kernel[n] / 1e9 for n in names},
                   **{f"step_ms_{n}": step[n] * 1e3 for n in step},
                   **{f"kernel_fraction_{n}": kernel[n] / step[n] for n in step}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

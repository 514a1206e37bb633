"""The paged-attention kernel per decode step: its builds (AVX2, AVX-512) and its pools (fp32, bf16) side by side.

    python -m bench.attention [--seqs 32] [--context 512] [--repeats 7] [--kv-dtypes float32,bfloat16,int8]
                              [--precision w4a8] [--no-step] [--quick] [--threads N]

Kernel: a pool shaped like the model (layers, heads, kv heads, head_dim from its config) in each KV dtype, `--seqs`
decode rows of `--context` tokens each on scattered 16-token pages; one call per layer is one decode step's
attention. Each (ISA, dtype) is timed in interleaved rounds; the figure is the median. KV read per step and its
rate are printed with it.
Step (unless --no-step): the real engine in `--precision` over each KV dtype, `--seqs` prompts of `--context` tokens
prefilled once, then decode steps timed in interleaved rounds: the kernel's fraction of a decode step.
Ends with one JSON line (ms per ISA and dtype, ratios, fractions, CPU flags, threads).
"""
import argparse
import random
import time

import torch

from bench.common import chat_prompts, cpu_flags, emit_json, log, median, print_table
from inference import native
from inference.kv_cache import PagePool, cdiv, pool_rows
from inference.threads import threads_set

PAGE = 16


def isas() -> list[str]:
    best = native.set_isa("")
    order = ["avx2", "avx512"] if best == "avx512" else [best]
    return order


def kernel_case(layers, h, kvh, d, seqs, context, seed=0, dtype=torch.float32):
    pages_per = cdiv(context, PAGE)
    pool = PagePool(seqs * pages_per + 8, PAGE, layers, kvh, d, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    for page in range(pool.num_pages):  # normal values, as the pool keeps them (an int8 pool: quantized rows)
        pool.data[page] = pool_rows(torch.randn(pool.data.shape[1:-1] + (d,), generator=gen), dtype)
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


def engine_steps(model, seqs, context, dtypes, precision, repeats) -> dict:
    """Median decode-step seconds of an engine in `precision` over each KV dtype (interleaved rounds)."""
    from inference.engine import Engine, EngineConfig
    from inference.sequence import SamplingParams, SeqStatus

    prompts = chat_prompts(model.tokenizer, seqs, context, context, seed=0)
    # the first sequences decode while the others prefill (one 512-token chunk a step): none may finish before all do
    max_tokens = repeats * 2 + 8 + seqs * cdiv(context, 512)
    engines = {}
    for dtype in dtypes:
        engine = Engine(model, EngineConfig(num_pages=seqs * cdiv(context + max_tokens + 8, PAGE) + 64, page_size=PAGE,
                                            chunk_size=512, max_num_seqs=max(64, seqs), precision=precision,
                                            kv_dtype=dtype))
        t0 = time.perf_counter()
        sq = [engine.add_request(f"attn-{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
              for i, p in enumerate(prompts)]
        while any(s.status is not SeqStatus.RUNNING for s in sq):
            engine.step()
        log(f"{precision} over a {dtype} pool: prefilled {seqs} x {len(prompts[0])} tokens in "
            f"{time.perf_counter() - t0:.1f}s")
        engine.step()
        engines[dtype] = engine
    times = {d: [] for d in dtypes}
    for _ in range(repeats):
        for dtype, engine in engines.items():
            t = time.perf_counter()
            engine.step()
            engine.step()
            times[dtype].append((time.perf_counter() - t) / 2)
    return {d: median(v) for d, v in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kv-dtypes", default="float32,bfloat16,int8", help="pools to time, comma-separated")
    parser.add_argument("--precision", default="w4a8", help="the engine's matmul precision for the step figures")
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
    dtypes = [d.strip() for d in args.kv_dtypes.split(",") if d.strip()]
    model = None
    shape = dict(layers=30, h=9, kvh=3, d=64)  # SmolLM2-135M
    if not args.no_step:
        from inference.loader import load_model

        model = load_model()
        c = model.config
        shape = dict(layers=c.num_layers, h=c.num_heads, kvh=c.num_kv_heads, d=c.head_dim)
    names = isas()
    cases = {d: kernel_case(**shape, seqs=args.seqs, context=args.context, dtype=getattr(torch, d)) for d in dtypes}
    kv_bytes = {d: 2 * args.seqs * args.context * shape["kvh"] * shape["layers"] * cases[d][0].data.shape[-1] *
                cases[d][0].data.element_size() for d in dtypes}  # an int8 row: its codes and its scale
    combos = [(n, d) for d in dtypes for n in names]
    log(f"bench.attention: {args.seqs} x {args.context} tokens, {shape}, ISAs {names}, pools {dtypes}, "
        f"{torch.get_num_threads()} threads, flags {' '.join(cpu_flags())}")
    for n, d in combos:  # warm
        native.set_isa(n)
        time_kernel_step(*cases[d])
    kt = {c: [] for c in combos}
    for _ in range(args.repeats):
        for n, d in combos:
            native.set_isa(n)
            kt[(n, d)].append(time_kernel_step(*cases[d]))
    native.set_isa("")
    kernel = {c: median(v) for c, v in kt.items()}
    step = engine_steps(model, args.seqs, args.context, dtypes, args.precision, max(3, args.repeats // 2)) \
        if model else {}
    best = names[-1]
    rows = [dict(isa=n, kv_dtype=d, kernel_ms_per_step=kernel[(n, d)] * 1e3,
                 kv_gb_s=kv_bytes[d] / kernel[(n, d)] / 1e9,
                 step_ms=step[d] * 1e3 if n == best and d in step else float("nan"),
                 kernel_fraction_of_step=kernel[(n, d)] / step[d] if n == best and d in step else float("nan"))
            for n, d in combos]
    print_table(rows, title=f"bench.attention: {args.seqs} decode rows x {args.context} tokens, {shape['layers']} "
                            f"layers, step in {args.precision}, medians of {args.repeats}")
    out = dict(quick=args.quick, seqs=args.seqs, context=args.context, **shape, threads=torch.get_num_threads(),
               cpu_flags=cpu_flags(), isas=names, kv_dtypes=dtypes, precision=args.precision,
               **{f"kernel_ms_{n}_{d}": kernel[(n, d)] * 1e3 for n, d in combos},
               **{f"kv_gb_s_{n}_{d}": kv_bytes[d] / kernel[(n, d)] / 1e9 for n, d in combos},
               **{f"step_ms_{d}": step[d] * 1e3 for d in step},
               **{f"kernel_fraction_{d}": kernel[(best, d)] / step[d] for d in step})
    if len(names) > 1:
        out["speedup_isa"] = kernel[(names[0], dtypes[0])] / kernel[(best, dtypes[0])]
        print(f"{names[0]} -> {best}: kernel {out['speedup_isa']:.2f}x faster per decode step ({dtypes[0]} pool)")
    for slow, fast, name in (("float32", "bfloat16", "bf16"), ("bfloat16", "int8", "int8")):
        if {slow, fast} <= set(dtypes):
            out[f"speedup_{name}_pool"] = kernel[(best, slow)] / kernel[(best, fast)]
            print(f"{slow} -> {fast} pool: kernel {out[f'speedup_{name}_pool']:.2f}x faster per decode step ({best})")
            if step:
                out[f"step_speedup_{name}_pool"] = step[slow] / step[fast]
                print(f"{slow} -> {fast} pool: {args.precision} decode step {out[f'step_speedup_{name}_pool']:.2f}x, "
                      f"kernel {kernel[(best, slow)] / step[slow]:.0%} -> {kernel[(best, fast)] / step[fast]:.0%} of it")
    emit_json(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The paged-attention kernel per decode step: its builds (AVX2, AVX-512) and its pools (fp32, bf16) side by side;
a fresh prompt's attention in each way this CPU runs it.

    python -m bench.attention [--seqs 32] [--context 512] [--repeats 7] [--kv-dtypes float32,bfloat16,int8]
                              [--precision w4a8] [--no-step] [--quick] [--threads N] [--prompt 500]

Kernel: a pool shaped like the model (layers, heads, kv heads, head_dim from its config) in each KV dtype, `--seqs`
decode rows of `--context` tokens each on scattered 16-token pages; one call per layer is one decode step's
attention. Each (ISA, dtype) is timed in interleaved rounds; the figure is the median. KV read per step and its
rate are printed with it. The pool sits on huge pages where the kernel gives them (inference.hugepages, as the
engine's does); its bytes copied to plain 4 KB pages are timed in the same rounds under the best ISA (the TLB's
share of the kernel's time).
Step (unless --no-step): the real engine in `--precision` over each KV dtype, `--seqs` prompts of `--context` tokens
prefilled once, then decode steps timed in interleaved rounds: the kernel's fraction of a decode step.
The machine's yardstick, timed in the same rounds: a plain sum over as many contiguous bytes as the largest pool's
K/V per step, with the same threads (`stream_gb_s`): how close each kernel's read comes to it, and the fraction of
the step a kernel at that rate would take (`fraction_floor_<dtype>`: the least any kernel reading these bytes gets).
And the pool's own pages read as the kernel walks them (the same units, threads and prefetch, no attention:
inference.native.paged_read): `page_read_gb_s_<dtype>`, the kernel's time against it
(`kernel_share_of_page_read_<dtype>`: 1.0 = bound by reading its scattered pages) and the fraction of the step a
kernel at that rate would take (`fraction_floor_pages_<dtype>`).
Fresh prompt: one `--prompt`-token chunk attending its own K/V (the model's heads) as a prefill over a bf16 pool
does, in every kind inference.attention times at start (torch's fp32 SDPA, kvserve's fp32 and AVX512-BF16 kernels,
torch's bf16 SDPA; those this CPU runs), interleaved rounds, median ms per layer, each kind's speedup over torch's
fp32 SDPA, and the kind the engine picks here (`fresh_pick`).
Ends with one JSON line (ms per ISA and dtype, ratios, fractions, CPU flags, threads).
"""
import argparse
import random
import time
from types import SimpleNamespace

import torch

from bench.common import chat_prompts, cpu_flags, emit_json, log, median, print_table
from inference import native
from inference.attention import fresh_bf16_kind, fresh_runs
from inference.hugepages import huge_share, thp_mode
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


def small_pages_copy(pool) -> SimpleNamespace:
    """`pool`'s bytes in plain memory (4 KB pages where THP is `madvise`), for time_kernel_step."""
    data = torch.empty(pool.data.shape, dtype=pool.data.dtype)
    data.copy_(pool.data)
    return SimpleNamespace(data=data, num_layers=pool.num_layers)


def time_kernel_step(pool, q, tables, lens, starts, qlens) -> float:
    """Seconds for one decode step's attention: one call per layer."""
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    t0 = time.perf_counter()
    for layer in range(pool.num_layers):
        torch.ops.kvserve_paged.paged_attention(out, q, pool.data, layer, tables, lens, starts, qlens, scale)
    return time.perf_counter() - t0


def time_stream(buf) -> float:
    """Seconds for a plain read of `buf` (a contiguous sum over the torch threads): the yardstick of bytes per second."""
    t0 = time.perf_counter()
    buf.sum()
    return time.perf_counter() - t0


def time_page_read(pool, q, tables, lens, starts, qlens) -> float:
    """Seconds for reading what one decode step's attention reads, page by page as the kernel walks them, with no
    attention (inference.native.paged_read): the yardstick for scattered pages, as time_stream is for plain memory."""
    t0 = time.perf_counter()
    for layer in range(pool.num_layers):
        native.paged_read(pool.data, layer, tables, lens, starts, qlens)
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


def fresh_prompt_ms(tokens: int, h: int, kvh: int, d: int, repeats: int) -> dict:
    """Median ms of one layer's attention of a fresh `tokens`-token chunk over its own K/V, per kind this CPU runs
    (inference.attention.FRESH_KINDS), interleaved rounds of three calls."""
    gen = torch.Generator().manual_seed(1)
    runs = fresh_runs(*(torch.randn(tokens, n, d, generator=gen) for n in (h, kvh, kvh)))
    times = {kind: [] for kind in runs}
    for run in runs.values():  # warm
        run()
    for _ in range(repeats):
        for kind, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(3):
                run()
            times[kind].append((time.perf_counter() - t0) / 3 * 1e3)
    return {kind: median(v) for kind, v in times.items()}


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
    parser.add_argument("--prompt", type=int, default=500, help="tokens of the fresh prompt whose attention is timed")
    args = parser.parse_args(argv)
    if args.quick:
        args.seqs, args.context, args.repeats, args.prompt = 8, 128, 3, 96
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
    best = names[-1]
    # the same pools' bytes on 4 KB pages (plain memory), timed beside the pools' own huge pages under the best ISA
    small = {d: (small_pages_copy(cases[d][0]),) + cases[d][1:] for d in dtypes}
    huge = {d: huge_share(cases[d][0].data) for d in dtypes}
    log(f"bench.attention: {args.seqs} x {args.context} tokens, {shape}, ISAs {names}, pools {dtypes} "
        f"(huge pages: {', '.join(f'{d} {f:.0%}' for d, f in huge.items())}; THP {thp_mode() or 'absent'}), "
        f"{torch.get_num_threads()} threads, flags {' '.join(cpu_flags())}")
    timed = [(n, d, cases[d]) for n, d in combos] + [(best, f"{d}/4k", small[d]) for d in dtypes]
    # the int8 pool's AVX-512 loop in one pass (online softmax, as fp32 and bf16 rows run) beside its default two
    one_pass = "int8" in dtypes and best == "avx512"
    if one_pass:
        timed.append((best, "int8/1pass", cases["int8"]))
    stream = torch.ones(max(kv_bytes.values()) // 4)
    time_stream(stream)
    for n, d, case in timed:  # warm
        native.set_isa(n)
        native.set_int8_passes(1 if d == "int8/1pass" else 2)
        time_kernel_step(*case)
    for d in dtypes:
        time_page_read(*cases[d])
    kt = {(n, d): [] for n, d, _ in timed}
    st = []
    rt = {d: [] for d in dtypes}
    for _ in range(args.repeats):
        st.append(time_stream(stream))
        for d in dtypes:
            rt[d].append(time_page_read(*cases[d]))
        for n, d, case in timed:
            native.set_isa(n)
            native.set_int8_passes(1 if d == "int8/1pass" else 2)
            kt[(n, d)].append(time_kernel_step(*case))
    native.set_isa("")
    native.set_int8_passes(2)
    kernel = {c: median(v) for c, v in kt.items()}
    stream_gb_s = stream.numel() * 4 / median(st) / 1e9
    page_read = {d: median(v) for d, v in rt.items()}
    step = engine_steps(model, args.seqs, args.context, dtypes, args.precision, max(3, args.repeats // 2)) \
        if model else {}
    rows = [dict(isa=n, kv_dtype=d, kernel_ms_per_step=kernel[(n, d)] * 1e3,
                 kv_gb_s=kv_bytes[d] / kernel[(n, d)] / 1e9,
                 step_ms=step[d] * 1e3 if n == best and d in step else float("nan"),
                 kernel_fraction_of_step=kernel[(n, d)] / step[d] if n == best and d in step else float("nan"))
            for n, d in combos]
    rows += [dict(isa=best, kv_dtype=f"{d} (4 KB pages)", kernel_ms_per_step=kernel[(best, f"{d}/4k")] * 1e3,
                  kv_gb_s=kv_bytes[d] / kernel[(best, f"{d}/4k")] / 1e9, step_ms=float("nan"),
                  kernel_fraction_of_step=float("nan")) for d in dtypes]
    if one_pass:
        rows.append(dict(isa=best, kv_dtype="int8 (one pass)", kernel_ms_per_step=kernel[(best, "int8/1pass")] * 1e3,
                         kv_gb_s=kv_bytes["int8"] / kernel[(best, "int8/1pass")] / 1e9, step_ms=float("nan"),
                         kernel_fraction_of_step=float("nan")))
    print_table(rows, title=f"bench.attention: {args.seqs} decode rows x {args.context} tokens, {shape['layers']} "
                            f"layers, step in {args.precision}, medians of {args.repeats}")
    out = dict(quick=args.quick, seqs=args.seqs, context=args.context, **shape, threads=torch.get_num_threads(),
               cpu_flags=cpu_flags(), isas=names, kv_dtypes=dtypes, precision=args.precision,
               **{f"kernel_ms_{n}_{d}": kernel[(n, d)] * 1e3 for n, d in combos},
               **{f"kv_gb_s_{n}_{d}": kv_bytes[d] / kernel[(n, d)] / 1e9 for n, d in combos},
               **{f"step_ms_{d}": step[d] * 1e3 for d in step},
               **{f"kernel_fraction_{d}": kernel[(best, d)] / step[d] for d in step},
               thp=thp_mode(), **{f"huge_page_share_{d}": huge[d] for d in dtypes},
               **{f"kernel_ms_4k_{d}": kernel[(best, f"{d}/4k")] * 1e3 for d in dtypes},
               **{f"speedup_hugepages_{d}": kernel[(best, f"{d}/4k")] / kernel[(best, d)] for d in dtypes},
               stream_gb_s=stream_gb_s,
               **{f"kernel_share_of_stream_{d}": kv_bytes[d] / kernel[(best, d)] / 1e9 / stream_gb_s for d in dtypes},
               **{f"page_read_gb_s_{d}": kv_bytes[d] / page_read[d] / 1e9 for d in dtypes},
               **{f"kernel_share_of_page_read_{d}": page_read[d] / kernel[(best, d)] for d in dtypes})
    print(f"a plain read of {stream.numel() * 4 / 1e6:.0f} MB: {stream_gb_s:.1f} GB/s; the {best} kernel reads at "
          + ", ".join(f"{out[f'kernel_share_of_stream_{d}']:.0%} of it ({d})" for d in dtypes))
    print("the same pages read as the kernel walks them, no attention: " + ", ".join(
        f"{d} {out[f'page_read_gb_s_{d}']:.1f} GB/s (the kernel at {out[f'kernel_share_of_page_read_{d}']:.0%} of it)"
        for d in dtypes))
    for d in step:  # a kernel reading this pool's bytes at the plain read's rate, the rest of the step as measured
        floor_s = kv_bytes[d] / (stream_gb_s * 1e9)
        out[f"fraction_floor_{d}"] = floor_s / (step[d] - kernel[(best, d)] + floor_s)
        out[f"fraction_floor_pages_{d}"] = page_read[d] / (step[d] - kernel[(best, d)] + page_read[d])
        print(f"{d} pool: kernel {kernel[(best, d)] / step[d]:.1%} of the {args.precision} step; at the plain read's "
              f"rate {out[f'fraction_floor_{d}']:.1%}, at the pages' read rate {out[f'fraction_floor_pages_{d}']:.1%}")
    for d in dtypes:
        print(f"4 KB -> huge pages ({huge[d]:.0%} of the pool): kernel {out[f'speedup_hugepages_{d}']:.2f}x faster per "
              f"decode step ({d} pool, {best})")
    if one_pass:
        out["kernel_ms_1pass_int8"] = kernel[(best, "int8/1pass")] * 1e3
        out["speedup_int8_two_pass"] = kernel[(best, "int8/1pass")] / kernel[(best, "int8")]
        print(f"int8 pool, one pass -> two passes: kernel {out['speedup_int8_two_pass']:.2f}x faster per decode step "
              f"({best})")
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
    fresh = fresh_prompt_ms(args.prompt, shape["h"], shape["kvh"], shape["d"], args.repeats)
    out.update(prompt_tokens=args.prompt, fresh_pick=fresh_bf16_kind(),
               **{f"fresh_ms_{kind}": ms for kind, ms in fresh.items()},
               **{f"fresh_speedup_{kind}": fresh["fp32"] / ms for kind, ms in fresh.items() if kind != "fp32"})
    print(f"a fresh {args.prompt}-token prompt's attention, one layer: "
          + ", ".join(f"{kind} {ms:.2f} ms" + (f" ({fresh['fp32'] / ms:.2f}x)" if kind != "fp32" else "")
                      for kind, ms in fresh.items()) + f"; the engine here picks {out['fresh_pick']}")
    emit_json(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

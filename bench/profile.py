"""Where a decode step's time goes: torch profiler over decode steps of bench.engine's c32 workload (or its
first --seqs prompts), each op's self time put in one of a few buckets, the rest of the step's wall time is host.

    python -m bench.profile [--steps 12] [--quick] [--threads N] [--seqs 32] [--precision fp32] [--kv-dtype auto]

Workload: bench.engine's 32 mixed-length chat prompts (16..512 tokens), prefilled first; then the
profiled decode steps (all 32 sequences decoding, max_tokens large enough that none finishes).
Buckets (self CPU time of the ops on the engine thread, summed over the profiled steps):

  matmul     aten::mm / addmm / linear / mkldnn::_linear_pointwise / int4pack / w4a8's kvserve_paged::w4a8_linear
             and w8a8_linear (the projections, the MLP, the logits)
  attention  SDPA and the paged-attention kernel (kvserve_paged::paged_attention; the fused norm and RoPE ops are
             other_ops)
  gather     index_select / index (K/V page copies; 0 when attention reads pages in place)
  kv_write   index_put_ (this step's K/V into the pool)
  other_ops  every other aten op (RMSNorm, RoPE, SiLU, adds, embedding, sampling, tensor building)
  host       step wall time minus all of the above: Python, the scheduler, the guard, detokenization

Ends with one JSON line: ms per step and the fraction of each bucket, the unprofiled step's median over the
matmuls' time (`step_over_matmul`: issue 23's one-sequence target is 1.5), plus the process CPU time of
an unprofiled step (`step_cpu_ms_median`): with --threads 1 on a shared machine it is the figure
that other processes' load does not inflate (wall time does).
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import cpu_flags, emit_json, log, print_table
from bench.engine import make_engine, workload
from inference.loader import load_model
from inference.sequence import SamplingParams, SeqStatus
from inference.threads import threads_set

BUCKETS = ("matmul", "attention", "gather", "kv_write", "other_ops", "host")


def bucket_of(name: str) -> str:
    if name == "kvserve_paged::paged_attention" or "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::baddbmm",
                "mkldnn::_linear_pointwise", "aten::_weight_int4pack_mm_for_cpu", "kvserve_paged::w4a8_linear",
                "kvserve_paged::w8a8_linear", "kvserve_paged::interleaved_linear"):
        return "matmul"
    if name in ("aten::index_select", "aten::index"):
        return "gather"
    if name in ("aten::index_put_", "aten::_index_put_impl_"):
        return "kv_write"
    return "other_ops"


def profile_steps(engine, prompts, steps: int) -> dict:
    tag = time.monotonic_ns()
    seqs = [engine.add_request(f"prof-{tag}-{i}", p, SamplingParams(max_tokens=3 * steps + 64, ignore_eos=True))
            for i, p in enumerate(prompts)]
    while any(s.status is not SeqStatus.RUNNING for s in seqs):
        engine.step()
    for _ in range(2):  # warm
        engine.step()
    plain, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        plain.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    for s in seqs:
        engine.abort(s.request_id)
        engine.seqs.pop(s.request_id, None)
    spent = dict.fromkeys(BUCKETS, 0.0)
    ops = {}
    for evt in prof.key_averages():
        us = evt.self_cpu_time_total
        spent[bucket_of(evt.key)] += us / 1e6
        ops[evt.key] = ops.get(evt.key, 0) + us / 1e6
    spent["host"] = max(0.0, wall - sum(spent.values()))
    total = sum(spent.values())
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:12]
    plain.sort()
    cpu.sort()
    matmul_ms = spent["matmul"] / steps * 1e3
    return dict(step_ms_profiled=wall / steps * 1e3, step_ms_median=plain[len(plain) // 2] * 1e3,
                step_over_matmul=plain[len(plain) // 2] * 1e3 / matmul_ms if matmul_ms else None,
                step_cpu_ms_median=cpu[len(cpu) // 2] * 1e3,
                **{f"fraction_{b}": spent[b] / total for b in BUCKETS},
                **{f"ms_{b}": spent[b] / steps * 1e3 for b in BUCKETS},
                top_ops_ms={k: round(v / steps * 1e3, 2) for k, v in top})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="8 short prompts, 3 steps")
    parser.add_argument("--threads", type=int, help="torch threads (default: all CPUs)")
    parser.add_argument("--seqs", type=int, default=32, help="decode this many of the workload's prompts (1: one stream)")
    parser.add_argument("--precision", default="fp32", help="the engine's matmul precision (inference.precision)")
    parser.add_argument("--kv-dtype", default="auto", help="the KV pool's dtype (auto: the precision's, "
                        "inference.precision.kv_dtype_for)")
    args = parser.parse_args(argv)
    if args.threads:
        threads_set(args.threads)
    model = load_model()
    prompts = workload(model.tokenizer, args.quick)["prompts"][:args.seqs]
    steps = 3 if args.quick else args.steps
    engine = make_engine(model, prompts, [3 * steps + 64] * len(prompts), args.precision, args.kv_dtype)
    result = profile_steps(engine, prompts, steps)
    result.update(num_seqs=len(prompts), steps=steps, threads=torch.get_num_threads(), quick=args.quick,
                  attention_backend=engine.attention_backend, precision=engine.precision, kv_dtype=engine.kv_dtype,
                  cpu_flags=cpu_flags())
    log("top ops (ms per step): " + ", ".join(f"{k} {v}" for k, v in result["top_ops_ms"].items()))
    print_table([dict(bucket=b, ms_per_step=result[f"ms_{b}"], fraction=result[f"fraction_{b}"]) for b in BUCKETS],
                title=f"bench.profile: {len(prompts)}-sequence decode step, {result['step_ms_profiled']:.0f} ms "
                      f"profiled ({result['step_ms_median']:.0f} ms unprofiled median), {torch.get_num_threads()} threads")
    emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Both cores busy on one host: `python -m bench.cores [--clients 8 --seconds 30 --rounds 2 --modes fixed,lend]`.

Starts kvserve as `make run` does (a prefill and a decode worker on this host) with each
KVSERVE_THREAD_BUDGET of `--modes`: fixed (each worker keeps half the cores), lend (a worker with work lends its
native kernels every core while the other has none; inference/threads.py CoreBudget) and shared (torch's threads
too), rounds rotating the order, and runs the same chat load against each: tokens/s and latency side by side, each
mode's ratio of medians to fixed and one JSON line with the CPU's flags.
"""
import argparse
import os
import tempfile
from pathlib import Path

from bench.common import cpu_flags, emit_json, log, median, print_table
from bench.peer import REDIS_URL, kvserve_stack, measure


def run(mode: str, args, workdir: Path) -> dict:
    stack = kvserve_stack(workdir / mode, args.redis_url)
    stack.env["KVSERVE_THREAD_BUDGET"] = mode
    stack.env.pop("KVSERVE_TORCH_THREADS", None)
    try:
        stack.start()
        stack.wait_workers("prefill", 1, timeout_s=180)
        stack.wait_workers("decode", 1, timeout_s=180)
        return {"mode": mode, **measure(stack.url, stack.api_key, args.clients, args.seconds, args.max_tokens)}
    finally:
        stack.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--modes", default="fixed,lend", help="KVSERVE_THREAD_BUDGET values; the first is the yardstick")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="bench-cores-"))
    rows = []
    for r in range(args.rounds):
        for mode in modes[r % len(modes):] + modes[: r % len(modes)]:
            log(f"round {r + 1}: KVSERVE_THREAD_BUDGET={mode}")
            rows.append({"round": r + 1, **run(mode, args, workdir / str(r))})
    print_table(rows, ["round", "mode", "requests", "errors", "tok_s", "ttft_p50_s", "latency_p50_s"],
                title=f"{args.clients} clients x {args.seconds:.0f}s, {os.cpu_count()} cores")
    tok = {m: median([x["tok_s"] for x in rows if x["mode"] == m]) for m in modes}
    lat = {m: median([x["latency_p50_s"] for x in rows if x["mode"] == m]) for m in modes}
    base = modes[0]
    ratios = {f"ratio_{m}_vs_{base}": tok[m] / tok[base] if tok[base] else float("nan") for m in modes[1:]}
    for m in modes[1:]:
        print(f"{m}/{base} tokens/s: {ratios[f'ratio_{m}_vs_{base}']:.3f}x (medians {tok[m]:.1f} vs {tok[base]:.1f})")
    emit_json({"bench": "cores", "clients": args.clients, "seconds": args.seconds, "rounds": args.rounds,
               "cores": os.cpu_count(), "cpu_flags": cpu_flags(), "tok_s": tok, "latency_p50_s": lat, **ratios,
               "errors": sum(x["errors"] for x in rows)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

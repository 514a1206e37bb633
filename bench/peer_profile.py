"""Where kvserve's stack spends its time under bench.peer's load: py-spy samples every process of the
stack (prefill and decode workers, web) during the timed load; each worker's engine-loop thread is
bucketed by the innermost kvserve/torch frame that names a bucket.

    pip install --no-deps --target var/peer/tools py-spy==0.4.3    # once (ignored directory)
    python -m bench.peer_profile [--clients 32] [--seconds 30] [--out var/peer/profile]

Buckets are wall-clock samples (50 Hz) of the engine-loop thread: `waiting` is the loop waiting for
work (WorkerRuntime._drain); the rest is the step. Ends with one JSON line.
"""
import argparse
import asyncio
import collections
import re
import subprocess
import tempfile
from pathlib import Path

from bench import peer
from bench.common import emit_json, print_table
from bench.load import run_load, summarize

PY_SPY = peer.PEER_DIR / "tools" / "bin" / "py-spy"
BUCKETS = [  # (name, frame pattern): the first bucket whose pattern matches a frame, innermost frame first
    ("waiting", re.compile(r"WorkerRuntime\._drain|Event\.wait|Condition\.wait")),
    ("logits (fp32 matmul)", re.compile(r"Llama\.logits")),
    ("attention kernel", re.compile(r"paged_attention|sdpa")),
    ("projections + MLP (fp32 matmul)", re.compile(r"_onednn_linear|linear|matmul")),
    ("other model ops (norm, RoPE, KV write)", re.compile(r"Llama\.|PagePool\.write")),
    ("output stream (Redis XADD per step)", re.compile(r"OutputStream\.")),
    ("ledger / guard (Redis)", re.compile(r"RedisLedger|guard\.py|ledger\.py")),
    ("KV handoff", re.compile(r"handoff|transfer")),
    ("sampling, detokenize", re.compile(r"sample|tokenizer|Detok")),
    ("scheduler, step building, worker loop", re.compile(r"inference/")),
]


def bucket_samples(raw: str, thread: str = "engine-loop") -> dict[str, int]:
    """py-spy's raw (collapsed) output -> samples per bucket of the threads whose name contains `thread`."""
    out = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or thread not in frames[0]:
            continue
        for name, pattern in BUCKETS:
            if any(pattern.search(f) for f in reversed(frames[1:])):
                out[name] += int(count)
                break
        else:
            out["other"] += int(count)
    return dict(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peer_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=peer.PEER_DIR / "profile")
    args = parser.parse_args(argv)
    if not PY_SPY.exists():
        raise SystemExit(f"py-spy is not installed: pip install --no-deps --target {PY_SPY.parents[1]} py-spy==0.4.3")
    args.out.mkdir(parents=True, exist_ok=True)
    stack = peer.kvserve_stack(Path(tempfile.mkdtemp(prefix="bench-peer-profile-")), peer.REDIS_URL)
    try:
        stack.start()
        stack.wait_workers("prefill", 1, timeout_s=180)
        stack.wait_workers("decode", 1, timeout_s=180)
        asyncio.run(peer.warm_up(stack.url, stack.api_key, args.max_tokens))
        spies = {name: subprocess.Popen([str(PY_SPY), "record", "--idle", "--threads", "-r", "50", "-f", "raw",
                                         "-d", str(int(args.seconds)), "-o", str(args.out / f"{name}.txt"),
                                         "-p", str(proc.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for name, proc in stack.procs.items()}
        results, sent, wall = asyncio.run(run_load(stack.url, stack.api_key, args.clients, args.seconds,
                                                   args.max_tokens, peer.GREEDY))
        for spy in spies.values():
            spy.wait(timeout=120)
    finally:
        stack.close()
    figures = summarize(results, sent, wall)
    report = {"bench": "peer_profile", "clients": args.clients, "seconds": args.seconds, **figures}
    for name in ("prefill", "decode"):
        path = args.out / f"{name}.txt"
        counts = bucket_samples(path.read_text()) if path.exists() else {}
        total = sum(counts.values()) or 1
        print_table([{"bucket": k, "samples": v, "share": v / total} for k, v in
                     sorted(counts.items(), key=lambda kv: -kv[1])], title=f"{name} worker, engine-loop thread")
        report[name] = {k: round(v / total, 4) for k, v in counts.items()}
    emit_json(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Load test against a running stack: `python -m bench.load --url URL --api-key KEY --clients 32 --seconds 60`.

Each client streams chat completions back to back for the given time. Prints p50/p99 time to first
token and latency, aggregate tokens per second and errors; then runs the canary suite and
check_integrity on every live pool, and measures the in-process engine on the same prompts at the
same concurrency (stack idle) for `ratio_vs_engine`. Ends with one JSON line. Run it on a host that
shares the stack's environment (REDIS_URL, KVSERVE_LEDGER_PREFIX, DATABASE_URL) so that the canary
and integrity checks look at the same deployment. Its clients share one key: under the default fair share
that tenant is alone, and a tenant alone is never refused (work-conserving; kvserve.chat.tenant_limits).
"""
import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from bench.common import emit_json, median, print_table

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
             "Why is the sky blue?", "List four planets.", "Explain what a cache is in one sentence.",
             "Say hello in Spanish and French.", "What is two plus two?"]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def one_request(client, url, key, model, question, max_tokens, extra: dict | None = None):
    """One streamed chat completion: its TTFT, latency and completion tokens (the usage chunk's count, or
    the number of content chunks when a server sends no usage), or an error. `extra`: more body fields."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    started = time.perf_counter()
    first = None
    tokens, chunks, error, finished = None, 0, None, False
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                finished = True
                break
            event = json.loads(data)
            if "error" in event:
                error = event["error"].get("code") or "error"
                continue
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter() - started
    latency = time.perf_counter() - started
    if error or not finished:
        return {"error": error or "stream ended without [DONE]", "lost": not finished and not error}
    return {"ttft": first if first is not None else latency, "latency": latency,
            "tokens": tokens if tokens is not None else chunks}


async def run_load(url, key, clients, seconds, max_tokens, extra: dict | None = None):
    """`clients` concurrent clients sending QUESTIONS' chats back to back for `seconds`:
    (per-request results, requests sent, wall seconds). bench.peer drives both of its servers with it."""
    results, sent = [], 0
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        models = await client.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        models.raise_for_status()
        model = models.json()["data"][0]["id"]
        async def worker(i):
            nonlocal sent
            n = 0
            while time.perf_counter() < deadline:
                sent += 1
                try:
                    results.append(await one_request(client, url, key, model, QUESTIONS[(i + n) % len(QUESTIONS)], max_tokens, extra))
                except Exception as exc:  # a transport failure is an error, never silently dropped
                    results.append({"error": f"{type(exc).__name__}: {exc}", "lost": True})
                n += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        wall = time.perf_counter() - started
    return results, sent, wall


def summarize(results: list[dict], sent: int, wall: float) -> dict:
    """The figures of one load run: requests, errors, lost, aggregate tok/s, TTFT and latency p50/p99."""
    ok = [r for r in results if "error" not in r]
    errors = [r for r in results if "error" in r]
    return {"requests": len(results), "ok": len(ok), "errors": len(errors),
            "lost": sum(1 for e in errors if e.get("lost")) + (sent - len(results)),
            "tok_s": sum(r["tokens"] for r in ok) / wall if wall > 0 else float("nan"),
            "ttft_p50_s": median(r["ttft"] for r in ok), "ttft_p99_s": pct([r["ttft"] for r in ok], 0.99),
            "latency_p50_s": median(r["latency"] for r in ok),
            "latency_p99_s": pct([r["latency"] for r in ok], 0.99)}


def manage(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)


def open_incidents() -> int:
    out = manage("shell", "-c", "from incidents.models import Incident; print(Incident.objects.count())")
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else -1


def integrity_ok() -> tuple[bool, list[str]]:
    from inference.ledger import RedisLedger
    from inference.registry import Registry

    from inference.settings import redis_url_setting, runtime_settings

    client = redis.Redis.from_url(redis_url_setting())
    prefix = runtime_settings()["prefix"]
    live = {w.worker_id for w in Registry(client, prefix=prefix).live_workers()}
    problems = []
    for pool in live:
        try:
            RedisLedger(client, pool, prefix=prefix).check_integrity()
        except Exception as exc:
            problems.append(f"{pool}: {exc}")
    return not problems and bool(live), problems


def engine_tok_s(clients, max_tokens) -> float:
    from inference.engine import Engine, EngineConfig
    from inference.loader import load_model
    from inference.sequence import SamplingParams

    model = load_model()
    engine = Engine(model, EngineConfig(num_pages=2048))
    prompts = [model.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
               for i in range(clients)]
    engine.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm up
    started = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - started)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-canary", action="store_true")
    args = parser.parse_args(argv)
    incidents_before = open_incidents()
    results, sent, wall = asyncio.run(run_load(args.url.rstrip("/"), args.api_key, args.clients, args.seconds,
                                               args.max_tokens))
    figures = summarize(results, sent, wall)
    errors = [r for r in results if "error" in r]
    tok_s = figures["tok_s"]
    print_table([{k: v for k, v in figures.items() if k != "lost"}],
                title=f"load: {args.clients} clients for {args.seconds:.0f}s")
    for e in errors[:5]:
        print("error:", e["error"])
    canary = {"passed": None}
    if not args.skip_canary:
        out = manage("canary", "--json")
        try:
            canary = json.loads(out.stdout.strip().splitlines()[-1])
        except Exception:
            canary = {"passed": False, "error": out.stderr[-500:]}
        print("canary:", "passed" if canary.get("passed") else f"FAILED {canary}")
    integrity, problems = integrity_ok()
    print("integrity:", "ok" if integrity else problems)
    engine = engine_tok_s(args.clients, args.max_tokens)
    print(f"in-process engine at {args.clients} concurrent: {engine:.1f} tok/s")
    incidents_after = open_incidents()
    emit_json({"bench": "load", "clients": args.clients, "seconds": args.seconds, "requests": figures["requests"],
               "errors": figures["errors"], "lost": figures["lost"],
               "incidents": incidents_after - incidents_before if incidents_before >= 0 else None,
               "integrity_ok": integrity, "canary_passed": canary.get("passed"), "tok_s": tok_s,
               "engine_tok_s": engine, "ratio_vs_engine": tok_s / engine if engine else None,
               **{k: figures[k] for k in ("ttft_p50_s", "ttft_p99_s", "latency_p50_s", "latency_p99_s")}})


if __name__ == "__main__":
    main()

"""Dropped Redis connections under load: `python -m bench.redis_kills [--requests 16] [--seconds 30] [--every 2]`.

Starts its own stack (tests/e2e/stack.py: Celery prefill + decode workers, uvicorn; a tiny random-weight model),
creates two tenants' API keys and sends `--requests` chat completions at once (half per tenant, every other
one streamed). While they run, every `--every` s it kills every Redis connection of the stack's processes
(CLIENT KILL ID of each connection whose client address is a socket of one of them: the web server, the workers
and their Celery broker connections; nobody else's on a shared Redis) for `--seconds`. Reports how many
requests completed, failed (by code) or were lost, and the pages the stack's pools hold after drain beyond the
prefix cache (stranded); ends with one JSON line.
"""
import argparse
import asyncio
import json
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import redis

from bench.common import emit_json, log

QUESTION = "Tell a long story about a lighthouse keeper, the sea, ships and storms."


def stack_ports(stack) -> set[int]:
    """Local ports of every TCP connection of the stack's processes and their children."""
    ports = set()
    for proc in stack.procs.values():
        try:
            root = psutil.Process(proc.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in family:
            try:
                ports.update(c.laddr.port for c in p.net_connections(kind="tcp") if c.laddr)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    return ports


def kill_stack_connections(stack, client: redis.Redis) -> int:
    """CLIENT KILL ID of each connection of the stack's processes; returns how many were killed."""
    ports = stack_ports(stack)
    killed = 0
    for c in client.client_list():
        if int(c["addr"].rsplit(":", 1)[1]) in ports:
            try:
                client.execute_command("CLIENT", "KILL", "ID", c["id"])
                killed += 1
            except redis.ResponseError:  # gone by itself meanwhile
                pass
    return killed


def killer(stack, seconds: float, every_s: float, stop: threading.Event, out: list) -> None:
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    deadline = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < deadline:
        out.append(kill_stack_connections(stack, client))
        stop.wait(every_s)


async def one(client: httpx.AsyncClient, url: str, key: str, max_tokens: int, stream: bool) -> dict:
    """One chat completion: {"ok": True} or {"code": ...}; "lost" when neither an answer nor an error came."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens, "stream": stream,
            "temperature": 0}
    started = time.monotonic()
    try:
        if not stream:
            resp = await client.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            data = resp.json()
            if resp.status_code == 200:
                return {"ok": True, "s": time.monotonic() - started}
            return {"code": f"{resp.status_code} {data.get('error', {}).get('code')}", "s": time.monotonic() - started}
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            if resp.status_code != 200:
                data = json.loads(await resp.aread())
                return {"code": f"{resp.status_code} {data.get('error', {}).get('code')}"}
            error, done = None, False
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and '"error"' in line:
                    error = json.loads(line[6:])["error"].get("code")
                    log(f"stream error: {line[6:300]}")
            if done and not error:
                return {"ok": True, "s": time.monotonic() - started}
            return {"code": f"stream {error}" if error else "lost", "s": time.monotonic() - started}
    except httpx.HTTPError as exc:
        return {"code": f"lost ({type(exc).__name__})", "s": time.monotonic() - started}


def held_after_drain(stack, drain_s: float) -> dict:
    """The stack's pools once idle: pages used beyond the prefix cache (stranded) and dirty pages."""
    from inference.ledger import pool_counts

    deadline = time.monotonic() + drain_s
    while True:
        try:
            counts = pool_counts(stack.redis, stack.prefix)
        except redis.ConnectionError:
            counts = None
        if counts is not None:
            stranded = sum(c.used - c.cached for c in counts)
            dirty = sum(c.dirty for c in counts)
            if (stranded == 0 and dirty == 0) or time.monotonic() > deadline:
                return {"stranded_pages": stranded, "dirty_pages": dirty, "cached_pages": sum(c.cached for c in counts)}
        time.sleep(0.5)


async def run(stack, keys: list[str], n: int, max_tokens: int, seconds: float, every_s: float) -> dict:
    stop, kills = threading.Event(), []
    thread = threading.Thread(target=killer, args=(stack, seconds, every_s, stop, kills), daemon=True)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=n + 4)) as client:
        tasks = [one(client, stack.url, keys[i % 2], max_tokens, stream=i % 4 < 2) for i in range(n)]
        started = time.monotonic()
        thread.start()
        results = await asyncio.gather(*tasks)
        span = time.monotonic() - started
    stop.set()
    thread.join()
    return {"results": results, "kill_rounds": len(kills), "connections_killed": sum(kills), "span_s": span}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0, help="how long connections are killed")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between kill rounds")
    parser.add_argument("--max-tokens", type=int, default=800, help="long enough to outlast the kills (~45 s here)")
    parser.add_argument("--drain-s", type=float, default=20.0)
    parser.add_argument("--logs", type=Path, help="copy the stack's process logs into this directory")
    args = parser.parse_args(argv)
    from inference.tiny import write_tiny
    from tests.e2e.stack import Stack

    with tempfile.TemporaryDirectory(prefix="bench-redis-kills-") as tmp:
        env = dict(KVSERVE_MODEL=str(write_tiny(Path(tmp) / "tiny")["gguf"]), KVSERVE_WINDOW="2048",
                   KVSERVE_NUM_PAGES="512")
        stack = Stack(Path(tmp) / "stack", **env).start()
        try:
            keys = [stack.manage("create_api_key", f"bench-kills-{t}").strip().splitlines()[-1] for t in "AB"]
            out = asyncio.run(run(stack, keys, args.requests, args.max_tokens, args.seconds, args.every))
            after = held_after_drain(stack, args.drain_s)
            if args.logs:
                shutil.copytree(stack.logs, args.logs, dirs_exist_ok=True)
        finally:
            stack.close()
    results = out.pop("results")
    codes = Counter(r.get("code", "completed") for r in results)
    completed = codes.pop("completed", 0)
    log(f"{completed}/{len(results)} completed; failed: {dict(codes)}; {out['connections_killed']} connections "
        f"killed in {out['kill_rounds']} rounds; requests span {out['span_s']:.1f}s; after drain: {after}")
    emit_json({"bench": "redis_kills", "requests": len(results), "completed": completed, "failed": dict(codes),
               "lost": sum(n for c, n in codes.items() if c.startswith("lost")), **out, **after,
               "seconds": args.seconds, "every_s": args.every, "max_tokens": args.max_tokens})


if __name__ == "__main__":
    main()

"""Fair share across tenants on a real stack: `python -m bench.fairness [--quick] [--model default]`.

Starts its own stack (tests/e2e/stack.py: Celery prefill + decode workers, uvicorn; a tiny random-weight model
unless --model default). Tenant B sends short streamed requests one after another, three times in one run:
alone, while tenant A floods with long requests under the deployment's default fair-share limits
(work-conserving: they bite only while B has a request in flight), and while A floods with its limits
switched off (Tenant.max_in_flight = kv_share = 0) for contrast. A's flood clients retry
after Retry-After when refused. Prints B's median time to first token and completion time side by side and
the flood / alone ratios (target <= 2 with fair share) and what the flood adds to B's TTFT in milliseconds (the ratio's
denominator shrinks as B's own request gets faster: 0.106 s at 239fa1d, 0.027-0.043 s at stop 46, while the flood
added 8 and then 43-51 ms), where B's requests spent their time hop by hop (from their ChatRequest rows: queue,
prefill, handoff, decode), then one JSON line.
"""
import argparse
import asyncio
import sys
from datetime import datetime
import tempfile
from pathlib import Path

import httpx

from bench.common import emit_json, log, median, print_table
from bench.load import one_request

LONG = "Tell a very long story about a lighthouse keeper, the sea, ships and storms. " * 12
SHORT = "What is two plus two?"


async def probe(client, url, key, model, n, max_tokens) -> list[dict]:
    """B's requests, one after another."""
    out = []
    for _ in range(n):
        out.append(await one_request(client, url, key, model, SHORT, max_tokens))
    return out


async def flood(client, url, key, model, stop: asyncio.Event, max_tokens, counts: dict) -> None:
    """One of A's clients: long requests back to back; a refusal waits Retry-After (1 s) and tries again."""
    while not stop.is_set():
        r = await one_request(client, url, key, model, LONG, max_tokens)
        if str(r.get("error", "")).startswith("HTTP 429"):
            counts["refused"] += 1
            await asyncio.sleep(1)
        elif "error" in r:
            counts["errors"] += 1
            await asyncio.sleep(0.2)
        else:
            counts["served"] += 1


def merge(parts: list[dict]) -> dict:
    """One phase's rounds together: medians over every probe, counts summed."""
    out = {k: sum(p[k] for p in parts) for k in parts[0] if k != "samples" and not k.endswith("_s")}
    out.update({k: median(x for p in parts for x in p["samples"].get(k, ())) for k in ("ttft_s", "completion_s") + HOPS})
    return out


async def phase(url, keys, model, *, flood_clients, probes, probe_tokens, flood_tokens, warmup_s) -> dict:
    counts = {"refused": 0, "served": 0, "errors": 0}
    limits = httpx.Limits(max_connections=flood_clients + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(flood(client, url, keys["A"], model, stop, flood_tokens, counts))
                 for _ in range(flood_clients)]
        if tasks:
            await asyncio.sleep(warmup_s)  # A's backlog builds before B arrives
        results = await probe(client, url, keys["B"], model, probes, probe_tokens)
        stop.set()
        await asyncio.gather(*tasks)
    ok = [r for r in results if "error" not in r]
    return {"samples": {"ttft_s": [r["ttft"] for r in ok], "completion_s": [r["latency"] for r in ok]},
            "ttft_s": median(r["ttft"] for r in ok), "completion_s": median(r["latency"] for r in ok),
            "b_ok": len(ok), "b_errors": len(results) - len(ok), "a_served": counts["served"],
            "a_refused_429": counts["refused"], "a_errors": counts["errors"]}


HOPS = ("queue_ms", "prefill_ms", "handoff_ms", "decode_ms")


def stamp(value) -> datetime:
    """A ChatRequest timestamp as the stack's database returns it: a datetime (PostgreSQL) or text (SQLite)."""
    return value if isinstance(value, datetime) else datetime.fromisoformat(str(value))


def b_hops(stack, since) -> dict:
    """Where B's requests created after `since` spent their time, from their ChatRequest rows: created -> prefill
    started (queue), -> prefill finished, -> decode started (handoff), -> finished (decode, first token included)."""
    rows = stack.sql("SELECT c.created_at, c.prefill_started_at, c.prefill_finished_at, c.decode_started_at, "
                     "c.finished_at FROM chat_chatrequest c JOIN tenants_tenant t ON c.tenant_id = t.id "
                     "WHERE t.name = ? AND c.created_at > ? ORDER BY c.created_at", "bench-B", since)
    out = {hop: [] for hop in HOPS}
    for row in rows:
        if any(v is None for v in row):
            continue
        t = [stamp(v) for v in row]
        for hop, (a, b) in zip(HOPS, zip(t, t[1:])):
            out[hop].append((b - a).total_seconds() * 1e3)
    return out


def stack_start(workdir: Path, model: str, max_in_flight: int, kv_share: float):
    from tests.e2e.stack import Stack

    env = {"KVSERVE_TENANT_MAX_IN_FLIGHT": str(max_in_flight), "KVSERVE_TENANT_KV_SHARE": str(kv_share)}
    if model == "tiny":
        from inference.tiny import write_tiny

        env.update(KVSERVE_MODEL=str(write_tiny(workdir / "tiny")["gguf"]), KVSERVE_WINDOW="2048",
                   KVSERVE_NUM_PAGES="256")
    else:
        env.update(KVSERVE_WINDOW="4096", KVSERVE_NUM_PAGES="512")
    return Stack(workdir / "stack", **env).start()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", choices=["tiny", "default"], default="tiny")
    parser.add_argument("--flood-clients", type=int, default=8)
    parser.add_argument("--max-in-flight", type=int, default=16,
                        help="KVSERVE_TENANT_MAX_IN_FLIGHT of the stack (default: the deployment's)")
    parser.add_argument("--kv-share", type=float, default=0.5,
                        help="KVSERVE_TENANT_KV_SHARE of the stack (default: the deployment's)")
    args = parser.parse_args(argv)
    probes, rounds = (4, 1) if args.quick else (5, 3)
    shape = dict(probes=probes, probe_tokens=8, flood_tokens=64 if args.quick else 128, warmup_s=2.0)
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
        stack = stack_start(Path(tmp), args.model, args.max_in_flight, args.kv_share)
        try:
            keys = {t: stack.manage("create_api_key", f"bench-{t}").strip().splitlines()[-1] for t in "AB"}
            url = stack.url
            models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {keys['B']}"})
            model = models.json()["data"][0]["id"]
            asyncio.run(phase(url, keys, model, flood_clients=0, **{**shape, "probes": 2}))  # warm up
            runs = {"alone": [], "fair": [], "unlimited": []}
            for r in range(rounds):  # interleaved, so the machine's drift hits every phase alike
                for name in runs:
                    a_limits = "0" if name == "unlimited" else "NULL"  # NULL: the deployment's limits
                    stack.sql(f"UPDATE tenants_tenant SET max_in_flight = {a_limits}, kv_share = {a_limits} "
                              "WHERE name = ?", "bench-A")
                    log(f"round {r + 1}/{rounds}: {name}")
                    since = stack.sql("SELECT coalesce(max(created_at), '1970-01-01') FROM chat_chatrequest")[0][0]
                    runs[name].append(asyncio.run(phase(url, keys, model, flood_clients=0 if name == "alone"
                                                        else args.flood_clients, **shape)))
                    runs[name][-1]["samples"].update(b_hops(stack, since))
            alone, fair, unfair = (merge(runs[name]) for name in ("alone", "fair", "unlimited"))
        finally:
            stack.close()
    rows = [{"phase": name, **r} for name, r in (("B alone", alone), ("A floods, fair share", fair),
                                                 ("A floods, A unlimited", unfair))]
    print_table(rows, ["phase", "ttft_s", "completion_s", *HOPS, "b_ok", "b_errors", "a_served", "a_refused_429",
                       "a_errors"], title=f"fairness: B's short requests (median of {probes} x {rounds} rounds, interleaved), model {args.model}, "
                                          f"A: {args.flood_clients} flood clients")

    def ratio(a, b):
        return a / b if a == a and b == b and b else float("nan")

    result = {"bench": "fairness", "model": args.model, "flood_clients": args.flood_clients,
              "max_in_flight": args.max_in_flight, "kv_share": args.kv_share, "probes": probes, "rounds": rounds,
              "ttft_ratio": ratio(fair["ttft_s"], alone["ttft_s"]),
              "completion_ratio": ratio(fair["completion_s"], alone["completion_s"]),
              "unlimited_ttft_ratio": ratio(unfair["ttft_s"], alone["ttft_s"]),
              "unlimited_completion_ratio": ratio(unfair["completion_s"], alone["completion_s"]),
              "ttft_added_ms": (fair["ttft_s"] - alone["ttft_s"]) * 1e3,
              "unlimited_ttft_added_ms": (unfair["ttft_s"] - alone["ttft_s"]) * 1e3,
              "alone": alone, "fair": fair, "unlimited": unfair}
    result["hops_added_ms"] = {hop: fair[hop] - alone[hop] for hop in HOPS}
    result["target_met"] = result["ttft_ratio"] <= 2 and result["completion_ratio"] <= 2 and fair["b_errors"] == 0
    print(f"flood / alone, fair share on: TTFT {result['ttft_ratio']:.2f}x, completion "
          f"{result['completion_ratio']:.2f}x (target <= 2x); A unlimited: TTFT {result['unlimited_ttft_ratio']:.2f}x, "
          f"completion {result['unlimited_completion_ratio']:.2f}x; the flood adds {result['ttft_added_ms']:.0f} ms to B's "
          f"TTFT under fair share, {result['unlimited_ttft_added_ms']:.0f} ms unlimited")
    print("B's time by hop (ChatRequest rows), alone -> A flooding under fair share: "
          + ", ".join(f"{hop.removesuffix('_ms')} {alone[hop]:.1f} -> {fair[hop]:.1f} ms" for hop in HOPS)
          + " (decode: from its start to the last token, the first included)")
    emit_json(result)


if __name__ == "__main__":
    sys.exit(main())

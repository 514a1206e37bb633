"""Soak: `python -m bench.soak [--requests 10000] [--seconds S] [--concurrency 16] [--model real|tiny]`.

Runs the real stack (tests/e2e/stack.py: Celery prefill + decode workers, uvicorn web, beat for the reaper
and the canary) on a redis-server of the soak's own (so every client connection on it is the stack's), and
sends chat completions from two tenants back to back: mixed prompt lengths (bench.chaos_clients'
story prompts with a fresh sentinel each), short mixed max_tokens, half streamed, --disconnect-rate of them
hung up after their first deltas. Meanwhile the canary runs on its beat schedule (every --canary-every-s,
in the prefill worker's maintenance queue, as deployed) and every --kill-every-s every client connection of
the Redis server is killed (CLIENT KILL TYPE normal / pubsub). Then the harness stops the canary, waits for
the pools to drain and reports:

- done / failed by code / lost (bench.chaos.outcome: no terminal state within --bound-s of submission);
- foreign-sentinel sightings (bench.chaos_clients.sightings over deltas, errors and stored completions);
- false critical incidents (no fault here is a real violation) and the canary's checks by outcome (passed / wrong /
  not judged: a check the stack cannot judge, e.g. the marker on the tiny model's small window, is not a failure);
- pages stranded after drain, per pool: held = live + cached, so with nothing live every owned or dirty page
  outside the prefix cache is stranded (bench.chaos_stack.pool_report), and check_integrity;
- each process's RSS (VmRSS of /proc/<pid>/status) at the first answer, after warm-up (--warmup requests done) and at the end.

Targets: 0 lost, 0 foreign sightings, 0 false critical incidents, no canary check wrong, 0 stranded pages, integrity ok, RSS growth
<= 5 % from warm-up to the end. Prints a table and ends with one JSON line.
"""
import argparse
import asyncio
import itertools
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import redis

from bench.chaos import code_version, drain, outcome, row_for
from bench.chaos_clients import Call, run_call, sightings, story_messages
from bench.chaos_stack import FINAL, SETUP, last_json, pool_report
from bench.common import emit_json, log, print_table
from tests.e2e.stack import OwnRedis, Stack

TENANTS = ("soak-a", "soak-b")
LEASE_TTL_S = 4
REAPER_S = 5
RSS_GROWTH_MAX = 0.05
ENV = {
    "KVSERVE_LEASE_TTL_S": str(LEASE_TTL_S), "KVSERVE_REGISTRY_TTL_S": "3", "KVSERVE_SSE_KEEPALIVE_S": "2",
    "KVSERVE_REQUEUE_AFTER_S": "15", "KVSERVE_NUM_PAGES": "256", "KVSERVE_WINDOW": "2048",
    "KVSERVE_CANARY_TIMEOUT_S": "240", "OMP_NUM_THREADS": "1", "KVSERVE_TORCH_THREADS": "1",
}
CANARY = """
import json
from django_celery_beat.models import IntervalSchedule, PeriodicTask, PeriodicTasks
every, _ = IntervalSchedule.objects.get_or_create(every=%(every)d, period=IntervalSchedule.SECONDS)
kwargs = json.dumps({"only": %(only)r} if %(only)r else {})
n = PeriodicTask.objects.filter(task="kvserve.canary").update(enabled=%(enabled)r, interval=every, kwargs=kwargs)
PeriodicTasks.update_changed()  # a queryset update sends no signal: tell a running beat
print(json.dumps({"canary_tasks": n}))
"""


def vm_rss_kb(pid: int) -> int | None:
    """VmRSS of a process from /proc (psutil need not be installed); None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class SoakStack(Stack):
    """The e2e Stack on a redis-server of its own, with beat, two tenants and what the soak reads of it."""

    def __init__(self, workdir: Path, **env):
        self.own_redis = OwnRedis(workdir).start()
        super().__init__(workdir, redis_url=self.own_redis.url, **{**ENV, **env})
        self.keys: dict[str, str] = {}

    def start(self, canary_every_s: int = 60, canary_checks: list[str] | None = None) -> "SoakStack":
        super().start()
        self.keys = last_json(self.manage("shell", "-c", SETUP % {"reaper": REAPER_S, "tenants": TENANTS}))["keys"]
        self.canary_schedule(canary_every_s, canary_checks, enabled=True)
        self.spawn("beat", [sys.executable, "-m", "celery", "-A", "kvserve", "beat", "--loglevel", "INFO"])
        return self

    def canary_schedule(self, every_s: int, only: list[str] | None, enabled: bool) -> None:
        self.manage("shell", "-c", CANARY % {"every": every_s, "only": only or [], "enabled": enabled})

    def kill_clients(self) -> int:
        """Kills every client connection of the stack's Redis (not the one asking): how many."""
        client = redis.Redis.from_url(self.own_redis.url)
        try:
            return sum(client.execute_command("CLIENT", "KILL", "TYPE", kind, "SKIPME", "yes") for kind in ("normal", "pubsub"))
        finally:
            client.close()

    def pools(self) -> dict[str, dict]:
        """pool_report of every live worker's pool (bench.chaos.drain reads this)."""
        return {w.worker_id: pool_report(self.redis, self.prefix, w.worker_id) for w in self.registry().live_workers()}

    def rows_since(self, since: float) -> list[dict]:
        cols = ("id", "status", "error_code", "prompt_text", "completion_text", "finished_at", "created_at")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(since - 1))
        rows = self.sql(f"SELECT {', '.join('r.' + c for c in cols)} FROM chat_chatrequest r JOIN tenants_tenant t "
                        "ON t.id = r.tenant_id WHERE t.name IN (?, ?) AND r.created_at >= ?", *TENANTS, stamp)
        return [dict(zip(cols, r)) for r in rows]

    def incidents_after(self, incident_id: int) -> list[dict]:
        cols = ("id", "kind", "severity", "worker", "detected_by")
        return [dict(zip(cols, r)) for r in self.sql(f"SELECT {', '.join(cols)} FROM incidents_incident WHERE id > ?",
                                                     incident_id)]

    def max_incident_id(self) -> int:
        return self.sql("SELECT COALESCE(MAX(id), 0) FROM incidents_incident")[0][0]

    def canary_runs(self, since: float) -> list[dict]:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(since - 1))
        return [{"id": i, "passed": bool(p), "finished": f is not None, "checks": c} for i, p, f, c in self.sql(
            "SELECT id, passed, finished_at, checks FROM incidents_canaryrun WHERE started_at >= ?", stamp)]

    def quarantined(self) -> list[str]:
        return [w.worker_id for w in self.registry().live_workers() if w.quarantined]

    def rss(self) -> dict[str, int | None]:
        return {name: vm_rss_kb(p.pid) for name, p in self.procs.items()}

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.own_redis.stop()


async def plain_call(http: httpx.AsyncClient, url: str, key: str, call: Call) -> None:
    """A non-streamed chat completion; a broken connection leaves it to the row (found by its sentinel)."""
    body = {"messages": call.messages, "max_tokens": call.max_tokens, "stream": False, "temperature": 0}
    call.submitted = time.time()
    try:
        resp = await http.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        call.http_status = resp.status_code
        data = resp.json()
        if resp.status_code == 200:
            call.rid = data.get("id", "")
            call.text = data["choices"][0]["message"]["content"] or ""
            return call.finish("done")
        error = data.get("error") or {}
        call.errors.append(str(error.get("message", "")))
        call.finish("error", str(error.get("code") or f"http_{resp.status_code}"))
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        call.broke = f"{type(exc).__name__}: {exc}"


class Traffic:
    """Draws the soak's requests (seeded) and keeps every call made."""

    def __init__(self, args, planted: set[str]):
        self.args, self.planted = args, planted
        self.rng = random.Random(args.seed)
        self.calls: list[Call] = []
        self.streamed: set[int] = set()
        self.counter = itertools.count()
        self.min_until = time.time() + (args.min_seconds or 0)

    def next(self) -> tuple[Call, bool] | None:
        from incidents.canary.prompts import new_sentinel

        i = next(self.counter)
        if i >= self.args.requests and time.time() >= self.min_until:
            return None
        rng = self.rng
        sentinel = new_sentinel()
        self.planted.add(sentinel)
        stream = rng.random() < 0.5
        leave = rng.random() < self.args.disconnect_rate
        call = Call(tenant=TENANTS[i % 2], sentinel=sentinel, messages=story_messages(sentinel, rng.choice([0, 0, 1, 4, 12])),
                    max_tokens=rng.choice(self.args.max_tokens), disconnect_after=rng.randint(1, 3) if leave else 0)
        stream = stream or leave  # a client hangs up on a stream
        if stream:
            self.streamed.add(id(call))
        self.calls.append(call)
        return call, stream


async def clients(stack: SoakStack, args, traffic: Traffic, stop_at: float, on_done) -> None:
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.bound_s, connect=10.0), limits=limits) as http:
        async def client():
            while time.time() < stop_at and (drawn := traffic.next()):
                call, stream = drawn
                key = stack.keys[call.tenant]
                try:
                    if stream:
                        give_up = time.time() + args.bound_s
                        await asyncio.wait_for(run_call(http, stack.url, key, call, lambda: give_up), args.bound_s + 5)
                    else:
                        await asyncio.wait_for(plain_call(http, stack.url, key, call), args.bound_s + 5)
                except asyncio.TimeoutError:
                    call.broke = call.broke or "no answer within the bound"
                on_done()

        await asyncio.gather(*(client() for _ in range(args.concurrency)))


async def chaos(stack: SoakStack, args, stop: asyncio.Event, kills: list) -> None:
    """Kills every Redis client connection every --kill-every-s until `stop`."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), args.kill_every_s)
        except asyncio.TimeoutError:
            kills.append(await asyncio.to_thread(stack.kill_clients))


async def soak(stack: SoakStack, args, planted: set[str], figures: dict) -> list[Call]:
    traffic = Traffic(args, planted)
    done = [0]
    began = time.time()

    def on_done():
        done[0] += 1
        if done[0] == 1:  # every process (beat too) has started and served
            figures["rss_kb_start"] = stack.rss()
        if done[0] == args.warmup:
            figures["rss_kb_warm"] = stack.rss()
        if done[0] % max(1, args.requests // 20) == 0:
            log(f"{done[0]} requests answered in {time.time() - began:.0f} s")

    stop = asyncio.Event()
    kills: list[int] = []
    killer = asyncio.create_task(chaos(stack, args, stop, kills))
    await clients(stack, args, traffic, began + args.seconds if args.seconds else float("inf"), on_done)
    stop.set()
    await killer
    figures["send_s"] = time.time() - began
    figures["redis_kills"] = len(kills)
    figures["redis_connections_killed"] = sum(kills)
    figures["streamed"] = len(traffic.streamed)
    return traffic.calls


def wait_canary_idle(stack: SoakStack, since: float, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(r["finished"] for r in stack.canary_runs(since)):
            return True
        time.sleep(1)
    return False


def judge(stack: SoakStack, calls: list[Call], planted: set[str], began: float, args) -> dict:
    rows = stack.rows_since(began)
    by_id = {r["id"]: r for r in rows}
    results, foreign = [], []
    for call in calls:
        row = by_id.get(call.rid) if call.rid else row_for(call, rows)
        result = outcome(call, row, call.submitted + args.bound_s)
        if result["outcome"] == "failed" and call.disconnected_at and not call.final:
            result["code"] = result["code"] or "client_disconnected"
        results.append(result)
        seen = sightings([call.text, *call.errors, (row or {}).get("completion_text") or ""], {call.sentinel}, planted)
        foreign += [f"{call.sentinel} saw {s}" for s in seen]
    lost = [(c.sentinel, c.rid, r["code"]) for c, r in zip(calls, results) if r["outcome"] == "lost"]
    return {"requests": len(calls), "done": sum(r["outcome"] == "done" for r in results),
            "failed": sum(r["outcome"] == "failed" for r in results),
            "failed_codes": dict(Counter(r["code"] or "?" for r in results if r["outcome"] == "failed")),
            "lost": len(lost), "lost_detail": lost[:10], "disconnected": sum(bool(c.disconnected_at) for c in calls),
            "rows_not_final": sum(1 for r in rows if r["status"] not in FINAL),
            "foreign_sightings": len(foreign), "foreign_detail": foreign[:10]}


def checks_of(run: dict) -> list[dict]:
    """A CanaryRun's checks: JSON text on SQLite, a list on PostgreSQL."""
    checks = run["checks"]
    return json.loads(checks or "[]") if isinstance(checks, str) else checks or []


def rss_growth(warm: dict, end: dict) -> dict[str, float | None]:
    return {n: (end[n] - warm[n]) / warm[n] if warm.get(n) and end.get(n) else None for n in end}


def run(args) -> dict:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvsoak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = {}
    if args.model == "tiny":
        from inference.tiny import write_tiny

        env["KVSERVE_MODEL"] = str(write_tiny(workdir / "tiny-model")["gguf"])
    planted: set[str] = set()
    figures: dict = {"bench": "soak", "code": code_version(), "model": args.model}
    began = time.time()
    stack = SoakStack(workdir, **env)
    try:
        stack.start(args.canary_every_s, args.canary_checks)
        figures["stack_start_s"] = time.time() - began
        log(f"stack up in {figures['stack_start_s']:.0f} s; logs in {workdir}")
        incident_base = stack.max_incident_id()
        started = time.time()
        calls = asyncio.run(soak(stack, args, planted, figures))
        stack.canary_schedule(args.canary_every_s, args.canary_checks, enabled=False)
        figures["canary_idle"] = wait_canary_idle(stack, started, timeout_s=300)
        pools, figures["drain_s"] = drain(stack, args.drain_s)
        figures["rss_kb_end"] = stack.rss()
        figures.update(judge(stack, calls, planted, started, args))
        incidents = stack.incidents_after(incident_base)
        critical = [i for i in incidents if i["severity"] == "critical"]
        figures["false_critical_incidents"] = len(critical)
        figures["critical_detail"] = [f"#{i['id']} {i['kind']} on {i['worker']} ({i['detected_by']})" for i in critical][:10]
        figures["warning_incidents"] = sum(i["severity"] == "warning" for i in incidents)
        figures["quarantined_at_end"] = stack.quarantined()
        runs = stack.canary_runs(started)
        figures["canary_runs"] = len(runs)
        checks = [(r["id"], c) for r in runs if r["finished"] for c in checks_of(r)]  # outcome: incidents/canary/result.py
        figures["canary_checks"] = dict(Counter(c["outcome"] for _, c in checks))
        figures["canary_not_judged"] = dict(Counter(c["name"] for _, c in checks if c["outcome"] == "not_judged"))
        figures["canary_wrong"] = [f"run {run}: {c['name']}" for run, c in checks if c["outcome"] == "wrong"]
        figures["stranded_pages"] = sum(p["owned"] + p["dirty"] for p in pools.values())
        figures["stranded_detail"] = {pid: {k: p[k] for k in ("owned", "dirty", "cached", "owners")}
                                      for pid, p in pools.items() if p["owned"] or p["dirty"]}
        figures["pools"] = {pid: {"held": p["owned"] + p["cached"], "live": 0, "cached": p["cached"]} for pid, p in pools.items()}
        figures["integrity"] = "; ".join(f"{pid}: {p['integrity']}" for pid, p in pools.items() if p["integrity"] != "ok") or "ok"
        figures["rate_rps"] = figures["requests"] / figures["send_s"] if figures["send_s"] else None
        figures["projected_10000_s"] = 10000 / figures["rate_rps"] if figures["rate_rps"] else None
    finally:
        stack.close()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    warm = figures.get("rss_kb_warm") or figures.get("rss_kb_start") or {}
    figures["rss_growth"] = rss_growth(warm, figures.get("rss_kb_end", {}))
    figures["wall_s"] = time.time() - began
    return figures


def verdict(f: dict, args) -> dict[str, bool]:
    growth = [g for g in f["rss_growth"].values() if g is not None]
    return {"lost": f["lost"] == 0, "foreign_sightings": f["foreign_sightings"] == 0,
            "false_critical_incidents": f["false_critical_incidents"] == 0, "canary_wrong": not f["canary_wrong"],
            "stranded_pages": f["stranded_pages"] == 0,
            "integrity": f["integrity"] == "ok", "rss_growth": bool(growth) and max(growth) <= RSS_GROWTH_MAX}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=None, help="stop sending after this long (default: no limit)")
    parser.add_argument("--min-seconds", type=float, default=None,
                        help="keep sending past --requests until this long has passed (so a fast CPU still sees the chaos)")
    parser.add_argument("--concurrency", type=int, default=16, help="clients sending back to back")
    parser.add_argument("--model", choices=("real", "tiny"), default="real",
                        help="real: the default SmolLM2; tiny: random weights in the same formats (throughput only)")
    parser.add_argument("--max-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16, 32],
                        help="comma-separated choices (default 4,8,16,32)")
    parser.add_argument("--disconnect-rate", type=float, default=0.10)
    parser.add_argument("--kill-every-s", type=float, default=20.0, help="kill every Redis client connection this often")
    parser.add_argument("--canary-every-s", type=int, default=60, help="the canary's beat interval")
    parser.add_argument("--canary-checks", type=lambda s: [x for x in s.split(",") if x], default=None,
                        help="comma-separated canary checks (default: the whole suite)")
    parser.add_argument("--warmup", type=int, default=None, help="RSS baseline after this many answers (default 10 %%)")
    parser.add_argument("--bound-s", type=float, default=120.0, help="a request with no terminal state this long after submission is lost")
    parser.add_argument("--drain-s", type=float, default=2 * LEASE_TTL_S + REAPER_S + 5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep logs, database and Redis dir here (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else max(1, args.requests // 10)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated soak still closes its stack
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvserve.settings")
    import django

    django.setup()  # only for the canary's sentinel generator
    logging.getLogger("httpx").setLevel(logging.WARNING)
    f = run(args)
    checks = verdict(f, args)
    f["targets"] = {k: "pass" if ok else "FAIL" for k, ok in checks.items()}
    f["passed"] = all(checks.values())
    print_table([{"done": f["done"], "failed": f["failed"], "lost": f["lost"], "foreign": f["foreign_sightings"],
                  "false_crit": f["false_critical_incidents"], "stranded": f["stranded_pages"],
                  "canary_runs": f["canary_runs"], "canary_wrong": len(f["canary_wrong"]), "kills": f["redis_kills"],
                  "rps": f["rate_rps"]}],
                title=f"soak: {f['requests']} requests in {f['send_s']:.0f} s, failed {f['failed_codes']}")
    print_table([{"process": n, "start_mb": (f["rss_kb_start"].get(n) or 0) / 1024,
                  "warm_mb": ((f.get("rss_kb_warm") or {}).get(n) or 0) / 1024, "end_mb": (f["rss_kb_end"].get(n) or 0) / 1024,
                  "growth": f["rss_growth"].get(n)} for n in f["rss_kb_end"]], title="RSS")
    print("targets: " + ", ".join(f"{k} {v}" for k, v in f["targets"].items()))
    emit_json(f)
    return 0 if f["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""The chaos suite: `python -m bench.chaos [--scenarios a,b,...] [--requests 10]` (root: network namespaces).

Runs kvserve as separate test hosts (bench/chaos_stack.py: Redis, web + beat, one prefill and two decode
workers, each in a network namespace of its own, with a redis-server of the suite's own) and, per
scenario, streams >= 8 chat completions from two tenants over HTTP, a fresh sentinel in every prompt,
injects one fault while they are in flight, lifts it, and measures:

- done / failed with a code / lost: lost = no terminal state, i.e. neither did the client get a final event
  (or, once its stream broke, a final status from GET /api/requests/<id>) nor is the ChatRequest row final,
  within --bound-s of the fault being lifted;
- the longest time from submission to a terminal state;
- foreign sentinel sightings: another request's sentinel in any delta, error or stored completion;
- critical incidents (none of these faults is a real violation, so every one is false);
- pages stranded after drain: pages owned or dirty in a live pool once every request has ended and
  --drain-s has passed (inference.ledger.RedisLedger.snapshot), and check_integrity of every live pool;
- time until every worker serves again: from the fault being lifted (and any replacement process
  registered) until each worker process has served a probe request (its id on a done row as
  prefill_worker or decode_worker) while registered and not quarantined.

Between scenarios the harness restores the stack: a worker that died, does not serve, is quarantined or
whose pool did not drain is restarted (reported as `restarted`), like a supervisor would. Prints a table
and ends with one JSON line (per scenario figures and the overall pass against the targets).
"""
import argparse
import asyncio
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import httpx

from bench.chaos_clients import Call, run_call, sightings, story_messages
from bench.chaos_stack import FINAL, LEASE_TTL_S, REAPER_S, TENANTS, WORKERS, ChaosStack, parse_time
from bench.common import emit_json, print_table
from inference.events import Delta, OutputEvent, is_final

IN_FLIGHT_MIN = 8
TARGETS = {"lost": 0, "foreign_sightings": 0, "false_critical_incidents": 0, "stranded_pages": 0,
           "integrity": "ok", "serve_again_s": "<= 30"}
SERVE_AGAIN_TARGET_S = 30.0
SUPERVISOR_DELAY_S = 1.0  # a killed worker is started again after this long
PAUSE_S = 3.5  # CLIENT PAUSE: longer than a heartbeat (1 s) and the registration TTL (3 s), shorter than a lease
HOLD_S = 2 * LEASE_TTL_S  # SIGSTOP / cut-off duration


def new_sentinel() -> str:
    from incidents.canary.prompts import new_sentinel as canary_sentinel  # the canary's own sentinel shape

    return canary_sentinel()


@dataclass
class Lift:
    at: float  # the fault was lifted (process continued, link restored, Redis back, replacement started)
    t0: float  # serving is measured from here: `at`, or when the replacement process registered
    replaced: list[str] = field(default_factory=list)


@dataclass
class Ctx:
    stack: ChaosStack
    calls: list[Call]
    started: float
    notes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    fault: Callable[[Ctx], Awaitable[Lift]]
    trigger: str = "streaming"  # inject when half the clients stream ("prefilling": when a row is prefilling)
    max_tokens: int = 64
    filler: int = 0  # filler sentences per prompt: a longer prefill
    disconnect: bool = False  # half the clients hang up after their first delta


# ---- faults ---------------------------------------------------------------------------------------

async def _now_lift(**_) -> Lift:
    t = time.time()
    return Lift(t, t)


async def fault_none(ctx: Ctx) -> Lift:
    return await _now_lift()


def busiest_decoder(ctx: Ctx) -> str:
    """The decode host with the most of this scenario's rows decoding on it (decode1 when none is)."""
    counts = Counter(ctx.stack.host_of(r["decode_worker"]) for r in ctx.stack.rows_since(ctx.started)
                     if r["status"] == "decoding")
    counts.pop(None, None)
    return counts.most_common(1)[0][0] if counts else "decode1"


async def _kill_and_replace(ctx: Ctx, name: str) -> Lift:
    ctx.notes["target"] = name
    ctx.notes["decoding_on_target"] = sum(
        1 for r in ctx.stack.rows_since(ctx.started)
        if r["status"] in ("prefilling", "decoding") and ctx.stack.host_of(r["decode_worker"] or r["prefill_worker"]) == name)
    await asyncio.to_thread(ctx.stack.stop, name, signal.SIGKILL)
    await asyncio.sleep(SUPERVISOR_DELAY_S)
    await asyncio.to_thread(ctx.stack.start_host, name)
    at = time.time()
    t0 = await asyncio.to_thread(ctx.stack.wait_registered, [name])
    ctx.notes["replacement_registered_s"] = round(t0 - at, 1)
    return Lift(at, t0, [name])


async def fault_kill_prefill(ctx: Ctx) -> Lift:
    return await _kill_and_replace(ctx, "prefill")


async def fault_kill_decode(ctx: Ctx) -> Lift:
    return await _kill_and_replace(ctx, busiest_decoder(ctx))


async def fault_stop_decode(ctx: Ctx) -> Lift:
    name = ctx.notes["target"] = busiest_decoder(ctx)
    ctx.stack.signal(name, signal.SIGSTOP)
    try:
        await asyncio.sleep(HOLD_S)
    finally:
        ctx.stack.signal(name, signal.SIGCONT)
    return await _now_lift()


async def fault_redis_restart(ctx: Ctx) -> Lift:
    await asyncio.to_thread(ctx.stack.redis_host.kill)
    await asyncio.sleep(0.5)
    await asyncio.to_thread(ctx.stack.redis_host.start)
    return await _now_lift()


async def fault_redis_pause(ctx: Ctx) -> Lift:
    await asyncio.to_thread(ctx.stack.redis_host.pause, int(PAUSE_S * 1000))
    await asyncio.sleep(PAUSE_S)
    return await _now_lift()


async def fault_cut_decode(ctx: Ctx) -> Lift:
    name = ctx.notes["target"] = busiest_decoder(ctx)
    ctx.stack.hosts.cut(name)
    try:
        await asyncio.sleep(HOLD_S)
    finally:
        ctx.stack.hosts.restore(name)
    return await _now_lift()


async def _redeliver_when_held(ctx: Ctx, task: str, queue: str, pick: Callable[[], list[Call]], within_s: float):
    """Copies the message of `task` that a worker holds for one of pick()'s requests back onto `queue`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for call in pick():
            payload = ctx.stack.unacked_message(task, call.rid) if call.rid else None
            if payload:
                ctx.stack.redeliver(payload, queue)
                return call.rid
        await asyncio.sleep(0.01)
    return None


async def fault_duplicate(ctx: Ctx) -> Lift:
    """A real prefill message (the long prompt of calls[0], while it prefills) and a real decode message (a
    request that streams) pushed onto their queues a second time, as a redelivery would."""
    first = ctx.calls[0]
    prefill = await _redeliver_when_held(ctx, "inference.prefill", "prefill", lambda: [first], 30)
    decode = await _redeliver_when_held(
        ctx, "inference.decode", "decode", lambda: [c for c in ctx.calls[1:] if c.deltas and not c.final], 60)
    ctx.notes["duplicated"] = {"prefill": prefill, "decode": decode}
    return await _now_lift()


async def fault_disconnect(ctx: Ctx) -> Lift:
    leaving = [c for c in ctx.calls if c.disconnect_after]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(not (c.disconnected_at or c.final) for c in leaving):
        await asyncio.sleep(0.05)
    ctx.notes["disconnected"] = sum(1 for c in leaving if c.disconnected_at)
    return await _now_lift()


async def fault_web_restart(ctx: Ctx) -> Lift:
    await asyncio.to_thread(ctx.stack.stop, "web", signal.SIGKILL)
    await asyncio.sleep(0.5)
    await asyncio.to_thread(ctx.stack.start_web)
    await asyncio.to_thread(ctx.stack.wait_healthy)
    return await _now_lift()


SCENARIOS = [
    Scenario("control", "no fault (the harness's own check: every target must hold)", fault_none),
    Scenario("kill_prefill", "SIGKILL of the prefill worker while it prefills; restarted after 1 s",
             fault_kill_prefill, trigger="prefilling", filler=4),
    Scenario("kill_decode", "SIGKILL of the busiest decode worker mid-stream; restarted after 1 s", fault_kill_decode),
    Scenario("stop_decode", f"SIGSTOP of the busiest decode worker for {HOLD_S} s (2x lease), then SIGCONT",
             fault_stop_decode),
    Scenario("redis_restart", "Redis killed and started again empty (no persistence)", fault_redis_restart),
    Scenario("redis_pause", f"CLIENT PAUSE ALL for {PAUSE_S} s (heartbeat 1 s, registration TTL 3 s)",
             fault_redis_pause),
    Scenario("cut_decode", f"the busiest decode host cut off the network for {HOLD_S} s (2x lease), then restored",
             fault_cut_decode),
    Scenario("duplicate", "one prefill and one decode task message delivered a second time while they run",
             fault_duplicate, trigger="submitted", filler=40),
    Scenario("disconnect", "half the clients hang up after their first delta", fault_disconnect,
             max_tokens=128, disconnect=True),
    Scenario("web_restart", "the web process SIGKILLed mid-stream and started again", fault_web_restart),
]
BY_NAME = {s.name: s for s in SCENARIOS}


# ---- one scenario ---------------------------------------------------------------------------------

def make_calls(sc: Scenario, n: int, planted: set[str]) -> list[Call]:
    calls = []
    for i in range(n):
        sentinel = new_sentinel()
        planted.add(sentinel)
        filler = sc.filler if sc.name != "duplicate" or i == 0 else 0  # duplicate: only calls[0] is long
        calls.append(Call(tenant=TENANTS[i % 2], sentinel=sentinel, messages=story_messages(sentinel, filler),
                          max_tokens=sc.max_tokens, disconnect_after=1 if sc.disconnect and i % 4 < 2 else 0))
    return calls


async def wait_trigger(ctx: Ctx, trigger: str, timeout_s: float = 180) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if trigger == "streaming" and sum(1 for c in ctx.calls if c.deltas) * 2 >= len(ctx.calls):
            return True
        if trigger == "submitted" and ctx.calls[0].rid:
            return True
        if trigger == "prefilling" and any(r["status"] == "prefilling" for r in ctx.stack.rows_since(ctx.started)):
            return True
        if all(c.final for c in ctx.calls):
            return False
        await asyncio.sleep(0.05 if trigger != "streaming" else 0.1)
    return False


def row_for(call: Call, rows: list[dict]) -> dict | None:
    """The call's row: by id when the client got one, else by its sentinel in the stored prompt."""
    return next((r for r in rows if (call.rid and r["id"] == call.rid) or
                 (not call.rid and call.sentinel in (r["prompt_text"] or ""))), None)


async def wait_rows(stack: ChaosStack, calls: list[Call], started: float, deadline: float) -> list[dict]:
    """Rows of the scenario; waits (until `deadline`) for the rows of calls whose client got no final event."""
    while True:
        rows = await asyncio.to_thread(stack.rows_since, started)
        open_ = [c for c in calls if not c.final and ((r := row_for(c, rows)) is None or r["status"] not in FINAL)]
        if not open_ or time.time() >= deadline:
            return rows
        await asyncio.sleep(0.5)


def outcome(call: Call, row: dict | None, deadline: float) -> dict:
    """done / failed (with a code) / lost, and when the terminal state was reached."""
    if call.final:
        return {"outcome": "done" if call.final == "done" else "failed", "code": call.code, "at": call.ended}
    finished = parse_time(row["finished_at"]) if row else None
    if row and row["status"] in FINAL and finished is not None and finished <= deadline:
        return {"outcome": "done" if row["status"] == "done" else "failed", "code": row["error_code"], "at": finished}
    if row and row["status"] in FINAL and finished is not None:
        return {"outcome": "lost", "code": f"{row['status']} {finished - deadline:.0f} s after the bound", "at": None}
    return {"outcome": "lost", "code": row["status"] if row else "no_row", "at": None}


async def recover(stack: ChaosStack, http: httpx.AsyncClient, t0: float, limit_s: float, planted: set[str],
                  probes: list[Call]) -> dict[str, float]:
    """Probe requests from t0, four in flight at all times (the decode queue hands them to both decoders),
    until every worker host has served one or limit_s passes: {host: when it served}."""
    served: dict[str, float] = {}
    await asyncio.sleep(max(0.0, t0 - time.time()))
    inflight: set[asyncio.Task] = set()
    settling: list[Call] = []  # answered "done" to the client, their rows not final yet: looked at again next round

    async def probe(call: Call) -> Call:
        give_up = time.time() + 20
        try:
            await asyncio.wait_for(run_call(http, stack.url, stack.keys[call.tenant], call, lambda: give_up), 25)
        except asyncio.TimeoutError:
            pass
        return call

    try:
        while time.time() < t0 + limit_s and not set(WORKERS) <= served.keys():
            while len(inflight) < 4:
                sentinel = new_sentinel()
                planted.add(sentinel)
                call = Call(tenant=TENANTS[len(probes) % 2], sentinel=sentinel, max_tokens=8,
                            messages=[{"role": "user", "content": f"Repeat exactly: the secret code is {sentinel}"}])
                probes.append(call)
                inflight.add(asyncio.create_task(probe(call)))
            finished, inflight = await asyncio.wait(inflight, timeout=t0 + limit_s - time.time(),
                                                    return_when=asyncio.FIRST_COMPLETED)
            calls = [t.result() for t in finished] + settling
            settling = []
            rows = await asyncio.to_thread(stack.rows_since, min((c.submitted for c in calls), default=t0))
            live = await asyncio.to_thread(stack.live_by_host)
            for call in calls:
                row = row_for(call, rows)
                if call.final == "done" and (not row or row["status"] not in FINAL):
                    settling.append(call)  # the stream's done event comes before its worker writes the row
                    continue
                if call.final != "done" or row["status"] != "done":
                    continue
                for worker in (row["prefill_worker"], row["decode_worker"]):
                    host = stack.host_of(worker)
                    info = live.get(host)
                    if host and host not in served and info and info.worker_id == worker and not info.quarantined:
                        served[host] = call.ended
            if calls and not any(c.final == "done" for c in calls):
                await asyncio.sleep(1.0)  # nothing serves yet (503s come back at once): do not hammer
    finally:  # probes still running finish (each is bounded): a hung-up probe would hold pages a while
        await asyncio.gather(*inflight, return_exceptions=True)
    return served


def drain(stack: ChaosStack, drain_s: float) -> tuple[dict, float]:
    """Live pools once nothing is owned or dirty, or as they are after drain_s; and how long it took."""
    started = time.monotonic()
    while True:
        pools = stack.pools()
        if all(p["owned"] == 0 and p["dirty"] == 0 for p in pools.values()) or time.monotonic() - started >= drain_s:
            return pools, time.monotonic() - started
        time.sleep(0.5)


async def run_scenario(stack: ChaosStack, sc: Scenario, args, planted: set[str]) -> dict:
    incident_base = await asyncio.to_thread(stack.max_incident_id)
    started = time.time()
    ctx = Ctx(stack, make_calls(sc, args.requests, planted), started)
    deadline: list[float] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0), limits=limits) as http:
        tasks = [asyncio.create_task(run_call(http, stack.url, stack.keys[c.tenant], c,
                                              lambda: deadline[0] if deadline else None)) for c in ctx.calls]
        fired = await wait_trigger(ctx, sc.trigger)
        in_flight = sum(1 for c in ctx.calls if not c.final)
        fault_at = time.time()
        lift = await sc.fault(ctx)
        deadline.append(lift.at + args.bound_s)
        probes: list[Call] = []
        probing = asyncio.create_task(recover(stack, http, lift.t0, args.recovery_s, planted, probes))
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline[0] - time.time()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        rows = await wait_rows(stack, ctx.calls, started, deadline[0])
        served = await probing
    pools, drained_s = await asyncio.to_thread(drain, stack, args.drain_s)
    incidents = await asyncio.to_thread(stack.incidents_after, incident_base)
    rows = await asyncio.to_thread(stack.rows_since, started)

    results = [outcome(c, row_for(c, rows), deadline[0]) for c in ctx.calls]
    codes = Counter(r["code"] or "?" for r in results if r["outcome"] == "failed")
    lost = [(c.sentinel, r["code"]) for c, r in zip(ctx.calls, results) if r["outcome"] == "lost"]
    times = [r["at"] - c.submitted for c, r in zip(ctx.calls, results) if r["at"]]
    foreign = []
    for call in ctx.calls + probes:
        row = row_for(call, rows)
        seen = sightings([call.text, *call.errors, (row or {}).get("completion_text") or ""], {call.sentinel}, planted)
        foreign += [f"{call.sentinel} saw {s}" for s in seen]
    critical = [i for i in incidents if i["severity"] == "critical"]
    stranded = sum(p["owned"] + p["dirty"] for p in pools.values())
    status = {r["id"]: r["status"] for r in rows}
    stranded_detail = [f"{stack.host_of(pool) or pool}: {p['dirty']} dirty" for pool, p in pools.items() if p["dirty"]]
    stranded_detail += [f"{stack.host_of(pool) or pool}: {n} owned by {owner} ({status.get(owner, 'not a request of this scenario')})"
                        for pool, p in pools.items() for owner, n in p["owners"].items()]
    live = await asyncio.to_thread(stack.live_by_host)
    integrity = [f"{name}: no pool to check (not registered)" for name in WORKERS if name not in live]
    integrity += [f"{stack.host_of(pool) or pool}: {p['integrity']}" for pool, p in pools.items() if p["integrity"] != "ok"]
    serve_again = max(served.values()) - lift.t0 if set(WORKERS) <= served.keys() else None
    hung = sum(1 for c, r in zip(ctx.calls, results) if r["outcome"] != "lost" and not c.final and not c.disconnected_at)
    rows_open = sum(1 for c in ctx.calls if (r := row_for(c, rows)) and r["status"] not in FINAL)

    figures = {
        "requests": len(ctx.calls), "in_flight_at_fault": in_flight, "fault_fired": fired,
        "done": sum(r["outcome"] == "done" for r in results), "failed": sum(r["outcome"] == "failed" for r in results),
        "failed_codes": dict(codes), "lost": len(lost), "lost_detail": lost,
        "max_terminal_s": max(times) if times else None,
        "foreign_sightings": len(foreign), "foreign_detail": foreign[:10],
        "false_critical_incidents": len(critical),
        "critical_detail": [f"#{i['id']} {i['kind']} on {i['worker'] or i['pool']} ({i['detected_by']})" for i in critical][:10],
        "warning_incidents": sum(i["severity"] == "warning" for i in incidents),
        "stranded_pages": stranded, "stranded_detail": stranded_detail[:10], "drain_s": drained_s, "integrity": "ok" if not integrity else "; ".join(integrity)[:600],
        "serve_again_s": serve_again, "served": {h: round(t - lift.t0, 1) for h, t in served.items()},
        "probes": len(probes), "probe_log": probe_log(probes, lift.t0), "clients_without_final_event": hung, "rows_not_final": rows_open,
        "fault_s": lift.at - fault_at, **ctx.notes,
    }
    checks = {
        "valid": fired and in_flight >= IN_FLIGHT_MIN, "lost": not lost, "foreign_sightings": not foreign,
        "false_critical_incidents": not critical, "stranded_pages": stranded == 0, "integrity": not integrity,
        "serve_again_s": serve_again is not None and serve_again <= SERVE_AGAIN_TARGET_S,
    }
    if sc.name == "duplicate":
        checks["duplicate_ran_once"] = figures["duplicate_ran_once"] = ran_once(stack, ctx, rows)
    if sc.name == "disconnect":
        left = [(c, row_for(c, rows)) for c in ctx.calls if c.disconnected_at]
        aborted = [(c, r) for c, r in left if r and r["status"] == "failed" and parse_time(r["finished_at"])]
        figures["disconnects_aborted"] = f"{len(aborted)}/{len(left)}"
        figures["disconnect_rows"] = dict(Counter(f"{r['status']}:{r['error_code']}" if r else "no_row" for _, r in left))
        figures["abort_s_max"] = max((parse_time(r["finished_at"]) - c.disconnected_at for c, r in aborted), default=None)
        checks["disconnects_aborted"] = bool(left) and len(aborted) == len(left)
    figures["checks_failed"] = [k for k, ok in checks.items() if not ok]
    figures["passed"] = all(checks.values())
    return figures


def probe_log(probes: list[Call], t0: float, limit: int = 8) -> list[str]:
    """The first probes: sent and answered (s after t0), and how (a slow recovery shows where it waited)."""
    return [f"+{c.submitted - t0:.1f}s..+{(c.ended or c.submitted) - t0:.1f}s {c.final or 'no answer'}"
            f"{' ' + c.code if c.code else ''}{' (' + c.broke[:80] + ')' if c.broke else ''}" for c in probes[:limit]]


def ran_once(stack: ChaosStack, ctx: Ctx, rows: list[dict]) -> bool:
    """Each duplicated request ran once (stream_matches_row); False when no duplicate was delivered."""
    rids = [r for r in (ctx.notes.get("duplicated") or {}).values() if r]
    return len(rids) == 2 and all(
        stream_matches_row(stack.output_events(rid), next((r for r in rows if r["id"] == rid), None)) for rid in rids)


def stream_matches_row(events: list[OutputEvent], row: dict | None) -> bool:
    """Exactly one final event, and a done row stored what the stream carried: a task run twice shows as two
    final events or as interleaved deltas."""
    finals = [e for e in events if is_final(e)]
    streamed = "".join(e.text for e in events if isinstance(e, Delta))
    return len(finals) == 1 and row is not None and (row["status"] != "done" or streamed == (row["completion_text"] or ""))


# ---- between scenarios ----------------------------------------------------------------------------

def unready(stack: ChaosStack, served: dict[str, float] | None) -> dict[str, str]:
    """Worker hosts that are not registered, are quarantined, whose pool is missing, failed check_integrity
    or holds pages with nothing in flight, or (when `served` is given) that did not serve a probe: {host: why}."""
    live, pools = stack.live_by_host(), stack.pools()
    bad = {}
    for name in WORKERS:
        info = live.get(name)
        pool = pools.get(info.worker_id) if info else None
        why = ("not registered" if info is None else "quarantined" if info.quarantined
               else "no pool" if pool is None else pool["integrity"] if pool["integrity"] != "ok"
               else f"{pool['owned']} pages owned, {pool['dirty']} dirty" if pool["owned"] or pool["dirty"]
               else "served no probe" if served is not None and name not in served else "")
        if why:
            bad[name] = why
    return bad


async def _probe_all(stack: ChaosStack, planted: set[str], limit_s: float) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0)) as http:
        return await recover(stack, http, time.time(), limit_s, planted, [])


def ready(stack: ChaosStack, planted: set[str], tries: int = 3) -> list[str]:
    """Restarts worker hosts until every one is registered with an intact, drained pool and serves a probe;
    returns the hosts it restarted. (Today's periodic reaper can retire the pool of a worker that is still
    starting: the pool is registered before the worker is, and a listed pool with no live worker looks dead.)"""
    def settled(served):  # a worker that lost its registration may come back, pages of finished work drain
        deadline = time.monotonic() + 10
        while (bad := unready(stack, served)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return bad

    restarted = []
    for _ in range(tries):
        bad = settled(None) or settled(asyncio.run(_probe_all(stack, planted, limit_s=45)))
        if not bad:
            return restarted
        print(f"restarting {bad}", flush=True)
        for name in bad:
            stack.restart(name)
            restarted.append(name)
        stack.wait_registered(list(WORKERS))
    raise RuntimeError(f"workers {bad} do not serve after {tries} restarts; see {stack.logs}")


def restore(stack: ChaosStack, planted: set[str]) -> list[str]:
    """Brings every host back: Redis up, links up, processes continued, dead processes started again,
    then `ready` (which restarts a worker that does not serve); returns the hosts it restarted."""
    if not stack.redis_host.alive():
        stack.redis_host.start()
    for name in stack.hosts.hosts:
        stack.hosts.restore(name)
    restarted = []
    for name in [*WORKERS, "web", "beat"]:
        if stack.alive(name):
            stack.signal(name, signal.SIGCONT)
        else:
            stack.restart(name)
            restarted.append(name)
    restarted += ready(stack, planted)
    stack.wait_healthy()
    return restarted


# ---- the run --------------------------------------------------------------------------------------

COLUMNS = ["scenario", "done", "failed", "lost", "max_terminal_s", "foreign", "false_crit", "stranded",
           "integrity", "serve_again_s", "pass"]


def table_row(name: str, f: dict) -> dict:
    return {"scenario": name, "done": f["done"], "failed": f["failed"], "lost": f["lost"],
            "max_terminal_s": f["max_terminal_s"] if f["max_terminal_s"] is not None else "-",
            "foreign": f["foreign_sightings"], "false_crit": f["false_critical_incidents"],
            "stranded": f["stranded_pages"], "integrity": "ok" if f["integrity"] == "ok" else "FAIL",
            "serve_again_s": f["serve_again_s"] if f["serve_again_s"] is not None else "never",
            "pass": "yes" if f["passed"] else "NO: " + ",".join(f["checks_failed"])}


def code_version() -> str:
    """The commit measured, `-dirty` when the work tree differs from it."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=Path(__file__).parent, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default=",".join(BY_NAME), help=f"comma-separated, of: {', '.join(BY_NAME)}")
    parser.add_argument("--quick", action="store_true", help="control and cut_decode only (make test runs this)")
    parser.add_argument("--requests", type=int, default=10, help="client requests per scenario (two tenants)")
    parser.add_argument("--bound-s", type=float, default=60.0, help="terminal-state bound after the fault is lifted")
    parser.add_argument("--recovery-s", type=float, default=60.0, help="how long to probe for every worker serving")
    parser.add_argument("--drain-s", type=float, default=2 * LEASE_TTL_S + REAPER_S + 3.0)
    parser.add_argument("--workdir", help="keep the stack's logs, database and Redis dir here (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    names = ["control", "cut_decode"] if args.quick else args.scenarios.split(",")
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {list(BY_NAME)}")
    if args.requests < IN_FLIGHT_MIN:
        parser.error(f"--requests must be >= {IN_FLIGHT_MIN}")
    if os.geteuid() != 0:
        parser.error("the chaos suite creates network namespaces: run it as root")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvserve.settings")
    import django

    django.setup()  # only for the canary's sentinel generator: the harness reads the stack's own files
    logging.getLogger("httpx").setLevel(logging.WARNING)

    code = code_version()  # before the run: bench.all rewrites README.md and RESULTS.md after it
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvchaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    began = time.time()
    results, planted, stack, leftovers, stack_start_s, startup_restarts = {}, set(), None, [], None, []
    try:
        stack = ChaosStack(workdir)
        print(f"chaos run {stack.hosts.run}: hosts {', '.join(f'{n}={h.addr}' for n, h in stack.hosts.hosts.items())}; "
              f"logs in {workdir}", flush=True)
        stack.start()
        startup_restarts = ready(stack, planted)
        stack_start_s = round(time.time() - began, 1)
        print(f"stack up in {stack_start_s:.1f} s", flush=True)
        for name in names:
            t = time.time()
            print(f"--- {name}: {BY_NAME[name].what}", flush=True)
            figures = asyncio.run(run_scenario(stack, BY_NAME[name], args, planted))
            incident_base = stack.max_incident_id()
            figures["restarted"] = restore(stack, planted)
            late = [i for i in stack.incidents_after(incident_base) if i["severity"] == "critical"]
            figures["critical_during_restore"] = len(late)
            figures["wall_s"] = time.time() - t
            results[name] = figures
            print_table([table_row(name, figures)], COLUMNS)
    finally:
        if stack is not None:
            stack.close()
            leftovers = stack.hosts.leftovers() + [n for n, p in stack.procs.items() if p.poll() is None]
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print_table([table_row(n, f) for n, f in results.items()], COLUMNS, title="chaos suite (targets: 0 lost, "
                "0 foreign, 0 false critical, 0 stranded, integrity ok, every worker serving again <= 30 s)")
    for name, f in results.items():
        if not f["passed"]:
            detail = {k: f[k] for k in ("failed_codes", "lost_detail", "critical_detail", "foreign_detail",
                                        "stranded_detail", "integrity", "served", "restarted") if f.get(k)}
            print(f"{name}: failed {f['checks_failed']}: {detail}")
    passed = bool(results) and all(f["passed"] for f in results.values()) and not leftovers
    emit_json({"bench": "chaos", "run": stack.hosts.run if stack else None, "code": code,
               "order": list(results), "scenarios": results, "targets": TARGETS,
               "passed": passed, "failed": [n for n, f in results.items() if not f["passed"]],
               "cleanup_ok": not leftovers, "leftovers": leftovers, "wall_s": time.time() - began,
               "lease_ttl_s": LEASE_TTL_S, "bound_s": args.bound_s, "stack_start_s": stack_start_s,
               "startup_restarts": startup_restarts})
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())

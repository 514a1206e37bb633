"""The chaos suite's deployment: kvserve as separate test hosts (bench/hosts.py) — Redis, web (+ beat), one
prefill and two decode workers — and what the harness reads of it: rows and incidents (the SQLite file
on the shared filesystem), pools and registrations (the Redis host), worker ids mapped back to hosts.

The processes are tests/e2e/stack.py's, placed on their hosts by `launcher`. The harness restarts a
worker process that died, like a supervisor would.
"""
import datetime as dt
import json
import os
import signal
import sqlite3
import sys
import time
from collections import Counter
from pathlib import Path

from bench.hosts import Hosts, RedisHost
from inference.allocator import LedgerError
from inference.ledger import RedisLedger, pool_ids
from inference.registry import Registry, WorkerInfo
from inference.events import OutputEvent, event_decode
from inference.streams import OutputStream
from tests.e2e.stack import Stack

LEASE_TTL_S = 4
REGISTRY_TTL_S = 3
HEARTBEAT_S = min(LEASE_TTL_S, REGISTRY_TTL_S) / 3  # inference.worker's heartbeat interval
REAPER_S = 5  # the periodic reaper's interval, scaled like the TTLs (deployment default: 30 s)
TENANTS = ("chaos-a", "chaos-b")
HOSTS = ("redis", "web", "prefill", "decode1", "decode2")
WORKERS = {"prefill": ("prefill", "prefill,maintenance"), "decode1": ("decode", "decode"),
           "decode2": ("decode", "decode")}
HOST_OF = {"web": "web", "beat": "web", **{name: name for name in WORKERS}}
ENV = {
    "KVSERVE_NUM_PAGES": "160", "KVSERVE_WINDOW": "2048",  # 2560-token pools: small, still >= the window
    "KVSERVE_LEASE_TTL_S": str(LEASE_TTL_S), "KVSERVE_REGISTRY_TTL_S": str(REGISTRY_TTL_S),
    "KVSERVE_SSE_KEEPALIVE_S": "2", "KVSERVE_REQUEUE_AFTER_S": "15",  # scaled like the TTLs (default 60 s)
    "OMP_NUM_THREADS": "1",  # three engines share this machine's cores
}
FINAL = ("done", "failed", "rejected")

SETUP = """
import json
from django.core.management import call_command
from django_celery_beat.models import IntervalSchedule, PeriodicTask
from kvserve.tenants.models import Tenant
from kvserve.tenants.services import api_key_create
call_command("setup_schedules")
every, _ = IntervalSchedule.objects.get_or_create(every=%(reaper)d, period=IntervalSchedule.SECONDS)
reapers = PeriodicTask.objects.filter(task="kvserve.reap").update(interval=every, expire_seconds=%(reaper)d)
# the suite measures client traffic: scheduled canaries would add traffic of their own
disabled = PeriodicTask.objects.exclude(task="kvserve.reap").update(enabled=False)
keys = {}
for name in %(tenants)r:
    keys[name] = api_key_create(name)[1]
    Tenant.objects.filter(name=name).update(store_text=True)  # rows keep prompt and completion: sentinels
print(json.dumps({"keys": keys, "reapers": reapers, "disabled": disabled}))
"""


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def worker_pid(worker_id: str) -> int | None:
    """The pid inside `{role}-{hostname}-{pid}-{hex}` (inference.worker's worker ids)."""
    try:
        return int(worker_id.rsplit("-", 2)[1])
    except (IndexError, ValueError):
        return None


def parse_time(value: str | None) -> float | None:
    """A DateTimeField as Django stores it in SQLite (UTC, no offset) -> epoch seconds."""
    if not value:
        return None
    return dt.datetime.fromisoformat(value).replace(tzinfo=dt.timezone.utc).timestamp()


def pool_report(client, prefix: str, pool_id: str) -> dict:
    """A pool's pages owned (and by whom) / dirty / in no state / prefix-cached and unread
    (RedisLedger.snapshot), and its check_integrity verdict."""
    try:
        ledger = RedisLedger(client, pool_id, prefix=prefix)
        states = list(ledger.snapshot().values())
    except LedgerError as exc:  # the pool is gone (unregistered, or Redis lost it)
        return {"owned": 0, "dirty": 0, "lost": 0, "cached": 0, "owners": {}, "integrity": str(exc)}
    # a prefix-cached page nobody reads is held by its cache entry, not stranded; one with readers is
    cached = [s for s in states if isinstance(s, dict) and "scope" in s and not s["readers"]]
    owners = Counter(s["owner"] for s in states if isinstance(s, dict) and s not in cached)
    report = {"owned": sum(owners.values()), "dirty": states.count("dirty"), "lost": states.count("lost"),
              "cached": len(cached), "owners": dict(sorted(owners.items())), "integrity": "ok"}
    try:
        ledger.check_integrity()
    except Exception as exc:
        report["integrity"] = str(exc)
    return report


class ChaosStack(Stack):
    def __init__(self, workdir: Path):
        workdir = Path(workdir)
        self.hosts = Hosts(list(HOSTS)).create()
        try:
            self.redis_host = RedisHost(self.hosts, "redis", workdir)
            web = self.hosts.hosts["web"].addr
            super().__init__(workdir, redis_url=self.redis_host.url, web_host=web, DJANGO_ALLOWED_HOSTS=web, **ENV)
        except Exception:
            self.hosts.close()
            raise
        self.db_path = workdir / "db.sqlite3"
        self.broker_prefix = self.env["KVSERVE_BROKER_PREFIX"]
        self.keys: dict[str, str] = {}

    def launcher(self, name: str) -> list[str]:
        return self.hosts.exec_prefix(HOST_OF[name])

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "ChaosStack":
        self.redis_host.start()
        self.manage("migrate", "--noinput")
        setup = last_json(self.manage("shell", "-c", SETUP % {"reaper": REAPER_S, "tenants": TENANTS}))
        if not setup["reapers"]:
            raise RuntimeError("setup_schedules created no kvserve.reap task: the suite needs the periodic reaper")
        self.keys = setup["keys"]
        for name in WORKERS:
            self.start_host(name)
        self.start_web()
        self.wait_healthy()
        self.wait_registered(list(WORKERS))
        self.start_host("beat")  # once the workers are registered: see chaos.ready() on reaping at start
        return self

    def start_host(self, name: str) -> None:
        if name == "web":
            self.start_web()
        elif name == "beat":
            self.spawn("beat", [sys.executable, "-m", "celery", "-A", "kvserve", "beat", "--loglevel", "INFO"])
        else:
            role, queues = WORKERS[name]
            self.start_worker(role, name=name, queues=queues)

    def restart(self, name: str, sig=signal.SIGKILL) -> None:
        self.stop(name, sig=sig)
        self.start_host(name)

    def signal(self, name: str, sig) -> None:
        os.killpg(self.procs[name].pid, sig)

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def close(self) -> None:
        try:
            for name in list(self.procs):
                if self.alive(name):
                    self.signal(name, signal.SIGCONT)
                self.stop(name, sig=signal.SIGKILL, timeout_s=10)
            self.redis_host.kill()
        finally:
            self.hosts.close()

    # ---- who is who ----------------------------------------------------------------------------
    def registry(self) -> Registry:
        return Registry(self.redis_host.client(), prefix=self.prefix, ttl_s=REGISTRY_TTL_S)

    def host_of(self, worker_id: str) -> str | None:
        pid = worker_pid(worker_id or "")
        return next((n for n in WORKERS if self.alive(n) and self.procs[n].pid == pid), None)

    def live_by_host(self) -> dict[str, WorkerInfo]:
        """Registered workers of the processes running now, by host (none for a host not registered)."""
        out = {}
        for w in self.registry().live_workers():
            host = self.host_of(w.worker_id)
            if host:
                out[host] = w
        return out

    def wait_registered(self, names: list[str], timeout_s: float = 120) -> float:
        """Waits until each named host's current process is registered; returns when (epoch seconds)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if set(names) <= self.live_by_host().keys():
                    return time.time()
            except Exception:
                pass
            for name in names:
                if not self.alive(name):
                    raise RuntimeError(f"{name} exited: {self.tail(name)}")
            time.sleep(0.2)
        raise TimeoutError(f"{names} did not register within {timeout_s}s: {self.tail(names[0])}")

    # ---- the database (read-only, plain sqlite3: the harness needs no Django) ---------------------
    def _query(self, sql: str, args=()) -> list[sqlite3.Row]:
        conn = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=20)
        conn.row_factory = sqlite3.Row
        try:
            return conn.execute(sql, args).fetchall()
        finally:
            conn.close()

    def rows_since(self, since: float) -> list[dict]:
        """The chaos tenants' ChatRequest rows created at or after `since` (epoch seconds)."""
        stamp = dt.datetime.fromtimestamp(since - 1, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")
        rows = self._query(
            "SELECT r.id, r.status, r.error_code, r.prefill_worker, r.decode_worker, r.prompt_text, "
            "r.completion_text, r.completion_tokens, r.finished_at, r.created_at FROM chat_chatrequest r "
            "JOIN tenants_tenant t ON t.id = r.tenant_id WHERE t.name IN (?, ?) AND r.created_at >= ?",
            (*TENANTS, stamp))
        return [dict(r) for r in rows]

    def max_incident_id(self) -> int:
        return self._query("SELECT COALESCE(MAX(id), 0) FROM incidents_incident")[0][0]

    def incidents_after(self, incident_id: int) -> list[dict]:
        return [dict(r) for r in self._query(
            "SELECT id, kind, severity, pool, worker, detected_by, reader_request FROM incidents_incident "
            "WHERE id > ? ORDER BY id", (incident_id,))]

    # ---- pools -----------------------------------------------------------------------------------
    def pools(self) -> dict[str, dict]:
        """pool_report of every live worker's pool, by pool id."""
        client = self.redis_host.client()
        return {w.worker_id: pool_report(client, self.prefix, w.worker_id)
                for w in Registry(client, prefix=self.prefix, ttl_s=REGISTRY_TTL_S).live_workers()}

    def listed_pools(self) -> set[str]:
        return set(pool_ids(self.redis_host.client(), self.prefix))

    # ---- the broker ------------------------------------------------------------------------------
    def broker_key(self, name: str) -> str:
        """Celery's Redis transport prefixes every key with global_keyprefix (KVSERVE_BROKER_PREFIX), as
        incidents.canary.live.broker_queue_key does; `unacked` holds the messages being worked on."""
        return f"{self.broker_prefix}{name}"

    def unacked_message(self, task: str, request_id: str) -> dict | None:
        """The message of `task` for `request_id` that a worker holds right now (acks_late: not acked yet)."""
        for raw in self.redis_host.client().hvals(self.broker_key("unacked")):
            payload = json.loads(raw)[0]
            headers = payload.get("headers") or {}
            if headers.get("task") == task and (headers.get("argsrepr") or "").startswith(f"('{request_id}'"):
                return payload
        return None

    def redeliver(self, payload: dict, queue: str) -> None:
        """Puts a copy of a message back on its queue the way kombu restores an unacked one (redelivered
        flags, RPUSH: the next one consumed)."""
        payload = json.loads(json.dumps(payload))
        payload.setdefault("headers", {})["redelivered"] = True
        payload.setdefault("properties", {}).setdefault("delivery_info", {})["redelivered"] = True
        self.redis_host.client().rpush(self.broker_key(queue), json.dumps(payload))

    def output_events(self, request_id: str) -> list[OutputEvent]:
        """Every event on the request's output stream, in order."""
        outputs = OutputStream(self.redis_host.client(), prefix=self.prefix)
        return [event_decode(fields[b"e"]) for _, fields in outputs.redis.xrange(outputs.key(request_id))]

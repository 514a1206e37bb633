"""A real kvserve stack for end-to-end tests: Celery prefill and decode worker processes, the ASGI
web server under uvicorn, a migrated database (a SQLite file, or DATABASE_URL=... given to Stack, e.g. a
throwaway PostgreSQL database), all on this test's own Redis key prefixes."""
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import psycopg
import redis

from inference.memory import process_env
from inference.registry import Registry
from inference.threads import budget_path

ROOT = Path(__file__).resolve().parents[2]
TEST_REDIS_URL = os.environ.get("KVSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """Every process on this host by default; a subclass places each on a host of its own by overriding
    `launcher` (bench/hosts.py runs them in network namespaces)."""

    def __init__(self, workdir: Path, *, redis_url: str = TEST_REDIS_URL, web_host: str = "127.0.0.1", **env):
        self.workdir = Path(workdir)
        self.prefix = f"kvstest-e2e-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.web_host = web_host
        self.url = f"http://{web_host}:{self.port}"
        self.redis = redis.Redis.from_url(redis_url)
        self.env = {
            **process_env(dict(os.environ)),
            "REDIS_URL": redis_url,
            "KVSERVE_LEDGER_PREFIX": self.prefix,
            "KVSERVE_BROKER_PREFIX": f"{self.prefix}:broker:",
            "DATABASE_URL": f"sqlite:///{self.workdir / 'db.sqlite3'}",
            "KVSERVE_SECRETS_FILE": str(self.workdir / "secrets.json"),
            "KVSERVE_NUM_PAGES": "600",
            "KVSERVE_WINDOW": "8192",
            "KVSERVE_LEASE_TTL_S": "4",
            "KVSERVE_REGISTRY_TTL_S": "3",
            "KVSERVE_WORKER_CONCURRENCY": "32",
            "KVSERVE_THROTTLE_RATE": "100000/min",
            # most e2e tests and benchmarks send one tenant's bursts: fair share is off by default here and set
            # per tenant (Tenant.max_in_flight / kv_share) where it is tested (tests/e2e/test_fairness.py)
            "KVSERVE_TENANT_MAX_IN_FLIGHT": "0",
            "KVSERVE_TENANT_KV_SHARE": "0",
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = Path(env.get("KVSERVE_LOG_DIR") or self.workdir / "logs")  # the stack's own, never a shared one
        self.logs.mkdir(parents=True, exist_ok=True)

    def manage(self, *args) -> str:
        out = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True,
                             text=True, timeout=300)
        if out.returncode:
            raise RuntimeError(f"manage.py {' '.join(args)} failed: {out.stderr[-3000:]}")
        return out.stdout

    def manage_status(self, *args, timeout_s: float = 600) -> subprocess.CompletedProcess:
        """manage.py with its exit status (returncode, stdout, stderr), for commands whose failure is the answer."""
        return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True,
                              text=True, timeout=timeout_s)

    def launcher(self, name: str) -> list[str]:
        """The command prefix that runs process `name` on its host (none: this host)."""
        return []

    def spawn(self, name: str, cmd: list[str], **env) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen([*self.launcher(name), *cmd], cwd=ROOT, env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_worker(self, role: str, name: str | None = None, queues: str | None = None, **env) -> subprocess.Popen:
        name = name or role
        return self.spawn(name, [sys.executable, "-m", "celery", "-A", "kvserve", "worker", "-Q", queues or role,
                                 "-n", f"{name}-{self.prefix}@%h", "--loglevel", "INFO", "--without-mingle",
                                 "--without-gossip"], **env)

    def start_web(self, **env) -> None:
        self.spawn("web", [sys.executable, "-m", "uvicorn", "kvserve.asgi:application", "--host", self.web_host,
                           "--port", str(self.port), "--log-level", "warning"], **env)

    def sql(self, query: str, *params) -> list[tuple]:
        """Rows of one query on the stack's database, SQLite or PostgreSQL (`?` placeholders)."""
        url = self.env["DATABASE_URL"]
        if url.startswith("sqlite:///"):
            with sqlite3.connect(url.removeprefix("sqlite:///")) as db:
                return db.execute(query, params).fetchall()
        with psycopg.connect(url.replace("postgres://", "postgresql://", 1), connect_timeout=10) as db:
            return db.execute(query.replace("?", "%s"), params).fetchall()

    def start(self, web_env: dict | None = None) -> "Stack":
        self.manage("migrate", "--noinput")
        creds = json.loads(self.manage("bootstrap_demo").strip().splitlines()[-1])
        self.api_key, self.admin_password = creds["api_key"], creds["admin_password"]
        self.metrics_token = creds["metrics_token"]
        self.start_worker("prefill", queues="prefill,maintenance")
        self.start_worker("decode")
        self.start_web(**(web_env or {}))
        self.wait_healthy()
        return self

    def metrics_request(self) -> urllib.request.Request:
        """GET /metrics with the stack's metrics token."""
        return urllib.request.Request(self.url + "/metrics", headers={"Authorization": f"Bearer {self.metrics_token}"})

    def registry(self) -> Registry:
        return Registry(self.redis, prefix=self.prefix, ttl_s=3)

    def wait_healthy(self, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None and name in ("web",):
                    raise RuntimeError(f"{name} exited: {self.tail(name)}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as r:
                    return json.loads(r.read())
            except Exception as exc:
                last = exc
            time.sleep(0.3)
        raise TimeoutError(f"stack not healthy: {last}; logs: {self.tail('prefill')} {self.tail('decode')}")

    def wait_workers(self, role: str, count: int, timeout_s: float = 60) -> list:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = self.registry().live_workers(role)
            if len(live) >= count:
                return live
            time.sleep(0.2)
        raise TimeoutError(f"{count} {role} workers did not register")

    def tail(self, name: str, n: int = 4000) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def stop(self, name: str, sig=signal.SIGTERM, timeout_s: float = 20) -> None:
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        os.killpg(p.pid, sig)
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)
        budget_path(self.prefix).unlink(missing_ok=True)  # its workers' core budget (a killed worker leaves it)
        try:
            keys = list(self.redis.scan_iter(match=f"{self.prefix}*", count=1000))
        except redis.ConnectionError:  # a Redis of the test's own, already gone
            return
        for i in range(0, len(keys), 500):
            self.redis.delete(*keys[i:i + 500])


class OwnRedis:
    """A redis-server of a test's own on a free port, for tests that restart or pause Redis."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.workdir = Path(workdir)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self) -> "OwnRedis":
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--maxmemory-policy", "noeviction",
                                      "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart_empty(self) -> None:
        """Killed and started again on the same port without its data (no persistence)."""
        self.stop()
        self.start()

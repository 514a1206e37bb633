"""No ledger error strands a page: a real fault (the worker's Redis connections killed, its redis-server paused
so that a command runs after its reply was lost, or restarted from its AOF) injected at each ledger call site
of a prefill worker (prefix cache on, a pool small enough to evict) and a decode worker. Every request ends,
none `engine_error`; once Redis answers and every request has ended, the engine keeps no sequence and, in
each pool, the pages owned are exactly the cached pages the worker's prefix index knows (no request holds
any), with the ledger's integrity intact. The redis-server is this test's own (never the shared one)."""
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from inference.engine import EngineConfig
from inference.faults import Faults
from inference.retry import BACKOFF_S
from inference.sequence import SeqStatus
from inference.worker import RequestFailed, RuntimeOptions, WorkerRuntime
from tests.e2e.stack import free_port
from tests.inference.helpers import greedy

KEY = b"k" * 32
SALTS = ("a" * 64, "b" * 64)


class AofRedis:
    """A redis-server of this test's own, persisting every write (appendfsync always), so a restart keeps the
    ledger; pause/resume are SIGSTOP/SIGCONT of its process."""

    def __init__(self, workdir: Path):
        self.port, self.workdir, self.proc = free_port(), workdir, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "AofRedis":
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--maxmemory-policy", "noeviction", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 20
        while True:
            try:
                probe.ping()
                return self
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture
def own_redis(tmp_path):
    server = AofRedis(tmp_path).start()
    yield server
    server.resume() if server.proc.poll() is None else None
    server.kill()


def worker_client(url):
    """The workers' client: a dead connection or a silent server is an error at once (no retry here), so the
    fault reaches the call site it was injected at."""
    return redis.Redis.from_url(url, socket_timeout=0.3, socket_connect_timeout=0.3, retry=Retry(NoBackoff(), 0))


class Fault:
    """Injects `kind` into the Redis under a worker just before its ledger's `nth` call of script `site`."""

    def __init__(self, server: AofRedis, admin: redis.Redis, kind: str):
        self.server, self.admin, self.kind = server, admin, kind
        self.fired = threading.Event()

    def arm(self, runtime, site: str, nth: int = 1) -> None:
        real, seen = runtime.ledger._call, [0]

        def call(name, *args, **kw):
            if name == site == "claim_dirty" and not self.admin.scard(runtime.ledger.key("dirty")):
                return real(name, *args, **kw)  # a claim with nothing to claim would lose nothing
            if name == site and not self.fired.is_set():
                seen[0] += 1
                if seen[0] == nth:
                    self.fired.set()
                    self.inject()
            return real(name, *args, **kw)

        runtime.ledger._call = call

    def _kill(self) -> None:
        self.admin.client_kill_filter(_type="normal", skipme=True)
        self.admin.execute_command("CLIENT", "UNPAUSE")

    def inject(self) -> None:
        if self.kind == "kill":  # the call waits on a write pause, then its connection is killed under it
            self.admin.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
            threading.Timer(0.1, self._kill).start()
        elif self.kind == "pause":  # the command is sent, times out, and runs when the server resumes
            self.server.pause()
            threading.Timer(1.0, self.server.resume).start()
        elif self.kind == "restart":  # down for a moment, back with its data (AOF)
            self.server.kill()
            threading.Timer(0.5, self.server.start).start()
        elif self.kind == "outage":  # down longer than a dropped connection's repeats wait (inference.retry)
            self.server.kill()
            threading.Timer(sum(BACKOFF_S) + 1.0, self.server.start).start()


def wait_until(predicate, timeout_s=30.0, what="it"):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except redis.RedisError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def attempt(fn):
    """Runs one request; its outcome: 'ok', or the code it failed with."""
    try:
        fn()
        return "ok"
    except RequestFailed as exc:
        return exc.code
    except redis.RedisError as exc:  # the task thread's own Redis call (transport, output stream) failed
        return type(exc).__name__


def workload(prefill, decode, round_: int = 0) -> list[str]:
    """Two tenants with shared prefixes: cache, hit, unread, evict (16-page prefill pool), grant, grow, free."""
    outcomes = []
    base = [list(range(10 + 50 * t, 42 + 50 * t)) for t in range(2)]  # 32 tokens: two full pages per tenant
    for i in range(8):
        t = i % 2
        prompt = base[t] + [(100 + 7 * i + j) % 240 + 5 for j in range(8 + 16 * (i % 3))]
        rid = f"r{round_}-{i}"

        def run():
            h = prefill.prefill(rid, prompt, greedy(20), salt=SALTS[t], timeout_s=30)
            decode.decode(rid, prompt, greedy(20), h.to_dict(), timeout_s=30)

        outcomes.append(attempt(run))
    return outcomes


def server_ms(client) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def drain_and_check(runtime, admin):
    """After every request ended: leases nobody renews are reaped (a far-future beat), the dirty pages scrubbed
    and marked clean; then the engine holds no sequence and the pool's owned pages are its cached pages."""
    e = runtime.engine
    wait_until(lambda: not runtime._futures and not runtime._pending, what="requests to end")
    for k in (1, 2):  # the second beat, past every lease the first renewed, reaps owners that the first one's
        # deferred settlements (retried after its renewals) let go
        wait_until(lambda: runtime.beat(now_ms=server_ms(admin) + k * 10**9) or True, what="a beat")
    wait_until(lambda: not runtime._unclean and not admin.smembers(runtime.ledger.key("dirty")),
               what="dirty pages to be scrubbed")
    assert e.seqs == {}, f"sequences left in the engine: {e.seqs}"
    snap = runtime.ledger.snapshot()
    owned = {p: s for p, s in snap.items() if isinstance(s, dict)}
    cached = {p for p, s in owned.items() if "scope" in s}
    indexed = set(e.prefix_cache.lru) if e.prefix_cache is not None else set()
    assert set(owned) == cached, f"pages held by no request and no cache entry: {set(owned) - cached}"
    assert cached == indexed, f"cached pages the worker's index does not know: {cached - indexed}"
    assert all(not s["readers"] for s in owned.values())
    runtime.ledger.check_integrity()
    zero = [p for p, s in snap.items() if s == "free"]
    assert float(e.pool.data[zero].abs().sum()) == 0.0  # every free page scrubbed


@pytest.fixture
def stack(own_redis, tiny_model):
    admin = redis.Redis.from_url(own_redis.url)
    client = worker_client(own_redis.url)
    opts = RuntimeOptions(prefix="kvsfault", lease_ttl_s=30, registry_ttl_s=1.5)  # a beat every 0.5 s
    made = []

    def make(role, num_pages, faults=Faults()):
        cfg = EngineConfig(num_pages=num_pages, page_size=16, window=num_pages * 16, prefix_cache=True,
                           faults=faults)
        rt = WorkerRuntime(role, client, KEY, model=tiny_model, config=cfg, options=opts,
                           on_fatal=lambda runtime, reason: None)
        for script in rt.ledger._lua.values():  # cached in Redis: a paused call then runs after its reply was
            admin.script_load(script.script)  # lost (a first EVALSHA would only answer NOSCRIPT)
        made.append(rt)
        return rt

    yield make, admin
    for rt in made:
        try:
            rt.stop()
        except Exception:
            pass


PREFILL_SITES = ["cache", "evict", "hit", "unread", "grant", "free", "beat", "claim_dirty", "mark_clean"]
DECODE_SITES = ["grant", "free", "beat"]


CASES = [(kind, role, site) for kind in ("kill", "pause", "restart")
         for role, site in [("prefill", s) for s in PREFILL_SITES] + [("decode", s) for s in DECODE_SITES]]


@pytest.mark.parametrize("kind, role, site", CASES)
def test_a_redis_fault_at_a_ledger_call_strands_no_page(stack, own_redis, kind, role, site):
    make, admin = stack
    prefill, decode = make("prefill", 8), make("decode", 32)
    target = prefill if role == "prefill" else decode
    target.ledger.allocate("stuck", 1)  # an owner nobody renews: reaped, scrubbed, marked clean
    target.ledger.renew_leases(["stuck"], ttl_s=0.05)
    fault = Fault(own_redis, admin, kind)
    fault.arm(target, site, nth=2 if site in ("cache", "grant", "free") else 1)
    outcomes = workload(prefill, decode)
    for round_ in range(1, 30):  # a fast CPU ends a round before the first beat (every 0.5 s): go on until it fires
        if fault.fired.is_set():
            break
        outcomes += workload(prefill, decode, round_)
    assert fault.fired.is_set(), f"no {site} call: the workload did not reach the call site"
    wait_until(lambda: admin.ping(), what="Redis back")
    assert "engine_error" not in outcomes, outcomes
    assert outcomes.count("ok") >= 5, outcomes  # one fault costs a request or two, not the worker
    for rt in (prefill, decode):
        drain_and_check(rt, admin)
    assert prefill.serving and decode.serving


@pytest.mark.parametrize("kind", ["kill", "pause", "restart"])
def test_a_redis_fault_at_the_release_of_a_violating_request_leaves_no_page_unscrubbed(stack, own_redis, kind):
    """The guard fails a request closed (fault foreign_page_once) and releases whatever the ledger lists for it:
    a release whose reply is lost (pause: it runs after the worker gave up) has freed its pages in the ledger,
    so the worker scrubs what it granted that request before asking. After drain every free page is zero."""
    make, admin = stack
    prefill, decode = make("prefill", 8), make("decode", 32, faults=Faults({"foreign_page_once"}))
    fault = Fault(own_redis, admin, kind)
    fault.arm(decode, "release")
    prompt = list(range(10, 58))
    outcome = attempt(lambda: decode.decode("v", prompt, greedy(8),
                                            prefill.prefill("v", prompt, greedy(8), timeout_s=30).to_dict(),
                                            timeout_s=30))
    assert fault.fired.is_set() and outcome == "kv_isolation_violation", outcome
    wait_until(lambda: admin.ping(), what="Redis back")
    for rt in (prefill, decode):
        drain_and_check(rt, admin)


def test_reads_redis_could_not_end_end_once_it_is_back_not_when_the_lease_runs_out(stack, own_redis):
    """A request that read cached pages ends while Redis is down past the repeats (its unread never runs): the
    unread waits as a deferred settlement and goes through at the first beat once Redis is back, long before
    the reader's lease (30 s here) would be reaped, so the cached pages are evictable again within a beat."""
    make, admin = stack
    prefill, decode = make("prefill", 8), make("decode", 32)
    fault = Fault(own_redis, admin, "outage")
    fault.arm(prefill, "unread")
    prefix = list(range(10, 42))  # two full pages: cached by the first request, read by the second
    for i in range(2):
        prompt = prefix + [50 + i, 60 + i, 70 + i]
        attempt(lambda: decode.decode(f"u{i}", prompt, greedy(4), prefill.prefill(
            f"u{i}", prompt, greedy(4), salt=SALTS[0], timeout_s=30).to_dict(), timeout_s=30))
    assert fault.fired.is_set(), "the second request read no cached page"
    wait_until(lambda: admin.ping(), what="Redis back")

    def readers():
        return {p: s["readers"] for p, s in prefill.ledger.snapshot().items() if isinstance(s, dict) and s["readers"]}

    wait_until(lambda: not readers(), timeout_s=10, what="the deferred unread (beats every 0.5 s; lease 30 s)")
    assert prefill.ledger.reads_of("u1") == []
    for rt in (prefill, decode):
        drain_and_check(rt, admin)

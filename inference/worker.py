"""One worker process's engine host: the engine with its Redis-ledger pool, one continuous-batching loop
thread that owns the engine, an outbox thread that publishes its output events (the loop never waits for Redis
to take them: inference/outbox.py), and a heartbeat thread (leases, dirty pages, registry, quarantine, and a
watchdog on the loop).

Task threads (Celery's threads pool) call `prefill()` / `decode()`, which block until the loop has finished
their request; every request of the process shares the loop's batch. Everything handed to the loop is a
typed command. Every request the loop gives up on gets an error event and a `RequestFailed` with its code:

  lease_lost          the ledger took the request's pages back (its lease was reaped); scrubbed here
  pool_lost           the pool's records vanished from Redis; the whole tensor is scrubbed and a new pool
                      generation registered, without a restart
  kv_isolation_violation  the read guard stopped it (a critical incident; the worker is quarantined)
  engine_error        a step raised; the loop fails the requests in it and goes on
  timeout, or a Cancel's code (client_disconnected, worker_lost, ...)  someone gave up on it

A loop that cannot go on (failures that persist, or no progress for `loop_stall_s`) is never advertised:
the worker unregisters and exits with EXIT_LOOP_DEAD for its supervisor to restart it.
"""
import dataclasses
import logging
import os
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import redis as redis_lib
import torch

from inference.allocator import LedgerError, PoolLost
from inference.arith import cdiv
from inference.cancel import Cancel, Cancellations
from inference.choices import best_choices, choice_params, request_of
from inference.engine import Engine, EngineConfig, engine_kv_dtype, engine_precision
from inference.events import ChoiceEnd, Delta, Done, Error, OutputEvent, Usage
from inference.fair_queue import TenantQueues
from inference.handoff import DecodeSide, Handoff, Verdict, handoff_accept
from inference.host_ledger import UNREACHABLE, HostLedger
from inference.ledger import RedisLedger, check_eviction_policy
from inference.loader import load_model, model_name
from inference.metrics import WorkerMetrics
from inference.outbox import Outbox
from inference.precision import precision_scope
from inference.prefill import Exported, prefill_export, prefill_handoff, prefill_refusal
from inference.probes import PROBES
from inference.registry import Registry, WorkerInfo, WorkerNotRegistered
from inference.scheduler import RequestTooLarge
from inference.sequence import SamplingParams, Sequence, SeqStatus
from inference.settings import runtime_settings
from inference.streams import OutputStream
from inference.threads import CoreBudget
from inference.transport import RedisTransport

log = logging.getLogger(__name__)

CLIENT_ISOLATION_ERROR = "the request was stopped by a KV-cache isolation check; no content was returned"
LEASE_LOST_ERROR = ("the request's page lease expired before it finished (its worker was paused or cut off "
                    "from Redis); its pages were scrubbed and no further content will come")
POOL_LOST_ERROR = ("the worker's page pool vanished from Redis (restart, failover or flush); the request was "
                   "stopped, the worker scrubbed its pages and serves again")
EXIT_LOOP_DEAD = 70  # the process exit status when the engine loop cannot go on


class WindowTooLarge(Exception):
    """The pool holds fewer tokens than the window the worker would serve (invariant 4)."""


class RequestFailed(Exception):
    """A request this worker gave up on; `code` is what the client and the request's row show."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass
class RuntimeOptions:
    prefix: str = "kvs"
    lease_ttl_s: float = 30.0
    registry_ttl_s: float = 15.0
    clamp_window: bool = False
    transport_ttl_s: int = 300
    loop_stall_s: float = 300.0  # no loop progress for this long: the worker exits
    loop_max_failures: int = 3  # consecutive failed loop iterations before the worker exits
    cancel_poll_s: float = 0.1  # how often the loop looks for cancelled requests

    @classmethod
    def from_env(cls) -> "RuntimeOptions":
        return cls(**runtime_settings())  # inference/settings.py: strict, SettingError naming the variable

    @property
    def heartbeat_s(self) -> float:
        return max(0.2, min(self.registry_ttl_s, self.lease_ttl_s) / 3)


def check_window(num_pages: int, page_size: int, window: int, clamp: bool) -> int:
    """The window this worker may serve, or WindowTooLarge naming the settings to change."""
    capacity = num_pages * page_size
    if capacity >= window:
        return window
    if clamp:
        log.warning("KVSERVE_CLAMP_WINDOW: serving a window of %d tokens (pool) instead of %d", capacity, window)
        return capacity
    raise WindowTooLarge(
        f"pool holds {capacity} tokens ({num_pages} pages x {page_size}) but the window is {window}: "
        f"set KVSERVE_NUM_PAGES >= {cdiv(window, page_size)}, or lower KVSERVE_WINDOW to <= {capacity}, "
        f"or set KVSERVE_CLAMP_WINDOW=1 to serve {capacity} tokens"
    )


def check_leases(engine: Engine, host: HostLedger, owners) -> list[tuple[Sequence, list[int]]]:
    """Owners a beat renewed that held no lease: each one the ledger no longer lists as holding what this
    engine has for it loses it here (its pages scrubbed and forgotten, whatever the ledger still lists for
    it released). Shared pages are asked of their real owner: a request's own pages and its reads of cached
    pages, a cache entry's cached pages. Returns the requests that failed, with the pages taken back; stops
    (the next beat asks again) when Redis cannot answer."""
    failed = []
    for owner in owners:
        pages, epochs, reads = engine.held_by(owner)
        try:
            if pages and host.holds(owner, pages, epochs) and set(reads) <= set(host.reads_of(owner)):
                continue  # granted again since the beat
        except UNREACHABLE:
            break
        failed += [(seq, pages) for seq in engine.reclaim(pages)]
        host.release(owner)  # whatever the ledger still lists for it (scrubbed above)
    return failed


def new_worker_id(role: str) -> str:
    """role-host-pid-xxxx; the host part is cut so that an id always fits the fields that store it."""
    return f"{role}-{socket.gethostname()[:64]}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def exit_process(runtime, reason: str) -> None:
    """The default for a loop that cannot go on: give task threads a moment to record their failures,
    then exit non-zero so the supervisor starts a fresh process."""
    time.sleep(2)
    os._exit(EXIT_LOOP_DEAD)


# ---- commands to the engine loop (the only thread that touches the engine) ----------------------

@dataclass(frozen=True)
class PrefillCommand:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    salt: str | None = None  # the request's prefix-cache scope (server-derived); None: no cache
    future: Future = field(default_factory=Future, compare=False)
    choices: int = 1  # sequences the request generates (n, or best_of): each one's first token is sampled here
    score: bool = False  # best_of > n: their logprobs are computed to rank them


@dataclass(frozen=True)
class DecodeCommand:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    first_token: int
    blob: torch.Tensor = field(compare=False)
    num_transferred: int
    first_logprobs: tuple | None = field(default=None, compare=False)  # (logprob, top) of first_token, if asked
    cached_tokens: int = 0  # of the prompt, read from prefill's prefix cache (reported in usage)
    future: Future = field(default_factory=Future, compare=False)
    choice_tokens: tuple[int, ...] = ()  # n > 1 choices: the verified handoff's first token of each (a fork)
    choice_logprobs: list | None = field(default=None, compare=False)
    returned: int = 1  # choices the answer returns (n)
    score: bool = False  # best_of > n: the n with the highest cumulative logprob are returned

    @property
    def tenant(self) -> str:
        return self.params.tenant


@dataclass
class ChoiceRun:
    """A request of n choices this worker decodes: its sequences, how many the answer returns and whether they are
    ranked (best_of); its one Done goes out when the last choice ends."""

    seqs: list[Sequence]
    returned: int
    ranked: bool
    cached_tokens: int = 0

    def done(self) -> Done:
        ends = [ChoiceEnd(s.index, s.finish_reason, len(s.output_ids), s.cumulative_logprob) for s in self.seqs]
        chosen = best_choices(ends, self.returned, self.ranked)
        usage = Usage(self.seqs[0].num_prompt_tokens, sum(c.completion_tokens for c in chosen), self.cached_tokens)
        return Done(chosen[0].finish_reason, usage, tuple(chosen))

    def answer(self) -> list[Sequence]:
        """The returned choices' sequences, in answer order."""
        by_index = {s.index: s for s in self.seqs}
        return [by_index[c.index] for c in self.done().choices]


@dataclass(frozen=True)
class ReclaimCommand:
    """Dirty pages this worker claimed in pool `generation`: fail whoever still holds one (lease lost),
    scrub, mark clean."""

    generation: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class LeaseCheckCommand:
    """Owners the heartbeat renewed in pool `generation` that hold no lease: those still running lost it."""

    generation: int
    owners: tuple[str, ...]


@dataclass(frozen=True)
class CancelCommand:
    cancel: Cancel


@dataclass(frozen=True)
class PoolLostCommand:
    """The heartbeat found the pool gone while it was at `generation`."""

    generation: int
    reason: str


@dataclass(frozen=True)
class StopCommand:
    pass


@dataclass(frozen=True)
class ProbeCommand:
    """A canary probe (inference.probes) run by the loop on the engine; its result goes to `future`."""

    name: str
    future: Future = field(default_factory=Future, compare=False)


PRECISION_CLAIM_TTL_S = 120.0  # how long one worker's claim to time `auto` holds (auto takes seconds)


def precision_agree(registry: Registry, model, config: EngineConfig, *, time_choice=engine_precision,
                    claim_ttl_s: float = PRECISION_CLAIM_TTL_S, poll_s: float = 0.2, sleep=time.sleep) -> str:
    """KVSERVE_PRECISION=auto across a deployment: the mode the first worker of this model, device and CPU
    (inference.precision.precision_scope) timed, so every prefill and decode worker of it runs one precision
    and their handoffs match. This worker times only when none has yet, and only while it holds the scope's
    timing claim: the others wait for its proposal rather than time on the same cores at once (a host's
    workers start together; timed side by side, one candidate's stall once made auto pick a mode 2.8x slower
    for one stream). A claim lapses after `claim_ttl_s`, so a worker that dies timing delays the rest, no more."""
    scope = precision_scope(model.fingerprint, torch.device(config.device))
    token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    agreed = registry.precision_agreed(scope)
    while agreed is None:
        if registry.precision_timing_claim(scope, token, claim_ttl_s):
            try:
                choice = time_choice(model, config)
                log.info("precision auto timed here: %s", choice.line())
                agreed = registry.precision_propose(scope, choice.mode)
            finally:
                registry.precision_timing_release(scope, token)
        else:
            sleep(poll_s)
            agreed = registry.precision_agreed(scope)
    log.info("precision auto: %s, the deployment's choice for scope %s", agreed, scope)
    return agreed


def resolve(fut: Future | None, result=None, failure: Exception | None = None):
    """The outbox callback that ends a request's future once its final event went out (None: no future)."""
    if fut is None:
        return None

    def then() -> None:
        try:
            if failure is not None:
                fut.set_exception(failure)
            else:
                fut.set_result(result)
        except InvalidStateError:  # it ended meanwhile (the worker stopping failed it)
            pass
    return then


class WorkerRuntime:
    def __init__(self, role: str, redis, handoff_key: bytes, *, model=None, config: EngineConfig | None = None,
                 options: RuntimeOptions | None = None, node: str = "", on_violation=None, on_reclaim=None, on_lease_lost=None,
                 on_quarantine=None, on_fatal=None, clock=time.monotonic, cores: CoreBudget | None = None):
        self.role = role
        self.cores = cores  # the host's thread budget shared with its other workers; None: threads stay fixed
        self.redis = redis
        self.handoff_key = handoff_key
        self.clock = clock  # the loop's progress stamp, the watchdog and the loop's timers read it (tests move it)
        self.options = opts = options or RuntimeOptions.from_env()
        check_eviction_policy(redis)
        model = model or load_model()
        config = config or EngineConfig.from_env()
        self.registry = Registry(redis, prefix=opts.prefix, ttl_s=opts.registry_ttl_s)
        if config.precision == "auto":  # before the pool is sized: the mode decides the KV dtype (auto)
            config = dataclasses.replace(config, precision=precision_agree(self.registry, model, config))
        num_pages = config.pages_for(model.config, engine_kv_dtype(config, config.precision))
        config.window = check_window(num_pages, config.page_size, config.window or model.config.max_position,
                                     opts.clamp_window)
        self.worker_id = new_worker_id(role)
        self.node = node  # the Celery node name (its direct queue carries canary probes to this process)
        hosts = []

        def allocator(n: int) -> HostLedger:
            hosts.append(HostLedger(RedisLedger.register(redis, self.worker_id, role, n, config.page_size,
                                                         prefix=opts.prefix, lease_ttl_s=opts.lease_ttl_s)))
            return hosts[0]

        self.engine = Engine(model, config, allocator_factory=allocator)
        self._host: HostLedger = hosts[0]
        self.ledger: RedisLedger = self._host.ledger
        self.transport = RedisTransport(redis, opts.prefix, opts.transport_ttl_s)
        self.outputs = OutputStream(redis, opts.prefix)
        self.cancels = Cancellations(redis, opts.prefix)
        self.metrics = WorkerMetrics(redis, opts.prefix, role=role, model_name=model_name(model.source),
                                     worker_id=self.worker_id, gauges_ttl_s=opts.registry_ttl_s)
        self.on_violation = on_violation or (lambda runtime, violation: None)
        self.on_reclaim = on_reclaim or (lambda runtime, events: None)
        self.on_lease_lost = on_lease_lost or (lambda runtime, request_id, pages: None)
        self.on_quarantine = on_quarantine or (lambda runtime, quarantined: None)
        self.on_fatal = on_fatal or exit_process
        self._commands: queue.Queue = queue.Queue()
        self._futures: dict[str, Future] = {}  # requests this worker runs, by id
        self._pending: TenantQueues[DecodeCommand] = TenantQueues()  # verified decodes waiting for pages
        self._choices: dict[str, ChoiceRun] = {}  # requests of n choices decoding here, by id
        self.outbox = Outbox(self.outputs, name=f"outbox-{role}")  # output events on their way to Redis
        self._unclean: list[int] = []  # scrubbed pages whose mark_clean Redis has not taken yet
        self._claimed: set[int] = set()  # dirty pages claimed (ledger.take_dirty) and not yet marked clean
        self._claimed_lock = threading.Lock()  # the set, between the loop and the beat
        self._claiming = threading.Lock()  # one claim at a time: each names the pages the others took
        self._pool_down: str | None = None  # why, while the pool waits to be registered again
        self._next_register = 0.0
        self._next_cancel_poll = 0.0
        self._tick = self.clock()  # the loop's progress stamp
        self._failures = 0
        self._dying = threading.Event()
        self._consuming = True  # whether this worker consumes its queue (quarantine stops it)
        self._bystander: Sequence | None = None  # fault foreign_page_once: whose page it handed out (once)
        self._stop = threading.Event()
        self.registry.register(self.info())
        self._threads = [threading.Thread(target=self._loop, name="engine-loop", daemon=True),
                         threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)]
        for t in self._threads:
            t.start()

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(
            worker_id=self.worker_id, role=self.role, host=socket.gethostname(), pid=os.getpid(),
            num_pages=e.num_pages, page_size=e.page_size, capacity_tokens=e.capacity_tokens, window=e.window,
            model_fingerprint=e.fingerprint, dtype=e.kv_dtype, device=e.device,
            attention_backend=e.attention_backend, scrub_policy=e.scrub_policy, faults=sorted(e.config.faults),
            max_position=e.model.config.max_position, node=self.node,
            page_shape=[int(n) for n in e.pool.data.shape[1:]],
            started_at=time.time(), heartbeat_at=time.time(), precision=e.precision,
        )

    @property
    def serving(self) -> bool:
        """The loop runs and the pool is registered: what the heartbeat advertises."""
        return not self._dying.is_set() and self._pool_down is None and self._threads[0].is_alive()

    @property
    def consuming(self) -> bool:
        """False while quarantined: the worker takes no new request (its direct queue hands them back)."""
        return self._consuming

    # ---- called from task threads ------------------------------------------------------------
    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams, timeout_s: float = 600,
                still_wanted=None, salt: str | None = None, choices: int = 1, score: bool = False) -> Handoff:
        """Prefills the prompt, sends its KV and returns the signed handoff: OK, or REJECTED when the prompt
        cannot be held here. RequestFailed when the request could not be prefilled. `still_wanted()` is
        asked just before the KV is sent; False (the request ended or was taken over meanwhile) sends
        nothing and returns an ABORTED handoff."""
        e, key = self.engine, self.handoff_key
        try:  # the admission re-check is the engine's (Engine.add_request, in the loop): RequestTooLarge
            exported: Exported = self._run(PrefillCommand(request_id, prompt_ids, params, salt, choices=choices,
                                                          score=score), timeout_s)
        except RequestTooLarge as exc:  # never a placeholder: it ends REJECTED, nothing taken or sent
            return prefill_refusal(e, request_id, prompt_ids, self.worker_id, Verdict.REJECTED, str(exc)).signed(key)
        if still_wanted is not None and not still_wanted():
            return prefill_refusal(e, request_id, prompt_ids, self.worker_id, Verdict.ABORTED,
                                   "the request ended while it was prefilled").signed(key)
        handoff = prefill_handoff(e, request_id, prompt_ids, self.worker_id, exported).signed(key)
        self.transport.send(handoff, exported.blob)
        return handoff

    def decode_side(self, request_id: str, prompt_ids: list[int], choices: int = 1) -> DecodeSide:
        """What this worker's engine expects of a handoff for `request_id` (of `choices` sequences)."""
        e = self.engine
        return DecodeSide(request_id, len(prompt_ids), e.fingerprint, e.page_size, e.kv_dtype,
                          page_shape=tuple(e.pool.data.shape[1:]), choices=choices)

    def decode(self, request_id: str, prompt_ids: list[int], params: SamplingParams, handoff: dict,
               timeout_s: float = 3600, choices: int = 1, returned: int | None = None,
               score: bool = False) -> "Sequence | list[Sequence]":
        """Accepts the handoff and pulls its KV (`handoff_accept`: HandoffRefused otherwise), then decodes to the
        end, publishing output events; the finished sequence, or RequestFailed. Pages are allocated only after.
        `choices` > 1: the one verified handoff is forked into that many sequences (inference.choices), of which
        `returned` (n; all by default) come back in answer order (`score`: the best cumulative logprobs first)."""
        started = time.perf_counter()
        h, blob = handoff_accept(handoff, self.handoff_key, self.decode_side(request_id, prompt_ids, choices),
                                 self.transport.take, check="no_handoff_check" not in self.engine.config.faults)
        transfer_ms = (time.perf_counter() - started) * 1000
        out = self._run(DecodeCommand(request_id, prompt_ids, params, h.first_token, blob, h.transferred_tokens,
                                      h.first_logprobs, h.cached_tokens, choice_tokens=h.choice_tokens,
                                      choice_logprobs=h.choice_logprobs, returned=returned or choices,
                                      score=score), timeout_s)
        for seq in out if isinstance(out, list) else [out]:
            seq.transfer_ms = round(transfer_ms, 2)
        return out

    def probe(self, name: str, timeout_s: float = 30) -> dict:
        """Runs canary probe `name` (inference.probes.PROBES) in the engine loop; its result."""
        if name not in PROBES:
            raise ValueError(f"unknown probe {name!r}; known: {sorted(PROBES)}")
        cmd = ProbeCommand(name)
        self._commands.put(cmd)
        return cmd.future.result(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(StopCommand())
        for t in self._threads:
            t.join(timeout=5)
        self.outbox.stop()
        if self.cores:
            self.cores.close()
        for rid, fut in list(self._futures.items()):
            if not fut.done():
                fut.set_exception(RequestFailed("worker_stopping", "the worker is shutting down"))
        try:
            self.registry.unregister(self.worker_id)
            self.ledger.unregister()
        except Exception:
            log.exception("unregistering %s", self.worker_id)

    def _run(self, cmd, timeout_s: float):
        self._commands.put(cmd)
        try:
            return cmd.future.result(timeout_s)
        except FutureTimeout:
            message = f"the worker did not finish the request within {timeout_s:.0f}s"
            self._commands.put(CancelCommand(Cancel(cmd.request_id, "timeout", message)))
            raise RequestFailed("timeout", message) from None

    # ---- the engine loop (the only thread touching the engine) ----------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._tick = self.clock()
                self._iterate()
        except BaseException as exc:  # its own failure handling failed, or failures persist
            log.critical("engine loop of %s cannot go on", self.worker_id, exc_info=True)
            self._die(f"the engine loop cannot go on: {type(exc).__name__}: {exc}")

    def _iterate(self) -> None:
        e = self.engine
        busy = e.has_work or self._pending or self._unclean or self._pool_down is not None
        if self.cores and not e.has_work:  # before it waits for a command: its cores are the others' meanwhile
            self.cores.idle()
        try:
            self._apply_all(self._drain(0 if e.has_work else 0.05 if busy else 0.5))
            if self._pool_down is not None:
                return self._register_again()
            self._poll_cancels()
            self._mark_clean()
            self._admit_pending()
            if e.has_work:
                if self.cores:
                    self.cores.apply()
                self._handle(e.step())
            elif self.cores:
                self.cores.idle()
            if self._host.pool_lost:
                raise PoolLost(self._host.pool_lost)
            self._failures = 0
        except PoolLost as exc:
            self._lose_pool(str(exc))
        except Exception as exc:  # a bug or a broken backend: fail the requests in flight, closed
            self._failures += 1
            log.exception("engine loop iteration failed (%d in a row)", self._failures)
            self._fail_all("engine_error", f"the engine failed: {type(exc).__name__}: {exc}")
            if self._failures >= self.options.loop_max_failures:
                raise

    def _drain(self, timeout_s: float) -> list:
        cmds = []
        try:
            cmds.append(self._commands.get(timeout=timeout_s) if timeout_s else self._commands.get_nowait())
            while True:
                cmds.append(self._commands.get_nowait())
        except queue.Empty:
            return cmds

    def _apply_all(self, cmds: list) -> None:
        """Every command is applied (or its future failed) even when one of them raises."""
        lost = None
        for cmd in cmds:
            try:
                self._apply(cmd)
            except PoolLost as exc:
                lost = exc
            except Exception as exc:
                log.exception("engine loop command %s failed", type(cmd).__name__)
                future = getattr(cmd, "future", None)
                if future is not None and not future.done():
                    future.set_exception(exc)
        if lost is not None:
            raise lost

    def _apply(self, cmd) -> None:
        if isinstance(cmd, (PrefillCommand, DecodeCommand)):
            rid = cmd.request_id
            if rid in self._futures or self.engine.has_request(rid):
                cmd.future.set_exception(RequestFailed(
                    "duplicate_delivery", f"request {rid} is already running on this worker; this copy was refused"))
            elif self._pool_down is not None:
                cmd.future.set_exception(RequestFailed("pool_lost", POOL_LOST_ERROR))
            elif isinstance(cmd, PrefillCommand):
                try:
                    self.engine.add_request(rid, cmd.prompt_ids, cmd.params, prefill_only=True, salt=cmd.salt,
                                            choices=cmd.choices, score=cmd.score)
                except Exception as exc:
                    cmd.future.set_exception(exc)
                else:
                    self._futures[rid] = cmd.future
            else:
                self._futures[rid] = cmd.future
                self._pending.add(cmd)
        elif isinstance(cmd, (ReclaimCommand, LeaseCheckCommand)):
            if self._pool_down is None and cmd.generation == self.ledger.generation:
                self._reclaim(cmd.pages) if isinstance(cmd, ReclaimCommand) else self._check_leases(cmd.owners)
        elif isinstance(cmd, ProbeCommand):
            cmd.future.set_result(PROBES[cmd.name](self.engine))
        elif isinstance(cmd, CancelCommand):
            if cmd.cancel.request_id in self._futures:
                self._fail(cmd.cancel.request_id, cmd.cancel.code, cmd.cancel.message)
        elif isinstance(cmd, PoolLostCommand):
            if self._pool_down is None and cmd.generation == self.ledger.generation:
                raise PoolLost(cmd.reason)

    def _reclaim(self, pages: tuple[int, ...]) -> None:
        for rid in dict.fromkeys(seq.owner_request for seq in self.engine.reclaim(pages)):  # fails the holders,
            self._lease_lost(rid, pages)                                                   # scrubs the pages
        self._unclean.extend(pages)

    def _check_leases(self, owners: tuple[str, ...]) -> None:
        for seq, pages in check_leases(self.engine, self._host, owners):
            if seq.owner_request in self._futures or not seq.choice_of:
                self._lease_lost(seq.owner_request, pages)

    def _admit_pending(self) -> None:
        """Verified decodes join the batch fairly, as the scheduler admits: the tenant holding the fewest pages
        here first, FIFO within a tenant; one that does not fit now keeps its turn."""
        held = self.engine.scheduler.pages_held_by_tenant() if self._pending else None
        while self._pending:
            cmd = self._pending.peek(lambda tenant: held[tenant])
            rid = cmd.request_id
            if cmd.choice_tokens:
                try:
                    if not self._admit_choices(cmd, held):
                        return  # does not fit now
                except PoolLost:
                    raise
                except Exception as exc:
                    self._pending.pop(cmd)
                    fut = self._futures.pop(rid, None)
                    if fut:
                        fut.set_exception(exc)
                continue
            try:
                seq = self.engine.add_prefilled(rid, cmd.prompt_ids, cmd.first_token, cmd.blob, cmd.params,
                                                num_transferred=cmd.num_transferred)
            except PoolLost:
                raise
            except Exception as exc:  # never fits here (RequestTooLarge) or a bad blob: this request only
                self._pending.pop(cmd)
                fut = self._futures.pop(rid, None)
                if fut:
                    fut.set_exception(exc)
                continue
            if seq is None:
                return  # does not fit now; retried after the next step frees pages
            seq.cached_tokens = cmd.cached_tokens
            self._pending.pop(cmd)
            held[seq.tenant] += len(seq.block_table)
            if "foreign_page_once" in self.engine.config.faults and not seq.is_done and self._bystander is None:
                self._misroute_first_page(seq)
            self.metrics.on_token(rid, seq.is_done)
            if seq.text or cmd.first_logprobs:
                self._publish([(rid, Delta.step(seq.text, cmd.first_token, cmd.first_logprobs, len(seq.output_ids)))])
            if seq.is_done:
                self._finish([seq], self._host.take_refused())

    def _admit_choices(self, cmd: DecodeCommand, held) -> bool:
        """Forks a verified handoff into its n choices (Engine.add_prefilled_choices); False when they do not fit
        now (the command keeps its turn)."""
        rid, k = cmd.request_id, len(cmd.choice_tokens)
        seqs = self.engine.add_prefilled_choices(
            rid, cmd.prompt_ids, list(cmd.choice_tokens), cmd.blob, choice_params(cmd.params, k, cmd.score),
            num_transferred=cmd.num_transferred, first_logprobs=cmd.choice_logprobs, score=cmd.score)
        if seqs is None:
            return False
        self._pending.pop(cmd)
        run = self._choices[rid] = ChoiceRun(seqs, min(cmd.returned, k), cmd.score and cmd.returned < k,
                                            cmd.cached_tokens)
        out = []
        for seq, lp in zip(seqs, cmd.choice_logprobs or [None] * k):
            seq.cached_tokens = cmd.cached_tokens
            held[seq.tenant] += len(seq.block_table)
            shown = None if seq.score_only else lp
            if seq.text or shown:
                out.append((rid, Delta.step(seq.text, seq.output_ids[0], shown, index=seq.index)))
        self.metrics.on_token(rid, False)
        self._publish(out)
        if done := [s for s in run.seqs if s.is_done]:
            self._finish(done, self._host.take_refused())
        return True

    def _misroute_first_page(self, seq: Sequence) -> None:
        """Fault `foreign_page_once` (tests only; announced at start and registered): once per process, the
        block table of `seq` is made to point at a page it does not own — another running request's first
        page, else a page granted for this in the real pool and ledger to a bystander owner (freed after the
        next step). Nothing else changes: whatever stops the read is the engine's own guard."""
        e = self.engine
        others = [s for s in e.seqs.values() if s is not seq and s.block_table and not s.is_done]
        if others:
            page, self._bystander = others[0].block_table[0], others[0]
        else:
            bystander = Sequence(f"fault-bystander-{uuid.uuid4().hex[:8]}", [0], SamplingParams(max_tokens=1))
            if not e.block_manager.allocate(bystander, 1):
                return
            page, self._bystander = bystander.block_table[0], bystander
        log.error("FAULT foreign_page_once: request %s's block table now points at page %d (owner %s)",
                  seq.request_id, page, self._bystander.request_id)
        seq.block_table[0] = page

    def _free_bystander(self) -> None:
        b = self._bystander
        if b is not None and b.request_id.startswith("fault-bystander-") and b.block_table:
            self.engine.block_manager.deallocate(b)

    def _handle(self, events) -> None:
        e = self.engine
        self.metrics.on_step(events)
        out, finished, exported = [], [], {}
        for ev in events:
            seq = ev.seq
            if seq.prefill_only and seq.status is SeqStatus.PREFILLED:
                exported[seq.request_id] = prefill_export(e, seq, ev.logprobs)
            elif ev.text_delta or ev.logprobs:
                out.append((seq.owner_request, Delta.step(ev.text_delta, ev.token, ev.logprobs, len(seq.output_ids),
                                                          index=seq.index)))
            if ev.finished:
                finished.append(seq)
        # each violation already failed its request closed in the engine (nothing read, pages scrubbed): the worker
        # is quarantined and the violation recorded before the request's error event and its end (_finish)
        for violation in e.take_violations():
            self.metrics.on_violation(violation.kind)
            try:
                self.registry.quarantine(self.worker_id, f"{violation.kind} by {violation.reader}")
                self.on_violation(self, violation)
            except Exception:
                log.exception("recording violation %s", violation)
        self._publish(out)
        refused = self._host.take_refused()
        self._finish(finished, refused, exported)
        for owner in refused - {seq.request_id for seq in finished}:  # a grow or a preemption's free refused:
            if (rid := request_of(owner)) in self._futures:                # lease lost
                self._lease_lost(rid, ())
        e.pop_finished()
        self._free_bystander()

    def _finish(self, seqs: list[Sequence], refused: set[str], exported: dict | None = None) -> None:
        """Final events and results for sequences that ended this step (`exported`: prefills' KV). Their read
        records go first: a request's Done may resolve its caller before the loop reaches its other choices."""
        records = [seq.read_record for seq in seqs if seq.read_record and seq.status is SeqStatus.FINISHED
                   and (seq.choice_of is not None or seq.request_id not in refused)]
        if records:
            try:
                self.outputs.record_reads(records)
            except redis_lib.RedisError:
                log.warning("read records of %s not stored: Redis unreachable", [r["request"] for r in records])
        for seq in seqs:
            if seq.choice_of is not None:
                self._finish_choice(seq, refused)
                continue
            rid = seq.request_id
            if seq.status is SeqStatus.FAILED:
                self._fail(rid, "kv_isolation_violation", CLIENT_ISOLATION_ERROR)
            elif rid in refused:  # its free was refused: the ledger had already taken its pages back
                self._lease_lost(rid, ())
            elif seq.prefill_only:
                fut = self._futures.pop(rid, None)
                if fut:
                    fut.set_result(exported[rid])
            else:
                self._publish([(rid, Done(seq.finish_reason, Usage(seq.num_prompt_tokens, len(seq.output_ids),
                                                                    seq.cached_tokens)))],
                              then=resolve(self._futures.pop(rid, None), seq))

    def _finish_choice(self, seq: Sequence, refused: set[str]) -> None:
        """One choice ended: a failure fails its whole request (every choice); the last one's end is the request's
        one Done, with usage for the prompt once and the returned choices' tokens."""
        rid = seq.choice_of
        if rid not in self._futures:
            return  # the request ended already (failed with its first failing choice)
        if seq.status is SeqStatus.FAILED:
            return self._fail(rid, "kv_isolation_violation", CLIENT_ISOLATION_ERROR)
        if seq.request_id in refused:
            return self._lease_lost(rid, ())
        run = self._choices.get(rid)
        if run is None or not all(s.status is SeqStatus.FINISHED for s in run.seqs):
            return
        del self._choices[rid]
        self._publish([(rid, run.done())], then=resolve(self._futures.pop(rid, None), run.answer()))

    def _lease_lost(self, rid: str, pages) -> None:
        self._host.forget(rid)
        self._fail(rid, "lease_lost", LEASE_LOST_ERROR)
        try:
            self.on_lease_lost(self, rid, list(pages))
        except Exception:
            log.exception("recording the lost lease of %s", rid)

    def _fail(self, rid: str, code: str, message: str) -> None:
        """Ends one request here: aborted in the engine (pages freed and scrubbed), error event, RequestFailed."""
        fut = self._futures.pop(rid, None)
        self._choices.pop(rid, None)
        self.engine.abort(rid, message)
        for cmd in [c for c in self._pending if c.request_id == rid]:
            self._pending.remove(cmd)
        self._publish([(rid, Error(code, message))], then=resolve(fut, failure=RequestFailed(code, message)))

    def _fail_all(self, code: str, message: str) -> None:
        for rid in list(self._futures):
            self._fail(rid, code, message)

    def _lose_pool(self, reason: str) -> None:
        log.error("pool %s lost (%s): failing its requests, scrubbing its tensor, registering a new generation",
                  self.worker_id, reason)
        self.engine.reset_pool(reason)
        self._fail_all("pool_lost", POOL_LOST_ERROR)
        self._pending, self._choices = TenantQueues(), {}
        self._unclean, self._pool_down, self._next_register = [], reason, 0.0
        with self._claimed_lock:
            self._claimed.clear()
        self._register_again()

    def _register_again(self) -> None:
        if self.clock() < self._next_register:
            return
        try:
            self._host.reset()
            self.registry.register(self.info())
        except Exception as exc:
            self._next_register = self.clock() + 0.5
            log.warning("pool %s not registered again yet: %r", self.worker_id, exc)
            return
        self._pool_down = None
        log.warning("pool %s registered again as generation %d; serving", self.worker_id, self.ledger.generation)

    def _poll_cancels(self) -> None:
        now = self.clock()
        if not self._futures or now < self._next_cancel_poll:
            return
        self._next_cancel_poll = now + self.options.cancel_poll_s
        try:
            cancels = self.cancels.pending(self._futures)
        except UNREACHABLE:
            return
        for cancel in cancels:
            self._fail(cancel.request_id, cancel.code, cancel.message)

    def _claim_dirty(self) -> list[int]:
        """Dirty pages for this worker to scrub: new claims, and claims of ours whose reply was lost (the ledger
        hands out again what we claimed and do not have in hand)."""
        with self._claiming:
            with self._claimed_lock:
                in_hand = sorted(self._claimed)
            dirty = self.ledger.take_dirty(self.worker_id, in_hand)
            with self._claimed_lock:
                self._claimed.update(dirty)
        return dirty

    def _mark_clean(self) -> None:
        if not self._unclean:
            return
        try:
            self.ledger.mark_clean(self._unclean, self.worker_id)
        except UNREACHABLE:
            return  # scrubbed and still dirty (claimed by us): retried next iteration
        except PoolLost:
            raise
        except LedgerError:
            log.exception("marking scrubbed pages %s clean", self._unclean)
        with self._claimed_lock:
            self._claimed.difference_update(self._unclean)
        self._unclean = []

    def _publish(self, events: list[tuple[str, OutputEvent]], then=None) -> None:
        """Hands events to the outbox (never waits for Redis); `then` runs once they were attempted."""
        self.outbox.put(events, then)

    def _die(self, reason: str) -> None:
        """The loop cannot go on: fail what it holds, stop being advertised, let the supervisor restart us."""
        if self._dying.is_set():
            return
        self._dying.set()
        self._stop.set()
        log.critical("worker %s: %s; failing its requests, unregistering and exiting", self.worker_id, reason)
        self.outbox.stop(timeout_s=1.0)  # what the loop streamed goes before the errors
        for rid, fut in list(self._futures.items()):
            try:
                self.outputs.publish(rid, Error("engine_error", reason))
            except Exception:
                pass
            if not fut.done():
                fut.set_exception(RequestFailed("engine_error", reason))
        for unregister in (lambda: self.registry.unregister(self.worker_id), self.ledger.unregister):
            try:
                unregister()
            except Exception:
                log.exception("unregistering %s", self.worker_id)
        self.on_fatal(self, reason)

    # ---- heartbeat ---------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        while not self._stop.wait(self.options.heartbeat_s):
            try:
                self.beat()
            except Exception:
                log.exception("heartbeat failed")
            try:
                self.metrics.flush(self.engine, waiting=len(self._pending))
            except Exception as exc:  # kept for the next beat; never in the way of leases and registration
                log.warning("metrics not sent: %r", exc)

    def beat(self, now_ms: int | None = None) -> None:
        """Watchdog, leases, dirty pages, registration, quarantine. `now_ms` overrides Redis' clock (tests)."""
        if self._dying.is_set():
            return
        loop = self._threads[0]
        stalled = self.clock() - self._tick
        if not loop.is_alive() or stalled > self.options.loop_stall_s:
            self._die("the engine loop is not running" if not loop.is_alive()
                      else f"the engine loop made no progress for {stalled:.0f}s")
            return
        if self._pool_down is not None:
            return  # not advertised until the loop registered the pool again
        generation = self.ledger.generation
        try:
            beat = self._host.beat(now_ms=now_ms)
            dirty = self._claim_dirty()
        except PoolLost as exc:
            self._commands.put(PoolLostCommand(generation, str(exc)))
            return
        if beat.missing:
            self._commands.put(LeaseCheckCommand(generation, beat.missing))
        if dirty:
            self._commands.put(ReclaimCommand(generation, tuple(dirty)))
        if beat.reclaimed:
            try:
                self.on_reclaim(self, list(beat.reclaimed))
            except Exception:
                log.exception("recording reclaimed leases %s", beat.reclaimed)
        self._host.retry_deferred()
        try:
            self.registry.heartbeat(self.worker_id)
        except WorkerNotRegistered:  # expired while we were stalled: come back, visibly
            log.warning("registration of %s expired; registering again", self.worker_id)
            self.registry.register(self.info())
        quarantined = self.registry.is_quarantined(self.worker_id)
        if quarantined == self._consuming:
            self._consuming = not quarantined
            self.on_quarantine(self, quarantined)

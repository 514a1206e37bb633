"""One worker process's engine host: the engine with its Redis-ledger pool, one continuous-batching
loop thread that owns the engine, and a heartbeat thread (registry, leases, reaping, quarantine).

Task threads (Celery's threads pool) call `prefill()` / `decode()`, which block until the loop
has finished their request; every request of the process shares the loop's batch.
"""
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from inference.engine import Engine, EngineConfig
from inference.handoff import Handoff, HandoffRefused, Verdict, verify_for_decode
from inference.ledger import RedisLedger, check_eviction_policy
from inference.loader import load_model, model_name
from inference.metrics import WorkerMetrics
from inference.registry import Registry, WorkerInfo, WorkerNotRegistered
from inference.scheduler import RequestTooLarge
from inference.sequence import SamplingParams, Sequence, SeqStatus
from inference.streams import OutputStream
from inference.transport import RedisTransport

log = logging.getLogger(__name__)

CLIENT_ISOLATION_ERROR = "the request was stopped by a KV-cache isolation check; no content was returned"


def delta_event(text: str, token: int | None = None, logprobs=None) -> dict:
    """An output event: new text and, when the request asked for them, the log-probabilities of the token this
    step produced, `logprobs: [[token id, logprob, [[id, logprob], ...]]]` (a token's text may come later)."""
    event = {"type": "delta", "text": text}
    if logprobs is not None:
        event["logprobs"] = [[token, logprobs[0], [list(t) for t in logprobs[1]]]]
    return event


class WindowTooLarge(Exception):
    """The pool holds fewer tokens than the window the worker would serve (invariant 4)."""


@dataclass
class RuntimeOptions:
    prefix: str = "kvs"
    lease_ttl_s: float = 30.0
    registry_ttl_s: float = 15.0
    clamp_window: bool = False
    transport_ttl_s: int = 300

    @classmethod
    def from_env(cls) -> "RuntimeOptions":
        env = os.environ
        return cls(prefix=env.get("KVSERVE_LEDGER_PREFIX", "kvs"),
                   lease_ttl_s=float(env.get("KVSERVE_LEASE_TTL_S", 30)),
                   registry_ttl_s=float(env.get("KVSERVE_REGISTRY_TTL_S", 15)),
                   clamp_window=env.get("KVSERVE_CLAMP_WINDOW", "") in ("1", "true", "yes"),
                   transport_ttl_s=int(env.get("KVSERVE_TRANSPORT_TTL_S", 300)))


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
        f"set KVSERVE_NUM_PAGES >= {-(-window // page_size)}, or lower KVSERVE_WINDOW to <= {capacity}, "
        f"or set KVSERVE_CLAMP_WINDOW=1 to serve {capacity} tokens"
    )


class WorkerRuntime:
    def __init__(self, role: str, redis, handoff_key: bytes, *, model=None, config: EngineConfig | None = None,
                 options: RuntimeOptions | None = None, on_violation=None, on_reclaim=None, on_quarantine=None):
        self.role = role
        self.redis = redis
        self.handoff_key = handoff_key
        self.options = opts = options or RuntimeOptions.from_env()
        check_eviction_policy(redis)
        model = model or load_model()
        config = config or EngineConfig.from_env()
        num_pages = config.pages_for(model.config, getattr(torch, config.dtype))
        config.window = check_window(num_pages, config.page_size, config.window or model.config.max_position,
                                     opts.clamp_window)
        self.worker_id = f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.engine = Engine(model, config, allocator_factory=lambda n: RedisLedger.register(
            redis, self.worker_id, role, n, config.page_size, prefix=opts.prefix, lease_ttl_s=opts.lease_ttl_s))
        self.ledger: RedisLedger = self.engine.block_manager.allocator
        self.registry = Registry(redis, prefix=opts.prefix, ttl_s=opts.registry_ttl_s)
        self.transport = RedisTransport(redis, opts.prefix, opts.transport_ttl_s)
        self.outputs = OutputStream(redis, opts.prefix)
        self.metrics = WorkerMetrics(redis, opts.prefix, role=role, model_name=model_name(model.source),
                                     worker_id=self.worker_id, gauges_ttl_s=opts.registry_ttl_s)
        self.on_violation = on_violation or (lambda runtime, violation: None)
        self.on_reclaim = on_reclaim or (lambda runtime, events: None)
        self.on_quarantine = on_quarantine or (lambda runtime, quarantined: None)
        self.quarantined = False
        self._commands: queue.Queue = queue.Queue()
        self._futures: dict[str, Future] = {}
        self._pending: deque = deque()  # verified decodes waiting for pages
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
            num_pages=e.pool.num_pages, page_size=e.pool.page_size, capacity_tokens=e.capacity_tokens,
            window=e.window, model_fingerprint=e.fingerprint, dtype=e.config.dtype, device=str(e.pool.data.device),
            attention_backend=e.attention_backend, scrub_policy=e.block_manager.scrub_policy,
            faults=sorted(e.config.faults), quarantined=self.quarantined, started_at=time.time(),
            heartbeat_at=time.time(),
        )

    # ---- called from task threads ------------------------------------------------------------
    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams, timeout_s: float = 600) -> Handoff:
        """Prefills the prompt, sends its KV and returns the signed handoff (OK, REJECTED or FAILED)."""
        e = self.engine
        base = dict(request_id=request_id, expected_tokens=len(prompt_ids), model_fingerprint=e.fingerprint,
                    page_size=e.pool.page_size, dtype=e.config.dtype, prefill_worker=self.worker_id)
        reason = e.admission_error(len(prompt_ids), params.max_tokens)
        if reason:  # never a placeholder: a prompt that cannot be held ends REJECTED, nothing taken or sent
            return Handoff(verdict=Verdict.REJECTED, reason=reason, transferred_tokens=0, num_pages=0,
                           page_checksums=(), page_epochs=(), **base).signed(self.handoff_key)
        try:
            first, blob, sums, epochs, first_logprobs = self._submit("prefill", request_id, prompt_ids,
                                                                     params).result(timeout_s)
        except RequestTooLarge as exc:
            return Handoff(verdict=Verdict.REJECTED, reason=str(exc), transferred_tokens=0, num_pages=0,
                           page_checksums=(), page_epochs=(), **base).signed(self.handoff_key)
        except Exception as exc:
            log.exception("prefill of %s failed", request_id)
            return Handoff(verdict=Verdict.FAILED, reason=f"prefill failed: {exc}", transferred_tokens=0,
                           num_pages=0, page_checksums=(), page_epochs=(), **base).signed(self.handoff_key)
        handoff = Handoff(verdict=Verdict.OK, reason="", transferred_tokens=len(prompt_ids), num_pages=blob.shape[0],
                          page_checksums=tuple(sums), page_epochs=tuple(epochs), first_token=first,
                          first_logprobs=first_logprobs, **base).signed(self.handoff_key)
        self.transport.send(handoff, blob)
        return handoff

    def decode(self, request_id: str, prompt_ids: list[int], params: SamplingParams, handoff: dict,
               timeout_s: float = 3600) -> Sequence:
        """Verifies the handoff (HandoffRefused otherwise), pulls the KV, then decodes to the end,
        publishing output events. Pages are allocated only after verification."""
        e = self.engine
        h = Handoff.from_dict(handoff)
        verify_for_decode(h, self.handoff_key, fingerprint=e.fingerprint, page_size=e.pool.page_size,
                          dtype=e.config.dtype, check="no_handoff_check" not in e.config.faults)
        if h.request_id != request_id or h.expected_tokens != len(prompt_ids):
            raise HandoffRefused("handoff_mismatch", f"handoff is for {h.request_id} with {h.expected_tokens} "
                                                     f"tokens, the task for {request_id} with {len(prompt_ids)}")
        started = time.perf_counter()
        blob = self.transport.receive(h)
        transfer_ms = (time.perf_counter() - started) * 1000
        seq = self._submit("decode", request_id, prompt_ids, params, h.first_token, blob,
                           h.transferred_tokens, h.first_logprobs).result(timeout_s)
        seq.transfer_ms = round(transfer_ms, 2)
        return seq

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(("noop",))
        for t in self._threads:
            t.join(timeout=5)
        try:
            self.registry.unregister(self.worker_id)
            self.ledger.unregister()
        except Exception:
            log.exception("unregistering %s", self.worker_id)

    def _submit(self, kind, request_id, *args) -> Future:
        fut: Future = Future()
        self._commands.put((kind, request_id, fut, *args))
        return fut

    # ---- the engine loop (the only thread touching the engine) ----------------------------
    def _loop(self) -> None:
        e = self.engine
        while not self._stop.is_set():
            idle = not e.has_work and not self._pending
            try:
                cmd = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
                while True:
                    self._apply(cmd)
                    cmd = self._commands.get_nowait()
            except queue.Empty:
                pass
            try:
                self._admit_pending()
                if e.has_work:
                    self._handle(e.step())
            except Exception as exc:  # a bug: fail every request in flight, closed, and keep serving
                log.exception("engine step failed")
                for rid in list(self._futures):
                    self._finish_failed(rid, f"engine error: {exc}")

    def _apply(self, cmd) -> None:
        kind = cmd[0]
        if kind == "noop":
            return
        if kind == "scrub":
            pages = cmd[1]
            self.engine.pool.scrub(pages)
            self.engine.block_manager.forget(pages)
            self.ledger.mark_clean(pages)
            return
        _, rid, fut, *args = cmd
        self._futures[rid] = fut
        if kind == "prefill":
            prompt_ids, params = args
            try:
                self.engine.add_request(rid, prompt_ids, params, prefill_only=True)
            except Exception as exc:
                self._futures.pop(rid)
                fut.set_exception(exc)
        else:
            self._pending.append((rid, *args))

    def _admit_pending(self) -> None:
        while self._pending:
            rid, prompt_ids, params, first, blob, transferred, first_logprobs = self._pending[0]
            try:
                seq = self.engine.add_prefilled(rid, prompt_ids, first, blob, params, num_transferred=transferred)
            except Exception as exc:
                self._pending.popleft()
                self._futures.pop(rid).set_exception(exc)
                continue
            if seq is None:
                return  # does not fit now; retried after the next step frees pages
            self._pending.popleft()
            self.metrics.on_token(rid, seq.is_done)
            events = [(rid, delta_event(seq.text, first, first_logprobs))] if seq.text or first_logprobs else []
            if seq.is_done:
                events.append((rid, self._final_event(seq)))
                self.engine.seqs.pop(rid, None)
                self._futures.pop(rid).set_result(seq)
            self.outputs.publish_many(events)

    def _handle(self, events) -> None:
        self.metrics.on_step(events)
        out = []
        for ev in events:
            seq, rid = ev.seq, ev.seq.request_id
            if seq.prefill_only:
                if seq.status is SeqStatus.PREFILLED:
                    blob, sums = self.engine.export_kv(seq)
                    epochs = seq.page_epochs[: blob.shape[0]]
                    self.engine.release(seq)
                    self._futures.pop(rid).set_result((seq.output_ids[0], blob, sums, epochs, ev.logprobs))
                elif seq.status is SeqStatus.FAILED:
                    self.engine.seqs.pop(rid, None)
                    self._futures.pop(rid).set_exception(RuntimeError(CLIENT_ISOLATION_ERROR))
                continue
            if ev.text_delta or ev.logprobs:
                out.append((rid, delta_event(ev.text_delta, ev.token, ev.logprobs)))
            if ev.finished:
                out.append((rid, self._final_event(seq)))
                if seq.read_record:
                    self.outputs.record_read(seq.read_record)
                self.engine.seqs.pop(rid, None)
                fut = self._futures.pop(rid, None)
                if fut:
                    fut.set_result(seq)
        self.outputs.publish_many(out)
        while self.engine.violations:
            violation = self.engine.violations.pop(0)
            self.quarantined = True
            self.metrics.on_violation(violation.kind)
            try:
                self.registry.quarantine(self.worker_id, f"{violation.kind} by {violation.reader}")
                self.on_violation(self, violation)
            except Exception:
                log.exception("recording violation %s", violation)

    def _final_event(self, seq: Sequence) -> dict:
        if seq.status is SeqStatus.FAILED:
            return {"type": "error", "code": "kv_isolation_violation", "message": CLIENT_ISOLATION_ERROR}
        return {"type": "done", "finish_reason": seq.finish_reason,
                "usage": {"prompt_tokens": seq.num_prompt_tokens, "completion_tokens": len(seq.output_ids)}}

    def _finish_failed(self, rid: str, message: str) -> None:
        fut = self._futures.pop(rid, None)
        self.engine.abort(rid, message)
        self.engine.seqs.pop(rid, None)
        self.outputs.publish(rid, {"type": "error", "code": "engine_error", "message": message})
        if fut and not fut.done():
            fut.set_exception(RuntimeError(message))

    # ---- heartbeat ---------------------------------------------------------------------------
    def _heartbeat(self) -> None:
        interval = max(0.2, min(self.options.registry_ttl_s, self.options.lease_ttl_s) / 3)
        while not self._stop.wait(interval):
            try:
                self.beat()
            except Exception:
                log.exception("heartbeat failed")
            try:
                self.metrics.flush(self.engine, waiting=len(self._pending))
            except Exception as exc:  # kept for the next beat; never in the way of leases and registration
                log.warning("metrics not sent: %r", exc)

    def beat(self) -> None:
        owners = [rid for rid, s in list(self.engine.seqs.items()) if s.block_table]
        if owners:
            self.ledger.renew_leases(owners)
        reclaimed = self.ledger.reap_expired()
        if reclaimed:
            self.on_reclaim(self, reclaimed)
        dirty = self.ledger.take_dirty()
        if dirty:
            self._commands.put(("scrub", dirty))
        quarantined = self.registry.is_quarantined(self.worker_id)
        if quarantined != self.quarantined:
            self.quarantined = quarantined
            self.on_quarantine(self, quarantined)
        try:
            self.registry.heartbeat(self.worker_id)
        except WorkerNotRegistered:  # expired while we were stalled: come back, visibly
            log.warning("registration of %s expired; registering again", self.worker_id)
            self.registry.register(self.info())

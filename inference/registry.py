"""The worker registry: which prefill/decode workers are alive, what they can hold, which are quarantined,
and which have stopped answering.

Owns the Redis keys under `{prefix}:workers:` only (the ledger module owns the page keys). No Django.
A registration expires with its TTL, on Redis' clock; that alone never makes a worker dead (a paused
worker's registration lapses too, and so does everyone's when Redis' clock steps). `silence` counts
the observer's rounds in which a worker did not beat at all: clock-free evidence that it stopped.
Registrations, heartbeats and reads repeat across a dropped connection (inference.retry).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inference import admission
from inference.retry import repeat

PREFILL = "prefill"
DECODE = "decode"
SERVING_ROLES = (PREFILL, DECODE)

# KEYS[1] a claim, ARGV[1] its holder's token: deleted only while that holder still has it
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# Deletes index entries whose info key has expired, atomically per id, so a worker that
# re-registers between our read and the cleanup is never dropped from the index.
_PRUNE_LUA = """
local removed = 0
for i, id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then
    removed = removed + redis.call('SREM', KEYS[1], id)
  end
end
return removed
"""

# KEYS: beats, observed. ARGV: worker ids. Per id: rounds since its beat count last moved (0 when it moved).
_SILENCE_LUA = """
local out = {}
for i, id in ipairs(ARGV) do
  local beats = redis.call('HGET', KEYS[1], id) or '0'
  local seen = redis.call('HGET', KEYS[2], id)
  local rounds = 0
  if seen then
    local at = string.find(seen, ':', 1, true)
    if string.sub(seen, 1, at - 1) == beats then rounds = tonumber(string.sub(seen, at + 1)) + 1 end
  end
  redis.call('HSET', KEYS[2], id, beats .. ':' .. rounds)
  out[i] = rounds
end
return out
"""


class WorkerNotRegistered(KeyError):
    """A heartbeat came for a worker whose registration is gone (expired or unregistered)."""


ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # a KV pool's dtype -> bytes per value


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str
    host: str
    pid: int
    num_pages: int
    page_size: int
    capacity_tokens: int
    window: int
    model_fingerprint: str
    dtype: str
    device: str
    attention_backend: str
    scrub_policy: str
    faults: list[str] = field(default_factory=list)
    max_position: int = 0  # the model's context length (0: not reported by an older writer)
    node: str = ""  # the Celery node name: its direct queue reaches this process (canary probes)
    page_shape: list[int] = field(default_factory=list)  # [layers, 2, page_size, kv_heads, head_dim] per page
    quarantined: bool = False
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    precision: str = "fp32"  # matmul precision (inference.precision); an older writer's workers ran fp32

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["faults"] = list(self.faults)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WorkerInfo":
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}  # newer writers may add fields
        kwargs["faults"] = list(kwargs.get("faults") or [])
        return cls(**kwargs)

    @property
    def pool_bytes(self) -> int | None:
        """Bytes of KV the pool holds: pages x page_shape x the element's size (`dtype` is the pool's: a bf16 pool
        holds a token in half an fp32 pool's bytes); None when an older writer reported no page shape."""
        size = ELEMENT_BYTES.get(self.dtype)
        return self.num_pages * math.prod(self.page_shape) * size if self.page_shape and size else None

    @property
    def serving_limit(self) -> int:
        """The most tokens (prompt + output) one request may use on this worker (inference.admission)."""
        return admission.serving_limit(self.window, self.capacity_tokens, self.max_position or None)


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class Registry:
    """Worker registrations with a TTL refreshed by heartbeats; quarantine in its own key, no TTL."""

    def __init__(self, redis, prefix: str = "kvs", ttl_s: float = 15, clock: Callable[[], float] = time.time):
        """`clock`: the wall clock stamped into registrations (started_at, heartbeat_at) and quarantines; their
        expiry is Redis' own (PX), whatever it says."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.redis = redis
        self.clock = clock
        self.prefix = prefix
        self.ttl_ms = int(ttl_s * 1000)
        self._prune = redis.register_script(_PRUNE_LUA)
        self._silence = redis.register_script(_SILENCE_LUA)
        self._release = redis.register_script(_RELEASE_LUA)

    def key(self, kind: str, worker_id: str | None = None) -> str:
        """The one place registry key names are built: {prefix}:workers:{kind}[:{worker_id}]."""
        base = f"{self.prefix}:workers:{kind}"
        return base if worker_id is None else f"{base}:{worker_id}"

    # --- the deployment's precision (KVSERVE_PRECISION=auto) -----------------------------

    def precision_agreed(self, scope: str) -> str | None:
        """The mode the first worker of `scope` (inference.precision.precision_scope) timed and proposed."""
        return repeat(lambda: _text(self.redis.get(self.key("precision", scope))), "reading the agreed precision")

    def precision_timing_claim(self, scope: str, token: str, ttl_s: float) -> bool:
        """Whether the caller (`token`) may time `auto` for `scope` now: one worker at a time, so the workers of a
        host that start together do not time their candidates on each other's cores. The claim lapses after
        `ttl_s` (a worker that died timing), then the next worker takes it."""
        key = self.key("precision-timing", scope)

        def claim() -> bool:  # ours already when a repeat follows a SET whose reply was lost
            return bool(self.redis.set(key, token, nx=True, px=max(1, int(ttl_s * 1000)))) or \
                _text(self.redis.get(key)) == token
        return repeat(claim, "claiming the precision timing")

    def precision_timing_release(self, scope: str, token: str) -> None:
        """Ends `token`'s claim (never another's: one that lapsed and was taken meanwhile stays)."""
        key = self.key("precision-timing", scope)
        repeat(lambda: self._release(keys=[key], args=[token]), "releasing the precision timing")

    def precision_propose(self, scope: str, mode: str) -> str:
        """`mode` for `scope` unless another worker proposed first: the agreed mode either way (no TTL: delete
        {prefix}:workers:precision:<scope> to have the next worker time again)."""
        key = self.key("precision", scope)
        repeat(lambda: self.redis.set(key, mode, nx=True), "proposing a precision")
        return repeat(lambda: _text(self.redis.get(key)), "reading the agreed precision")

    # --- a worker's own lifecycle -------------------------------------------------------

    def register(self, info: WorkerInfo) -> WorkerInfo:
        now = self.clock()
        info = dataclasses.replace(
            info, started_at=info.started_at or now, heartbeat_at=now, quarantined=False
        )
        repeat(lambda: self._write(info), f"registering {info.worker_id}")
        return self._with_quarantine(info)

    def _write(self, info: WorkerInfo) -> None:
        """The registration, its index entry and one more beat. Safe to repeat: a repeated beat counts one more
        beat, which only says the worker is alive (silence compares counts between rounds)."""
        pipe = self.redis.pipeline()
        pipe.set(self.key("info", info.worker_id), json.dumps(info.to_dict()), px=self.ttl_ms)
        pipe.sadd(self.key("index"), info.worker_id)
        pipe.hincrby(self.key("beats"), info.worker_id, 1)
        pipe.execute()

    def heartbeat(self, worker_id: str, /, **changes: Any) -> WorkerInfo:
        fields = {f.name for f in dataclasses.fields(WorkerInfo)}
        forbidden = (set(changes) - fields) | ({"worker_id", "quarantined"} & set(changes))
        if forbidden:
            raise ValueError(f"heartbeat cannot change {sorted(forbidden)}")
        raw = repeat(lambda: self.redis.get(self.key("info", worker_id)), f"reading {worker_id}'s registration")
        if raw is None:
            raise WorkerNotRegistered(worker_id)
        info = dataclasses.replace(
            WorkerInfo.from_dict(json.loads(raw)), **changes, heartbeat_at=self.clock()
        )
        repeat(lambda: self._write(info), f"heartbeat of {worker_id}")
        return self._with_quarantine(info)

    def unregister(self, worker_id: str) -> None:
        """Removes the registration; a quarantine stays until an admin releases it."""
        pipe = self.redis.pipeline()
        pipe.delete(self.key("info", worker_id))
        pipe.srem(self.key("index"), worker_id)
        pipe.execute()

    # --- silence (the periodic reaper's evidence that a worker stopped) ------------------

    def silence(self, worker_ids) -> dict[str, int]:
        """One observation round: per worker, how many consecutive rounds (this one included) found its
        beat count unchanged since the previous round; 0 when it beat in between (or is seen first).
        Observe at intervals longer than a heartbeat: a live worker then always reads 0."""
        ids = sorted(set(worker_ids))
        if not ids:
            return {}
        rounds = self._silence(keys=[self.key("beats"), self.key("observed")], args=ids)
        return dict(zip(ids, (int(r) for r in rounds)))

    def forget(self, worker_id: str) -> None:
        """Drops a gone worker's beat count and observations (its quarantine, if any, stays)."""
        pipe = self.redis.pipeline()
        pipe.hdel(self.key("beats"), worker_id)
        pipe.hdel(self.key("observed"), worker_id)
        pipe.execute()

    # --- reads ----------------------------------------------------------------------------

    def live_workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Reads, and prunes expired entries from the index (a repeat prunes nothing more)."""
        return repeat(lambda: self._live_workers(role), "reading the worker registry")

    def _live_workers(self, role: str | None) -> list[WorkerInfo]:
        ids = sorted(_text(i) for i in self.redis.smembers(self.key("index")))
        if not ids:
            return []
        raws = self.redis.mget([self.key("info", i) for i in ids])
        live = {i: WorkerInfo.from_dict(json.loads(r)) for i, r in zip(ids, raws) if r is not None}
        expired = [i for i in ids if i not in live]
        if expired:
            self._prune(keys=[self.key("index")] + [self.key("info", i) for i in expired], args=expired)
        workers = [w for w in live.values() if role is None or w.role == role]
        quarantined = self._quarantined_among([w.worker_id for w in workers])
        return [dataclasses.replace(w, quarantined=w.worker_id in quarantined) for w in workers]

    def effective_limit(self) -> int | None:
        """min(window, capacity) over live prefill+decode workers; None unless both pools can serve.

        Quarantined workers still count towards the minimum (conservative), but a pool whose
        workers are all quarantined cannot serve, so the limit is then None.
        """
        workers = [w for w in self.live_workers() if w.role in SERVING_ROLES]
        serving = {w.role for w in workers if not w.quarantined}
        if not set(SERVING_ROLES) <= serving:
            return None
        return admission.deployment_limit(w.serving_limit for w in workers)

    def served_window(self) -> int | None:
        """The window the deployment serves: the smallest window a live prefill or decode worker
        reports (workers clamp or refuse at start, so this is never more than their pools)."""
        windows = [w.window for w in self.live_workers() if w.role in SERVING_ROLES]
        return min(windows) if windows else None

    # --- quarantine -----------------------------------------------------------------------

    def quarantine(self, worker_id: str, reason: str) -> None:
        self.redis.hset(
            self.key("quarantine", worker_id), mapping={"reason": reason, "at": repr(self.clock())}
        )

    def release(self, worker_id: str) -> bool:
        """Lifts a quarantine; True when there was one."""
        return bool(self.redis.delete(self.key("quarantine", worker_id)))

    def is_quarantined(self, worker_id: str) -> bool:
        return bool(repeat(lambda: self.redis.exists(self.key("quarantine", worker_id)), f"reading {worker_id}'s quarantine"))

    def quarantine_reason(self, worker_id: str) -> str | None:
        return _text(self.redis.hget(self.key("quarantine", worker_id), "reason"))

    def quarantined_ids(self) -> list[str]:
        """Every quarantined worker, live or not (a quarantine outlives its worker's registration), sorted."""
        cut = len(self.key("quarantine", ""))
        return sorted(_text(key)[cut:] for key in self.redis.scan_iter(match=self.key("quarantine", "*"), count=500))

    def _with_quarantine(self, info: WorkerInfo) -> WorkerInfo:
        return dataclasses.replace(info, quarantined=self.is_quarantined(info.worker_id))

    def _quarantined_among(self, worker_ids: list[str]) -> set[str]:
        if not worker_ids:
            return set()
        pipe = self.redis.pipeline()
        for worker_id in worker_ids:
            pipe.exists(self.key("quarantine", worker_id))
        return {w for w, hit in zip(worker_ids, pipe.execute()) if hit}

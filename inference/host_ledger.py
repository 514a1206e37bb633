"""The engine's allocator inside a worker: its own pool's RedisLedger, behind calls that never raise out of
an engine step for an outcome the worker handles itself. A grant Redis cannot answer "does not fit now";
a free the ledger refuses (the owner's pages were reaped: its lease is lost) or cannot take (Redis
unreachable) is recorded for the worker loop, which fails or retries it. The pages themselves are
forgotten and scrubbed by the engine either way, so nothing here can leave data readable.

It also keeps the set of owners this process holds leases for, changed under one lock with every grant
and free, and `beat` renews exactly that set under the same lock: the worker's own reaper can never
take a lease it granted and still uses, however long the process was paused between the two.
"""
import logging
import threading
from typing import Sequence

import redis

from inference.allocator import Grant, LedgerError, NotHolding, PoolLost, cache_entry
from inference.ledger import RedisLedger

log = logging.getLogger(__name__)
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)


class HostLedger:
    """PageAllocator for the engine; everything not listed here goes straight to the RedisLedger."""

    def __init__(self, ledger: RedisLedger):
        self.ledger = ledger
        self._lock = threading.Lock()
        self._held: set[str] = set()  # owners holding pages this process was granted
        self._refused: set[str] = set()  # owners whose pages the ledger no longer listed as theirs
        self._deferred: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []  # frees Redis could not take
        self.pool_lost: str | None = None  # why, when a free found the pool gone

    def __getattr__(self, name):
        return getattr(self.ledger, name)

    def allocate(self, owner: str, n: int, keep_free: int = 0) -> Grant | None:
        grants = self._grant(self.ledger.allocate, [(owner, n)], keep_free=keep_free)
        return None if grants is None else grants[0]

    def extend(self, owner: str, n: int) -> Grant | None:
        grants = self._grant(self.ledger.extend, [(owner, n)])
        return None if grants is None else grants[0]

    def extend_many(self, requests: Sequence[tuple[str, int]]) -> list[Grant] | None:
        """One ledger call growing every owner in `requests`; None when it does not fit or Redis is unreachable.
        An owner the ledger no longer lists (its lease was reaped) gets an empty grant and is recorded as
        refused, for the worker to fail lease_lost; the others are granted with a second call."""
        requests = list(requests)
        try:
            return self._grant(self.ledger.extend_many, requests, many=True)
        except NotHolding as exc:
            lost = set(exc.owners)
            log.warning("lease lost: the ledger no longer lists %s, which asked to grow", sorted(lost))
            with self._lock:
                self._refused |= lost
                self._held -= lost
        rest = self._grant(self.ledger.extend_many, [(o, n) for o, n in requests if o not in lost], many=True)
        if rest is None:
            return None
        granted = iter(rest)
        return [Grant((), ()) if o in lost else next(granted) for o, _ in requests]

    def _grant(self, grant, requests, many: bool = False, **kw):
        with self._lock:
            try:
                got = grant(requests) if many else grant(*requests[0], **kw)
            except UNREACHABLE as exc:  # a grant whose reply was lost is reaped when its lease runs out
                log.warning("ledger unreachable, %s wait for pages: %r", [o for o, _ in requests], exc)
                return None
            if got is None:
                return None
            grants = got if many else [got]
            for (owner, _), g in zip(requests, grants):
                if g.pages:
                    self._held.add(owner)
            return grants

    def num_free(self) -> int | None:
        """Free pages in the ledger; None when Redis cannot be reached (unknown is not a shortage)."""
        try:
            return self.ledger.num_free()
        except UNREACHABLE as exc:
            log.warning("ledger unreachable, free pages unknown: %r", exc)
            return None

    def free(self, owner: str, pages: Sequence[int], epochs: Sequence[int]) -> None:
        pages, epochs = tuple(pages), tuple(epochs)
        try:
            left = self.ledger.free(owner, pages, epochs)
        except PoolLost as exc:
            self.pool_lost = str(exc)
        except LedgerError as exc:
            log.warning("lease lost: the ledger refused to free %s's pages %s: %s", owner, list(pages), exc)
            with self._lock:
                self._refused.add(owner)
                self._held.discard(owner)
        except UNREACHABLE as exc:  # still held (and renewed) until the free goes through
            log.warning("ledger unreachable, freeing %s's pages later: %r", owner, exc)
            with self._lock:
                self._deferred.append((owner, pages, epochs))
        else:
            if not left:
                self.forget(owner)

    # ---- shared pages: cache entries and readers hold leases this process renews ----------------------
    def cache(self, owner: str, salt: str, pages, epochs) -> str:
        with self._lock:
            entry = self.ledger.cache(owner, salt, pages, epochs)
            self._held.add(entry)
            return entry

    def hit(self, reader: str, salt: str, pages, epochs) -> bool:
        """A read Redis cannot answer is a miss (the request computes its whole prompt)."""
        with self._lock:
            try:
                ok = self.ledger.hit(reader, salt, pages, epochs)
            except UNREACHABLE as exc:
                log.warning("ledger unreachable, %s computes its prefix: %r", reader, exc)
                return False
            if ok and pages:
                self._held.add(reader)
            return ok

    def unread(self, reader: str) -> int:
        try:
            return self.ledger.unread(reader)
        except PoolLost as exc:
            self.pool_lost = str(exc)
        except UNREACHABLE as exc:  # its lease (renewed while it runs) is reaped after it ends: the reads go too
            log.warning("could not end %s's reads (its lease will be reaped): %r", reader, exc)
        return 0

    def evict(self, salt: str, pages, epochs) -> int:
        with self._lock:
            left = self.ledger.evict(salt, pages, epochs)
            if not left:
                self._held.discard(cache_entry(salt))
            return left

    def release(self, owner: str) -> list[int]:
        """Frees what the ledger lists for `owner`; [] when it cannot (its lease runs out and is reaped)."""
        try:
            return self.ledger.release(owner)
        except PoolLost as exc:
            self.pool_lost = str(exc)
        except (LedgerError, *UNREACHABLE) as exc:
            log.warning("could not release %s's pages (its lease will be reaped): %r", owner, exc)
        finally:
            self.forget(owner)
        return []

    def forget(self, owner: str) -> None:
        """`owner` no longer holds anything this process renews (its pages were reclaimed or released)."""
        with self._lock:
            self._held.discard(owner)

    def beat(self, now_ms: int | None = None):
        """The pool's heartbeat (RedisLedger.beat) renewing every owner this process holds, atomically with
        respect to its grants and frees."""
        with self._lock:
            return self.ledger.beat(sorted(self._held), now_ms=now_ms)

    def take_refused(self) -> set[str]:
        """Owners whose free was refused since the last call: their leases were lost."""
        with self._lock:
            taken, self._refused = self._refused, set()
        return taken

    def retry_deferred(self) -> None:
        """Frees that Redis could not take earlier (the pages are already scrubbed and forgotten here)."""
        with self._lock:
            pending, self._deferred = self._deferred, []
        for i, (owner, pages, epochs) in enumerate(pending):
            try:
                left = self.ledger.free(owner, pages, epochs)
            except UNREACHABLE:
                with self._lock:
                    self._deferred[:0] = pending[i:]
                return
            except LedgerError as exc:  # already freed by a call whose reply was lost, or reaped
                log.info("deferred free of %s's pages dropped: %s", owner, exc)
                left = 0
            if not left:
                self.forget(owner)

    def reset(self) -> None:
        """A new pool generation: what was recorded about the old one no longer applies."""
        with self._lock:
            self._held, self._refused, self._deferred = set(), set(), []
        self.ledger.reset()
        self.pool_lost = None

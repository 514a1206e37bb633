"""The engine's allocator inside a worker: its own pool's RedisLedger, behind calls that never raise out of
an engine step for an outcome the worker handles itself. A grant Redis cannot answer "does not fit now";
a free the ledger refuses (the owner's pages were reaped: its lease is lost) is recorded for the worker
loop, which fails the request. The pages themselves are forgotten and scrubbed by the engine either way,
so nothing here can leave data readable.

A call that gives pages back (free, evict, and a cache whose reply was lost, which is then freed as a
request's pages would be) and that Redis cannot take is kept as a settlement, retried by the heartbeat
(`retry_deferred`) until Redis answers (its owner renewed until then); a repeat the ledger refuses (the
call had gone through, its reply was lost) is dropped. Once its free went through, an owner is no longer
renewed (unless granted again since): whatever else the ledger lists for it (the pages of a grant whose
reply was lost) goes with its lease, reaped, scrubbed and marked clean.

It also keeps the set of owners this process holds leases for, changed under one lock with every grant
and free, and `beat` renews exactly that set under the same lock: the worker's own reaper can never
take a lease it granted and still uses, however long the process was paused between the two.
"""
import logging
import threading
from typing import Sequence

import redis

from inference.allocator import Grant, IntegrityError, LedgerError, NotHolding, PoolLost, cache_entry
from inference.ledger import RedisLedger

log = logging.getLogger(__name__)
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)


class _NotYet(Exception):
    """A settlement the ledger refuses for now (a cached page still read by a reader whose unread Redis did not
    take: it goes when that reader's lease is reaped)."""


class HostLedger:
    """PageAllocator for the engine; everything not listed here goes straight to the RedisLedger."""

    def __init__(self, ledger: RedisLedger):
        self.ledger = ledger
        self._lock = threading.Lock()
        self._held: set[str] = set()  # owners holding pages this process was granted
        self._granted: dict[str, int] = {}  # held owner -> stamp of its latest grant or read
        self._stamp = 0
        self._refused: set[str] = set()  # owners whose pages the ledger no longer listed as theirs
        self._deferred: list[list[tuple]] = []  # settlements (steps, in order) Redis could not take yet
        self._uncached: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]] = {}  # owner -> a cache whose
        # reply was lost: (salt, pages, epochs), settled when the owner's pages are freed
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
                    self._hold(owner)
            return grants

    def _hold(self, owner: str) -> None:  # under the lock
        self._stamp += 1
        self._held.add(owner)
        self._granted[owner] = self._stamp

    def num_free(self) -> int | None:
        """Free pages in the ledger; None when Redis cannot be reached (unknown is not a shortage)."""
        try:
            return self.ledger.num_free()
        except UNREACHABLE as exc:
            log.warning("ledger unreachable, free pages unknown: %r", exc)
            return None

    def free(self, owner: str, pages: Sequence[int], epochs: Sequence[int]) -> None:
        """The engine is done with `owner`'s own pages (a finish, a preemption, an abort). When a cache of them
        lost its reply, the cached ones leave the cache if the cache went through, and are freed if not."""
        pages, epochs = tuple(pages), tuple(epochs)
        steps = []
        if (lost := self._uncached.pop(owner, None)) is not None:
            salt, cached, cached_epochs = lost
            steps += [("uncache", salt, cached, cached_epochs), ("free_held", owner, cached, cached_epochs)]
            rest = [(p, e) for p, e in zip(pages, epochs) if p not in cached]
            pages, epochs = tuple(p for p, _ in rest), tuple(e for _, e in rest)
        self._settle(steps + [("free", owner, pages, epochs, self._granted.get(owner))])

    def _settle(self, steps: list[tuple], retry: bool = False) -> bool | None:
        """Runs ledger steps in order; the first Redis cannot take (False) or the ledger refuses for now (None),
        and every later one, wait for retry_deferred. True when all went through."""
        for i, step in enumerate(steps):
            try:
                getattr(self, "_" + step[0])(*step[1:], retry=retry)
            except PoolLost as exc:
                self.pool_lost = str(exc)
                return True
            except (*UNREACHABLE, _NotYet) as exc:
                log.warning("%s of %s waits for the ledger: %r", step[0], step[1], exc)
                with self._lock:
                    self._deferred.append(steps[i:])
                return None if isinstance(exc, _NotYet) else False
        return True

    def _free(self, owner, pages, epochs, stamp, retry=False) -> None:
        """Frees the owner's pages and lets it go, unless it was granted again since (a preempted sequence
        resumed): what else the ledger lists for it (a grant whose reply was lost) goes with its lease."""
        try:
            self.ledger.free(owner, pages, epochs)
        except IntegrityError:
            raise
        except PoolLost:
            raise
        except LedgerError as exc:
            if retry:  # it had gone through (its reply was lost), or the pages were reaped meanwhile
                log.info("deferred free of %s's pages dropped: %s", owner, exc)
            else:
                log.warning("lease lost: the ledger refused to free %s's pages %s: %s", owner, list(pages), exc)
                with self._lock:
                    self._refused.add(owner)
        with self._lock:
            if self._granted.get(owner) == stamp:
                self._held.discard(owner)
                self._granted.pop(owner, None)

    def _free_held(self, owner, pages, epochs, retry=False) -> None:
        """Frees what of `pages` the owner still holds (those a cache took are no longer its own)."""
        try:
            self.ledger.free(owner, pages, epochs)
        except (PoolLost, IntegrityError):
            raise
        except LedgerError:
            pass

    def _uncache(self, salt, pages, epochs, retry=False) -> None:
        """Cached pages the engine does not know (a cache whose reply was lost) leave the cache."""
        if pages and self.ledger.holds(cache_entry(salt), pages, epochs):
            self._evict(salt, pages, epochs, retry=True)

    # ---- shared pages: cache entries and readers hold leases this process renews ----------------------
    def cache(self, owner: str, salt: str, pages, epochs) -> str | None:
        """The cache entry now holding `owner`'s pages; None when the ledger did not take them (the engine frees
        them as the request's then): Redis unreachable (recorded, for `free` to settle), lease lost, pool lost."""
        with self._lock:
            try:
                entry = self.ledger.cache(owner, salt, pages, epochs)
            except PoolLost as exc:
                self.pool_lost = str(exc)
                return None
            except IntegrityError:
                raise
            except LedgerError as exc:  # the free that follows is refused the same way: the request fails lease_lost
                log.warning("the ledger refused to cache %s's pages %s: %s", owner, list(pages), exc)
                return None
            except UNREACHABLE as exc:
                log.warning("ledger unreachable, %s's pages are freed instead of cached: %r", owner, exc)
                self._uncached[owner] = (salt, tuple(pages), tuple(epochs))
                return None
            self._hold(entry)
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
                self._hold(reader)
            return ok

    def unread(self, reader: str) -> None:
        """Ends `reader`'s reads. One Redis cannot take now waits for retry_deferred (the next beat once Redis is
        back), or for the reader's lease to be reaped, whichever comes first: until then the pages stay cached and
        cannot be evicted, never freed under a reader."""
        self._settle([("unread", reader)])

    def _unread(self, reader, retry=False) -> None:
        self.ledger.unread(reader)  # a repeat, or one after a reap, finds no reads and ends none

    def evict(self, salt: str, pages, epochs) -> None:
        """Cached pages leave the cache; the engine forgets and scrubs them whatever Redis answers."""
        self._settle([("evict", salt, tuple(pages), tuple(epochs))])

    def _evict(self, salt, pages, epochs, retry=False) -> None:
        entry = cache_entry(salt)
        with self._lock:
            try:
                left = self.ledger.evict(salt, pages, epochs)
            except (PoolLost, IntegrityError):
                raise
            except LedgerError as exc:  # still read by a reader whose unread Redis did not take; or gone already
                if self.ledger.holds(entry, pages, epochs):
                    log.warning("eviction of %s's pages %s waits: %s", entry, list(pages), exc)
                    raise _NotYet(str(exc)) from None
                log.info("eviction of %s's pages %s dropped: %s", entry, list(pages), exc)
                return
            if not left:
                self._held.discard(entry)
                self._granted.pop(entry, None)

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
            self._granted.pop(owner, None)

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
        """Settlements Redis could not take earlier (their pages are already scrubbed and forgotten here)."""
        with self._lock:
            pending, self._deferred = self._deferred, []
        for i, steps in enumerate(pending):
            if self._settle(steps, retry=True) is False:  # unreachable: the rest wait too
                with self._lock:
                    self._deferred.extend(pending[i + 1:])
                return

    def settled(self) -> bool:
        """Whether every settlement went through."""
        with self._lock:
            return not self._deferred

    def reset(self) -> None:
        """A new pool generation: what was recorded about the old one no longer applies."""
        with self._lock:
            self._held, self._refused, self._deferred, self._uncached = set(), set(), [], {}
            self._granted = {}
        self.ledger.reset()
        self.pool_lost = None

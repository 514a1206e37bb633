"""One pool's page ledger in Redis (RedisLedger): which owner holds which page, under which epoch, until when.

Every mutation is one Lua script (inference.ledger.scripts) over the pool's keys (inference.ledger.keys).
A pool belongs to one worker process (its id is the worker's id): only that process grants its pages,
renews and reaps its leases and scrubs its dirty pages; anyone else may read it, or delete the pool of
a worker that is gone (`unregister`), never mark its pages clean. Epochs are fencing tokens: a pool
re-registered after its records were lost starts a new generation whose epochs are above every epoch
its worker has seen (`reset`), and a client refuses a pool whose counter is behind what it saw.
A script runs again after a dropped connection only where REPEAT says a repeat is harmless (inference.retry).
"""
import logging
import uuid
from dataclasses import dataclass
from typing import Sequence

import redis
from redis.exceptions import ResponseError

from inference.allocator import CACHE_ENTRY_PREFIX, Grant, IntegrityError, LedgerError, NotHolding, PoolLost, cache_entry
from inference.ledger.audit import Facts, integrity_problems
from inference.ledger.keys import ledger_key, owner_prefix, pool_keys, text
from inference.ledger.scripts import PREAMBLE, REPEAT, SCRIPTS
from inference.retry import repeat

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "sandbox")
GENERATION_SPAN = 2**32  # epochs of generation g lie in (g * span, (g + 1) * span]
UNSETTLED = object()  # what a settle check answers when the first run's effect is not in place


@dataclass(frozen=True)
class ReclaimEvent:
    """An owner whose lease ran out: its pages went to the dirty set and wait to be scrubbed."""

    pool_id: str
    owner: str
    pages: tuple[int, ...]
    epochs: tuple[int, ...]
    expired_at_ms: int


@dataclass(frozen=True)
class Beat:
    """One heartbeat of the pool's worker: the owners it renews that hold no lease (taken back), and the
    other owners whose leases expired and were reaped into the dirty set."""

    missing: tuple[str, ...]
    reclaimed: tuple[ReclaimEvent, ...]


def _ms(seconds: float) -> int:
    if seconds <= 0:
        raise ValueError(f"lease TTL must be positive seconds, got {seconds}")
    return max(1, round(seconds * 1000))


def _check_request_owner(owner: str) -> None:
    _check_owner(owner)
    if owner.startswith(CACHE_ENTRY_PREFIX):
        raise LedgerError(f"owner {owner!r}: names starting with {CACHE_ENTRY_PREFIX!r} are cache entries")


def _run(script, keys: list[str], args: list) -> object:
    """Run a ledger script; its LEDGER/INTEGRITY error replies become LedgerError/IntegrityError."""
    try:
        return script(keys=keys, args=args)
    except ResponseError as e:
        kind, _, message = str(e).partition(" ")
        if kind == "INTEGRITY":
            raise IntegrityError(message) from None
        if kind == "LEDGER":
            raise LedgerError(message) from None
        if kind == "UNREGISTERED":
            raise PoolLost(message) from None
        raise


def _check_pool_id(pool_id: str) -> None:
    if not isinstance(pool_id, str) or not pool_id or ":" in pool_id:
        raise ValueError(f"pool_id must be a non-empty string without ':', got {pool_id!r}")


def _check_owner(owner: str) -> None:
    if not isinstance(owner, str) or not owner:
        raise LedgerError(f"owner must be a non-empty string, got {owner!r}")


class RedisLedger:
    """PageAllocator for one pool, kept in Redis so that every process sees the same owners.

    Needs Redis >= 6.2 (LPOP with a count) running with maxmemory-policy noeviction.
    """

    def __init__(
        self, redis_client: redis.Redis, pool_id: str, prefix: str = "kvs", lease_ttl_s: float = 30.0
    ):
        _check_pool_id(pool_id)
        _ms(lease_ttl_s)
        self.redis = redis_client
        self.pool_id = pool_id
        self.prefix = prefix
        self.lease_ttl_s = lease_ttl_s
        self._keys = pool_keys(prefix, pool_id)
        self._lua = {name: redis_client.register_script(PREAMBLE + body) for name, body in SCRIPTS.items()}
        meta = {text(k): text(v) for k, v in redis_client.hgetall(self.key("meta")).items()}
        if not meta:
            raise LedgerError(
                f"pool {pool_id} is not registered under prefix {prefix!r}; start its worker "
                f"(it calls RedisLedger.register) or check the prefix and Redis database"
            )
        self.role = meta["role"]
        self.num_pages = int(meta["num_pages"])
        self.page_size = int(meta["page_size"])
        self.generation = int(meta.get("generation", 0))
        self.max_epoch = 0  # the highest epoch this client was granted or registered above: the fencing floor

    @classmethod
    def register(
        cls,
        redis_client: redis.Redis,
        pool_id: str,
        role: str,
        num_pages: int,
        page_size: int,
        prefix: str = "kvs",
        lease_ttl_s: float = 30.0,
        generation: int = 0,
    ) -> "RedisLedger":
        """Create the pool, or reset it (a restarted worker's tensor is fresh); epochs stay monotonic,
        and those of `generation` start above generation * GENERATION_SPAN."""
        _check_pool_id(pool_id)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
        script = redis_client.register_script(PREAMBLE + SCRIPTS["register"])
        floor = generation * GENERATION_SPAN
        argv = [owner_prefix(prefix, pool_id), pool_id, role, num_pages, page_size, generation, floor]
        repeat(lambda: _run(script, pool_keys(prefix, pool_id), argv), f"ledger register of pool {pool_id}")
        ledger = cls(redis_client, pool_id, prefix, lease_ttl_s)
        ledger.max_epoch = floor
        return ledger

    def reset(self) -> None:
        """Register this pool again as a new generation, after its records were lost: every epoch it
        grants from now on is above every epoch this client has seen (and above any lost grant's)."""
        generation = max(self.generation + 1, self.max_epoch // GENERATION_SPAN + 1)
        again = self.register(self.redis, self.pool_id, self.role, self.num_pages, self.page_size, self.prefix,
                              self.lease_ttl_s, generation=generation)
        self.generation, self.max_epoch = again.generation, again.max_epoch

    def key(self, part: str) -> str:
        return ledger_key(self.prefix, self.pool_id, part)

    def _call(self, name: str, *args, settled=None) -> object:
        """Run script `name`; one that REPEAT allows runs again after a dropped connection (inference.retry).
        A repeat that a `refused` script refuses answers settled() instead, when that finds the first run's
        effect in place (else UNSETTLED: the refusal stands)."""
        argv = [owner_prefix(self.prefix, self.pool_id), self.pool_id, *args]
        kind = REPEAT[name].kind
        if kind == "never":
            return _run(self._lua[name], self._keys, argv)
        runs = []

        def once():
            runs.append(name)
            try:
                return _run(self._lua[name], self._keys, argv)
            except LedgerError as exc:
                if kind != "refused" or len(runs) == 1 or type(exc) is not LedgerError:
                    raise
                answer = settled()
                if answer is UNSETTLED:
                    raise
                log.info("ledger %s on pool %s: its first run took effect (the reply was lost)", name, self.pool_id)
                return answer

        return repeat(once, f"ledger {name} on pool {self.pool_id}")

    def _states(self, pages: Sequence[int]) -> list[tuple[str | None, int | None, str | None, bool]]:
        """(owner, epoch, scope, on the free list) of each page, in one read."""
        return [(None if o is None else text(o), None if e is None else int(e), None if s is None else text(s),
                 bool(f)) for o, e, s, f in self._call("states", *pages)]

    def _all_free(self, pages: Sequence[int], answer) -> object:
        """answer() when every page is on the free list (what free, evict and mark_clean leave), else UNSETTLED."""
        return answer() if all(free for *_, free in self._states(pages)) else UNSETTLED

    def unregister(self) -> None:
        """Delete every key of this pool, its epoch counter included."""
        self._call("unregister")

    def num_free(self) -> int:
        return repeat(lambda: self.redis.llen(self.key("free")), f"free pages of pool {self.pool_id}")

    def allocate(self, owner: str, n: int, keep_free: int = 0) -> Grant | None:
        """Pop n pages off the head of the free list, each under a fresh epoch; None when fewer than
        n + keep_free are free."""
        grants = self._grant([(owner, n)], must_hold=False, keep_free=keep_free)
        return None if grants is None else grants[0]

    def extend(self, owner: str, n: int) -> Grant | None:
        """allocate() for an owner that already holds pages."""
        grants = self._grant([(owner, n)], must_hold=True)
        return None if grants is None else grants[0]

    def extend_many(self, requests: Sequence[tuple[str, int]]) -> list[Grant] | None:
        """extend() for several owners in one script (a step's growth): all or nothing, a Grant per owner in
        the order given, each owner's lease renewed; None when their total does not fit now; NotHolding
        (nothing granted) when some of them hold no pages."""
        return self._grant(list(requests), must_hold=True)

    def _grant(self, requests: list[tuple[str, int]], must_hold: bool, keep_free: int = 0) -> list[Grant] | None:
        owners = [owner for owner, _ in requests]
        for owner in owners:
            _check_request_owner(owner)
        if len(set(owners)) != len(owners):
            raise LedgerError(f"pool {self.pool_id}: owners listed twice in one grant: {owners}")
        for owner, n in requests:
            if n < 0:
                raise LedgerError(f"pool {self.pool_id}: cannot allocate {n} pages to {owner}; ask for 0 or more")
        if keep_free < 0:
            raise LedgerError(f"pool {self.pool_id}: cannot keep {keep_free} pages free; ask for 0 or more")
        counts = [int(n) for _, n in requests]
        flat = self._call("grant", _ms(self.lease_ttl_s), int(must_hold), self.max_epoch, int(keep_free),
                          len(owners), *owners, *counts, uuid.uuid4().hex)
        if flat is None:
            return None
        if flat and text(flat[0]) == "missing":
            raise NotHolding(self.pool_id, [text(o) for o in flat[1:]])
        grants, i = [], 0
        for n in counts:
            chunk = flat[2 * i: 2 * (i + n)]
            grants.append(Grant(tuple(chunk[0::2]), tuple(chunk[1::2])))
            i += n
        if flat:
            self.max_epoch = max(self.max_epoch, *flat[1::2])
        return grants

    def free(self, owner: str, pages: Sequence[int], epochs: Sequence[int]) -> int | None:
        """Return pages to the tail of the free list; all or nothing, only at the epochs they were granted.
        Returns how many pages the owner still holds (None when nothing was listed)."""
        _check_owner(owner)
        pages, epochs = [int(p) for p in pages], [int(e) for e in epochs]
        if len(pages) != len(epochs):
            raise LedgerError(f"pool {self.pool_id}: free got {len(pages)} pages but {len(epochs)} epochs")
        if not pages:
            return None
        return self._call("free", owner, len(pages), *pages, *epochs,
                          settled=lambda: self._all_free(pages, lambda: len(self.pages_of(owner))))

    def release(self, owner: str) -> list[int]:
        """Free everything the owner holds and drop its lease; returns the pages, sorted."""
        _check_owner(owner)
        return self._call("release", owner)

    def renew_leases(self, owners: Sequence[str], ttl_s: float | None = None) -> list[str]:
        """Push the owners' lease expiry to now + ttl_s; returns the owners that hold no lease (reaped)."""
        ttl_ms, owners = _ms(self.lease_ttl_s if ttl_s is None else ttl_s), list(owners)
        return [text(o) for o in self._call("renew", ttl_ms, *owners)] if owners else []

    def reap_expired(self, now_ms: int | None = None) -> list[ReclaimEvent]:
        """Move the pages of every owner whose lease expired to the dirty set (never straight to free).
        Its worker does this in `beat`; others call it only to inject a lost lease (tests)."""
        return list(self._events(self._call("reap", "" if now_ms is None else int(now_ms))))

    def _events(self, events) -> tuple[ReclaimEvent, ...]:
        return tuple(ReclaimEvent(self.pool_id, text(owner), tuple(flat[0::2]), tuple(flat[1::2]), expired_at_ms)
                     for owner, expired_at_ms, flat in events)

    def beat(self, owners: Sequence[str], now_ms: int | None = None) -> Beat:
        """The pool worker's heartbeat, one atomic script: renew `owners` (the requests it runs), then
        reap every other owner whose lease expired (Redis TIME, or `now_ms`). Raises PoolLost when the
        pool is gone or its epoch counter is behind what this client was granted."""
        missing, events = self._call("beat", _ms(self.lease_ttl_s), "" if now_ms is None else int(now_ms),
                                     self.max_epoch, *owners)
        return Beat(tuple(text(o) for o in missing), self._events(events))

    def holds(self, owner: str, pages: Sequence[int], epochs: Sequence[int]) -> bool:
        """Whether `owner` holds every page at its epoch, under a lease."""
        pages, epochs = [int(p) for p in pages], [int(e) for e in epochs]
        return bool(self._call("holds", owner, len(pages), *pages, *epochs))

    def take_dirty(self, claimer: str, in_hand: Sequence[int] = ()) -> list[int]:
        """Claims, for `claimer` to scrub, every dirty page no one has claimed, with those `claimer` claimed
        before and does not have `in_hand` (its claim's reply was lost); sorted. They stay dirty (and
        claimed) until `mark_clean`: a page in hand is never handed out again."""
        return [int(p) for p in self._call("claim_dirty", claimer, *map(int, in_hand))]

    def mark_clean(self, pages: Sequence[int], claimer: str) -> None:
        """Scrubbed pages join the tail of the free list; each must be dirty and claimed by `claimer`
        (all or nothing)."""
        pages = [int(p) for p in pages]
        if pages:
            self._call("mark_clean", claimer, *pages, settled=lambda: self._all_free(pages, lambda: None))

    def owner_of(self, page: int) -> tuple[str, int] | None:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hget(self.key("page_owner"), page).hget(self.key("page_epoch"), page)
            owner, epoch = pipe.execute()
        return None if owner is None else (text(owner), int(epoch))

    def pages_of(self, owner: str) -> dict[int, int]:
        flat = self._call("pages_of", owner)
        return dict(sorted(zip(flat[0::2], flat[1::2])))

    # ---- shared pages (the prefix cache) ----------------------------------------------------------------
    def cache(self, owner: str, salt: str, pages: Sequence[int], epochs: Sequence[int]) -> str:
        """Hand `owner`'s written, full pages to the cache entry of scope `salt` (they keep their epochs);
        all or nothing. Returns the entry (an owner whose lease the pool's worker renews)."""
        _check_request_owner(owner)
        entry = cache_entry(salt)
        pages, epochs = [int(p) for p in pages], [int(e) for e in epochs]
        if len(pages) != len(epochs):
            raise LedgerError(f"pool {self.pool_id}: cache got {len(pages)} pages but {len(epochs)} epochs")
        def settled():
            cached = [(entry, e, salt) for e in epochs]
            return entry if [state[:3] for state in self._states(pages)] == cached else UNSETTLED

        self._call("cache", owner, entry, salt, _ms(self.lease_ttl_s), len(pages), *pages, *epochs, settled=settled)
        return entry

    def hit(self, reader: str, salt: str, pages: Sequence[int], epochs: Sequence[int]) -> bool:
        """`reader` reads the cached pages (scope `salt`, at those epochs) under its lease: True, or False when
        one left the cache meanwhile (nothing recorded). A page of another scope raises LedgerError."""
        _check_request_owner(reader)
        cache_entry(salt)  # checks the salt
        pages, epochs = [int(p) for p in pages], [int(e) for e in epochs]
        if len(pages) != len(epochs):
            raise LedgerError(f"pool {self.pool_id}: hit got {len(pages)} pages but {len(epochs)} epochs")
        return bool(self._call("hit", reader, salt, _ms(self.lease_ttl_s), len(pages), *pages, *epochs))

    def unread(self, reader: str) -> int:
        """Ends every read of `reader`; returns how many pages it read."""
        _check_request_owner(reader)
        return int(self._call("unread", reader))

    def evict(self, salt: str, pages: Sequence[int], epochs: Sequence[int]) -> int:
        """Cached pages of scope `salt` without readers go to the free list (their worker scrubs them, the next
        grant gives a fresh epoch). All or nothing; returns how many pages the entry still holds."""
        pages, epochs = [int(p) for p in pages], [int(e) for e in epochs]
        if len(pages) != len(epochs):
            raise LedgerError(f"pool {self.pool_id}: evict got {len(pages)} pages but {len(epochs)} epochs")
        if not pages:
            return 0
        entry = cache_entry(salt)
        return int(self._call("evict", entry, len(pages), *pages, *epochs,
                              settled=lambda: self._all_free(pages, lambda: len(self.pages_of(entry)))))

    def reads_of(self, reader: str) -> list[int]:
        return [int(p) for p in self._call("reads_of", reader)]

    def _facts(self) -> Facts:
        (num_pages, free, dirty, owner_flat, epoch_flat, index, names, sets, lease_flat, counter, listed,
         scrubbing, generation, scope_flat, reader_scope_flat, (by_page, by_owner)) = self._call("facts")
        return Facts(
            num_pages=None if num_pages is None else int(num_pages),
            free=[int(p) for p in free],
            dirty={int(p) for p in dirty},
            page_owner={int(p): text(o) for p, o in zip(owner_flat[0::2], owner_flat[1::2])},
            page_epoch={int(p): int(e) for p, e in zip(epoch_flat[0::2], epoch_flat[1::2])},
            owner_index={text(o) for o in index},
            owner_sets={text(o): {int(p) for p in s} for o, s in zip(names, sets)},
            leases={text(o): int(float(t)) for o, t in zip(lease_flat[0::2], lease_flat[1::2])},
            epoch_counter=int(counter),
            is_listed=bool(listed),
            scrubbing={int(p): text(c) for p, c in zip(scrubbing[0::2], scrubbing[1::2])},
            generation=int(generation),
            scope={int(p): text(x) for p, x in zip(scope_flat[0::2], scope_flat[1::2])},
            reader_scope={text(o): text(x) for o, x in zip(reader_scope_flat[0::2], reader_scope_flat[1::2])},
            readers={int(p): {text(r) for r in rs} for p, rs in by_page},
            reads={text(o): {int(p) for p in ps} for o, ps in zip(names, by_owner) if ps},
        )

    def snapshot(self) -> dict[int, dict | str]:
        """page -> {"owner", "epoch"} | "free" | "dirty" ("lost" only when the books do not balance)."""
        f = self._facts()
        num_pages = self.num_pages if f.num_pages is None else f.num_pages
        free = set(f.free)
        out: dict[int, dict | str] = {}
        for page in range(num_pages):
            if page in f.page_owner:
                out[page] = {"owner": f.page_owner[page], "epoch": f.page_epoch.get(page, -1)}
                if page in f.scope:
                    out[page].update(scope=f.scope[page], readers=sorted(f.readers.get(page, ())))
            else:
                out[page] = "dirty" if page in f.dirty else "free" if page in free else "lost"
        return out

    def check_integrity(self) -> None:
        """Raise IntegrityError naming every way the pool's records disagree, from one consistent read."""
        problems = integrity_problems(self._facts())
        if problems:
            raise IntegrityError(
                f"pool {self.pool_id}: " + "; ".join(problems) + ". Stop the pool's worker and restart it: "
                "registering resets the pool (its tensor is fresh; epochs stay monotonic)"
            )

def ledger_from_url(url: str, pool_id: str, prefix: str = "kvs", lease_ttl_s: float = 30.0) -> RedisLedger:
    return RedisLedger(redis.Redis.from_url(url), pool_id, prefix, lease_ttl_s)

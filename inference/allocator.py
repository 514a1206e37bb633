"""The narrow page-allocation boundary between the engine and whoever records page ownership.

Ids in, ids out. `LocalAllocator` serves tests and the CLI; `inference.ledger.RedisLedger`
implements the same interface against Redis. "Doesn't fit now" is `None`; a bug raises.
"""
from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence


class LedgerError(Exception):
    """A caller broke the ledger's contract (not the owner, stale epoch, unknown page)."""


class IntegrityError(LedgerError):
    """The ledger's books do not balance: free + owned + dirty != total, or a page is owned twice."""


class NotHolding(LedgerError):
    """A grant that extends owners found some holding nothing (their pages were reaped: the lease was lost)."""

    def __init__(self, pool_id: str, owners):
        self.owners = tuple(owners)
        super().__init__(f"pool {pool_id}: {list(self.owners)} hold no pages to extend; allocate their first "
                         "pages instead (or their lease was lost)")


class PoolLost(LedgerError):
    """The pool's records are gone or older than what its worker has seen (Redis restarted empty, failed
    over to a lagging replica, or an operator's FLUSHDB): its worker must fail what it holds, scrub its
    whole tensor and register a fresh generation."""


CACHE_ENTRY_PREFIX = "cache~"  # owners named so are prefix-cache entries; no request may take such a name


def cache_entry(salt: str) -> str:
    """The owner that holds one cache scope's (salt's) pages in a pool."""
    if not isinstance(salt, str) or not salt or any(c in salt for c in ": "):
        raise LedgerError(f"a cache scope is a non-empty salt without ':' or spaces, got {salt!r}")
    return CACHE_ENTRY_PREFIX + salt


@dataclass(frozen=True)
class Grant:
    """Pages handed to one owner, with the fencing epoch each page was granted under."""

    pages: tuple[int, ...]
    epochs: tuple[int, ...]


class PageAllocator(Protocol):
    pool_id: str
    num_pages: int

    def num_free(self) -> int: ...

    def allocate(self, owner: str, n: int, keep_free: int = 0) -> Grant | None: ...

    def extend_many(self, requests: Sequence[tuple[str, int]]) -> list[Grant] | None: ...

    def free(self, owner: str, pages: Sequence[int], epochs: Sequence[int]) -> None: ...

    def release(self, owner: str) -> list[int]: ...

    def check_integrity(self) -> None: ...

    # shared pages (the prefix cache); RedisLedger documents each
    def cache(self, owner: str, salt: str, pages: Sequence[int], epochs: Sequence[int]) -> str: ...

    def hit(self, reader: str, salt: str, pages: Sequence[int], epochs: Sequence[int]) -> bool: ...

    def unread(self, reader: str) -> None: ...

    def evict(self, salt: str, pages: Sequence[int], epochs: Sequence[int]) -> int: ...


class LocalAllocator:
    """In-process allocator with the ledger's semantics: FIFO free list, monotonic epochs."""

    def __init__(self, num_pages: int, pool_id: str = "local"):
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.pool_id = pool_id
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._owner: dict[int, tuple[str, int]] = {}  # page -> (owner, epoch)
        self._next_epoch = 1
        self._scope: dict[int, str] = {}  # cached page -> salt
        self._readers: dict[int, set[str]] = {}  # cached page -> readers

    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, owner: str, n: int, keep_free: int = 0) -> Grant | None:
        """n pages for `owner`, leaving at least `keep_free` free; None when they do not fit now."""
        grants = self._grant([(owner, n)], keep_free, must_hold=False)
        return None if grants is None else grants[0]

    def extend_many(self, requests: Sequence[tuple[str, int]]) -> list[Grant] | None:
        """More pages for several owners that already hold some, all or nothing (one ledger call)."""
        return self._grant(requests, 0, must_hold=True)

    def _grant(self, requests, keep_free: int, must_hold: bool) -> list[Grant] | None:
        owners = [o for o, _ in requests]
        if any(o.startswith(CACHE_ENTRY_PREFIX) for o in owners):
            raise LedgerError(f"owners {owners}: names starting with {CACHE_ENTRY_PREFIX!r} are cache entries")
        if len(set(owners)) != len(owners):
            raise LedgerError(f"owners listed twice in one grant: {owners}")
        if any(n < 0 for _, n in requests) or keep_free < 0:
            raise LedgerError(f"cannot allocate {list(requests)} keeping {keep_free} free")
        if must_hold:
            holders = {o for o, _ in self._owner.values()}
            if missing := [o for o in owners if o not in holders]:
                raise NotHolding(self.pool_id, missing)
        if sum(n for _, n in requests) + keep_free > len(self._free):
            return None
        grants = []
        for owner, n in requests:
            pages, epochs = [], []
            for _ in range(n):
                page = self._free.popleft()
                self._owner[page] = (owner, self._next_epoch)
                pages.append(page)
                epochs.append(self._next_epoch)
                self._next_epoch += 1
            grants.append(Grant(tuple(pages), tuple(epochs)))
        return grants

    def free(self, owner: str, pages: Sequence[int], epochs: Sequence[int]) -> None:
        for page, epoch in zip(pages, epochs, strict=True):
            held = self._owner.get(page)
            if held != (owner, epoch):
                raise LedgerError(
                    f"pool {self.pool_id}: {owner} cannot free page {page} at epoch {epoch}; "
                    f"it is held by {held}"
                )
            if page in self._scope:
                raise LedgerError(f"pool {self.pool_id}: page {page} is cached; evict it instead")
        for page in pages:
            del self._owner[page]
            self._free.append(page)

    def release(self, owner: str) -> list[int]:
        self.unread(owner)
        pages = sorted(p for p, (o, _) in self._owner.items() if o == owner)
        for page in pages:
            del self._owner[page]
            self._scope.pop(page, None)
            self._free.append(page)
        return pages

    def cache(self, owner: str, salt: str, pages: Sequence[int], epochs: Sequence[int]) -> str:
        entry = cache_entry(salt)
        for page, epoch in zip(pages, epochs, strict=True):
            if self._owner.get(page) != (owner, epoch) or page in self._scope:
                raise LedgerError(f"pool {self.pool_id}: {owner} cannot cache page {page} at epoch {epoch}")
        for page, epoch in zip(pages, epochs):
            self._owner[page] = (entry, epoch)
            self._scope[page] = salt
            self._readers[page] = set()
        return entry

    def hit(self, reader: str, salt: str, pages: Sequence[int], epochs: Sequence[int]) -> bool:
        for page, epoch in zip(pages, epochs, strict=True):
            if self._scope.get(page, salt) != salt:
                raise LedgerError(f"pool {self.pool_id}: {reader} cannot read cached page {page}: it is outside "
                                  "its scope")
            if page not in self._scope or self._owner[page][1] != epoch:
                return False
        for page in pages:
            self._readers[page].add(reader)
        return True

    def unread(self, reader: str) -> None:
        for readers in self._readers.values():
            readers.discard(reader)

    def evict(self, salt: str, pages: Sequence[int], epochs: Sequence[int]) -> int:
        entry = cache_entry(salt)
        for page, epoch in zip(pages, epochs, strict=True):
            if self._owner.get(page) != (entry, epoch) or self._readers.get(page):
                raise LedgerError(f"pool {self.pool_id}: {entry} cannot evict page {page} at epoch {epoch}")
        for page in pages:
            del self._owner[page], self._scope[page], self._readers[page]
            self._free.append(page)
        return sum(1 for o, _ in self._owner.values() if o == entry)

    def check_integrity(self) -> None:
        free = set(self._free)
        problems = []
        if len(free) != len(self._free):
            problems.append("a page is on the free list twice")
        if free & self._owner.keys():
            problems.append(f"free pages with an owner: {sorted(free & self._owner.keys())}")
        if len(free) + len(self._owner) != self.num_pages:
            problems.append(f"free {len(free)} + owned {len(self._owner)} != total {self.num_pages}")
        if problems:
            raise IntegrityError(f"pool {self.pool_id}: " + "; ".join(problems))

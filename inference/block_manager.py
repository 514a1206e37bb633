"""The worker's local mirror of page ownership (owner, epoch, written watermark per page) and the
guard that checks every sequence's reads against it before each forward pass.

Pages come from a `PageAllocator` (the Redis ledger in workers); the mirror is updated at every
allocate, append, write and free, so the per-token guard needs no Redis round trip. The verbs:
`allocate` (a sequence's first pages), `can_append`/`append_slots` (a step's growth, one ledger call for
every sequence that crosses a page boundary), `deallocate` (finish and preemption alike: free + scrub).
A sequence's block table may start with shared pages (`seq.num_shared`, read from the prefix cache):
those must be cached pages of the sequence's own scope (`seq.scope`: its salt, or for one of a request's n
choices the request's own scope, inference.choices), and are never written.
"""
from dataclasses import dataclass

from inference.allocator import PageAllocator, cache_entry
from inference.faults import NO_FAULTS, Faults
from inference.kv_cache import PagePool, cdiv
from inference.sequence import Sequence
from inference.settings import SCRUB_POLICIES  # the one list, which KVSERVE_SCRUB accepts


VIOLATION_KINDS = ("foreign_read", "stale_epoch", "unwritten_read", "shared_write")


@dataclass
class Violation:
    kind: str  # one of VIOLATION_KINDS
    reader: str
    page: int
    page_owner: str | None
    pool: str
    reader_epoch: int | None
    page_epoch: int | None
    read_len: int
    watermark: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class OwnershipViolation(Exception):
    def __init__(self, v: Violation):
        self.violation = v
        super().__init__(
            f"{v.kind}: request {v.reader} would read page {v.page} of pool {v.pool} "
            f"(owner {v.page_owner}, page epoch {v.page_epoch}, reader epoch {v.reader_epoch}, "
            f"read {v.read_len} tokens, written {v.watermark})"
        )


class BlockManager:
    def __init__(self, allocator: PageAllocator, pool: PagePool, scrub_policy: str = "on_free",
                 faults: Faults = NO_FAULTS):
        if scrub_policy not in SCRUB_POLICIES:
            raise ValueError(f"scrub policy {scrub_policy!r}: use one of {SCRUB_POLICIES}")
        if scrub_policy == "off" and "no_scrub" not in faults:
            raise ValueError(
                "KVSERVE_SCRUB=off would hand freed pages, still holding the previous request's KV, to the next "
                "owner; scrubbing is switched off only by fault injection (tests, the canary sandbox): set "
                "KVSERVE_FAULTS=no_scrub to mean it, or serve with KVSERVE_SCRUB=on_free (the default) or on_alloc")
        if "no_scrub" in faults:
            scrub_policy = "off"
        if allocator.num_pages != pool.num_pages:
            raise ValueError(f"allocator has {allocator.num_pages} pages, pool tensor {pool.num_pages}")
        self.allocator = allocator
        self.pool = pool
        self.page_size = pool.page_size
        self.scrub_policy = scrub_policy
        self.check_owner = "no_ownership_guard" not in faults
        self.check_watermark = "no_watermark_guard" not in faults
        n = pool.num_pages
        self.owner: list[str | None] = [None] * n
        self.epoch: list[int] = [0] * n
        self.written: list[int] = [0] * n
        self.scope: list[str | None] = [None] * n  # the salt of a cached page
        self.readers: list[int] = [0] * n  # sequences here reading a cached page
        self.prefix_cache = None  # an inference.prefix_cache.PrefixCache, when the engine caches prefixes
        self.num_guard_checks = 0  # check_reads calls since start (a metric: kvserve_guard_checks_total)

    @property
    def pool_id(self) -> str:
        return self.allocator.pool_id

    def num_free(self) -> int:
        return self.allocator.num_free()

    def allocate(self, seq: Sequence, num_pages: int, keep_free: int = 0) -> bool:
        """Gives `seq` `num_pages` more pages, leaving at least `keep_free` free; False when they do not fit now."""
        grant = self.allocator.allocate(seq.request_id, num_pages, keep_free)
        if grant is None and self.prefix_cache is not None and self.prefix_cache.evict(num_pages + keep_free):
            grant = self.allocator.allocate(seq.request_id, num_pages, keep_free)  # LRU cached pages made room
        if grant is None:
            return False
        self._take(seq, grant)
        return True

    def pages_short(self, seq: Sequence, num_tokens: int) -> int:
        """How many pages `seq` lacks to hold K/V for its first `num_tokens` tokens."""
        return max(0, cdiv(num_tokens, self.page_size) - len(seq.block_table))

    def can_append(self, grows: list[tuple[Sequence, int]], keep_free: int = 0) -> bool:
        """Whether the pool has the pages `grows` asks for, leaving `keep_free` free (an unreachable ledger
        counts as yes: not a shortage)."""
        free, need = self.allocator.num_free(), sum(n for _, n in grows) + keep_free
        if free is not None and free < need and self.prefix_cache is not None:  # cached pages go before anyone
            self.prefix_cache.evict(need)                                        # running is preempted
            free = self.allocator.num_free()
        return free is None or free >= need

    def append_slots(self, grows: list[tuple[Sequence, int]]) -> bool:
        """Gives each (seq, n) n more pages in ONE ledger call, all or nothing; False when they do not fit now."""
        grows = [(seq, n) for seq, n in grows if n]
        if not grows:
            return True
        grants = self.allocator.extend_many([(seq.request_id, n) for seq, n in grows])
        if grants is None:
            return False
        for (seq, _), grant in zip(grows, grants, strict=True):
            self._take(seq, grant)
        return True

    def _take(self, seq: Sequence, grant) -> None:
        for page, epoch in zip(grant.pages, grant.epochs):
            self.owner[page], self.epoch[page], self.written[page] = seq.request_id, epoch, 0
        if self.scrub_policy == "on_alloc":
            self.pool.scrub(grant.pages)
        seq.block_table += grant.pages
        seq.page_epochs += grant.epochs

    def deallocate(self, seq: Sequence) -> None:
        """Ends `seq`'s reads of shared pages and frees its own; a finished prompt's full pages may stay in
        the prefix cache instead (its `keep`)."""
        if not seq.block_table:
            return
        if self.prefix_cache is not None and seq.salt and seq.status.value in ("finished", "prefilled"):
            self.prefix_cache.keep(seq)
        self.unshare(seq)
        entry = cache_entry(seq.salt) if seq.salt else None
        kept = [self.scope[p] is not None and self.owner[p] == entry for p in seq.block_table]  # now cached
        pages = [p for p, k in zip(seq.block_table, kept) if not k]
        epochs = [e for e, k in zip(seq.page_epochs, kept) if not k]
        if pages:
            self.allocator.free(seq.request_id, pages, epochs)
            self.forget(pages)
        seq.block_table, seq.page_epochs = [], []

    def release_all(self, seq: Sequence) -> list[int]:
        """Frees whatever the ledger says `seq` owns (and ends its reads), not what its (possibly corrupt)
        table says. What this process granted it is scrubbed first: a release whose reply is lost has freed
        pages the reply would have named."""
        self.forget_reads(seq)
        mine = [page for page, owner in enumerate(self.owner) if owner == seq.request_id]
        self.forget(mine)
        pages = self.allocator.release(seq.request_id)
        self.forget(sorted(set(pages).difference(mine)))
        seq.block_table, seq.page_epochs = [], []
        return pages

    # ---- shared pages ------------------------------------------------------------------------------
    def share(self, seq: Sequence, pages, epochs) -> bool:
        """`seq` (holding nothing yet) reads cached pages of its scope (`seq.scope`) as the start of its block
        table; False when one left the cache meanwhile (nothing recorded)."""
        if seq.block_table:
            raise ValueError(f"{seq} holds pages already: shared pages start a block table")
        if not pages:
            return True
        if not self.allocator.hit(seq.request_id, seq.scope, list(pages), list(epochs)):
            return False
        for page in pages:
            self.readers[page] += 1
        seq.block_table, seq.page_epochs = list(pages), list(epochs)
        seq.num_shared = len(pages)
        return True

    def unshare(self, seq: Sequence) -> None:
        """Ends `seq`'s reads: its shared pages leave its block table (they stay cached)."""
        if seq.num_shared:
            self.allocator.unread(seq.request_id)
            self.forget_reads(seq)

    def forget_reads(self, seq: Sequence) -> None:
        """The mirror's side of ending seq's reads (the ledger's is unread, release or a reap)."""
        for page in seq.block_table[: seq.num_shared]:
            self.readers[page] = max(0, self.readers[page] - 1)
        del seq.block_table[: seq.num_shared], seq.page_epochs[: seq.num_shared]
        seq.num_shared = 0

    def cache_pages(self, seq: Sequence, indices: list[int]) -> str | None:
        """`seq`'s own, written, full pages at `indices` of its table go to its scope's (`seq.scope`) cache entry; None when
        the ledger did not take them (they stay `seq`'s, freed with the rest of its pages)."""
        pages = [seq.block_table[i] for i in indices]
        epochs = [seq.page_epochs[i] for i in indices]
        for i, page in zip(indices, pages):
            if i < seq.num_shared or self.owner[page] != seq.request_id or self.written[page] != self.page_size:
                raise ValueError(f"page {page} of {seq} is not its own full page; only those are cached")
        entry = self.allocator.cache(seq.request_id, seq.scope, pages, epochs)
        if entry is None:
            return None
        for page in pages:
            self.owner[page], self.scope[page] = entry, seq.scope
        return entry

    def evict_pages(self, salt: str, pages, epochs) -> None:
        """Cached pages without readers go back to the pool, scrubbed like any freed page (forgotten here
        whatever the ledger answers: one it cannot take now is settled later, see HostLedger)."""
        if any(self.readers[p] for p in pages):
            raise ValueError(f"cached pages {[p for p in pages if self.readers[p]]} have readers")
        self.allocator.evict(salt, list(pages), list(epochs))
        self.forget(pages)

    def forget(self, pages) -> None:
        """Drops pages from the mirror (freed or reclaimed) and scrubs them under `on_free`."""
        for page in pages:
            self.owner[page], self.epoch[page], self.written[page] = None, 0, 0
            self.scope[page], self.readers[page] = None, 0
        if self.scrub_policy == "on_free":
            self.pool.scrub(pages)

    def mark_written(self, seq: Sequence, num_tokens: int) -> None:
        """Records that `seq`'s first `num_tokens` tokens now have K/V in its pages."""
        ps = self.page_size
        first = min(seq.num_cached, num_tokens) // ps
        for i in range(first, cdiv(num_tokens, ps)):
            page = seq.block_table[i]
            self.written[page] = max(self.written[page], min(ps, num_tokens - i * ps))

    def check_reads(self, seq: Sequence, num_past: int, num_new: int) -> None:
        """Raises OwnershipViolation unless every page in seq's block table is its own at the
        current epoch and the `num_past` cached tokens it will read were written for it."""
        self.num_guard_checks += 1
        rid, ps = seq.request_id, self.page_size
        needed = cdiv(num_past + num_new, ps)
        if needed > len(seq.block_table):
            self._raise("unwritten_read", seq, None, num_past + num_new, 0, None)
        if self.check_owner and num_new and num_past // ps < seq.num_shared:
            page = seq.block_table[num_past // ps]
            self._raise("shared_write", seq, page, num_past, self.written[page], seq.page_epochs[num_past // ps])
        scope = seq.scope
        scope_owner = cache_entry(scope) if seq.num_shared else None
        for i, (page, epoch) in enumerate(zip(seq.block_table, seq.page_epochs)):
            if self.check_owner:
                if i < seq.num_shared:  # a cached page of the sequence's own scope, held by that scope's entry
                    if scope is None or self.scope[page] != scope or self.owner[page] != scope_owner:
                        self._raise("foreign_read", seq, page, num_past, self.written[page], epoch)
                elif self.owner[page] != rid:
                    self._raise("foreign_read", seq, page, num_past, self.written[page], epoch)
                if self.epoch[page] != epoch:
                    self._raise("stale_epoch", seq, page, num_past, self.written[page], epoch)
            if self.check_watermark and i * ps < num_past:
                if self.written[page] < min(ps, num_past - i * ps):
                    self._raise("unwritten_read", seq, page, num_past, self.written[page], epoch)

    def read_record(self, seq: Sequence) -> dict:
        """What `seq` read, as the mirror saw it just before its pages were freed: an audit record
        that canaries check independently of the guard (every page its own, reads within writes)."""
        pages = list(seq.block_table)
        return {"request": seq.request_id, "pool": self.pool_id, "pages": pages, "epochs": list(seq.page_epochs),
                "owners": [self.owner[p] for p in pages], "page_epochs": [self.epoch[p] for p in pages],
                "written": [self.written[p] for p in pages], "read_len": seq.num_cached,
                "shared": seq.num_shared, "scope": seq.scope if seq.num_shared else None,
                "choice_of": seq.choice_of}

    def _raise(self, kind, seq, page, read_len, watermark, reader_epoch):
        raise OwnershipViolation(Violation(
            kind=kind, reader=seq.request_id, page=-1 if page is None else page,
            page_owner=None if page is None else self.owner[page], pool=self.pool_id,
            reader_epoch=reader_epoch, page_epoch=None if page is None else self.epoch[page],
            read_len=read_len, watermark=watermark,
        ))

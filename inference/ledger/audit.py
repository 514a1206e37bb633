"""The ledger's audits: whether a pool's records, read in one script (`facts`), balance (check_integrity), and
whether the Redis server may evict ledger keys (its maxmemory-policy)."""
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import redis
from redis.exceptions import ResponseError

from inference.allocator import CACHE_ENTRY_PREFIX, LedgerError
from inference.ledger.keys import text


@dataclass
class Facts:
    """One consistent read of a pool's records (the `facts` script), decoded."""

    num_pages: int | None
    free: list[int]
    dirty: set[int]
    page_owner: dict[int, str]
    page_epoch: dict[int, int]
    owner_index: set[str]
    owner_sets: dict[str, set[int]]
    leases: dict[str, int]
    epoch_counter: int
    is_listed: bool
    scrubbing: dict[int, str]
    generation: int
    scope: dict[int, str] = field(default_factory=dict)  # cached page -> salt
    reader_scope: dict[str, str] = field(default_factory=dict)
    readers: dict[int, set[str]] = field(default_factory=dict)  # cached page -> its readers
    reads: dict[str, set[int]] = field(default_factory=dict)  # owner -> pages it reads


def _few(items, limit: int = 20) -> str:
    items = list(items)
    return str(items) if len(items) <= limit else f"{items[:limit]} and {len(items) - limit} more"


def _repeated(items) -> list:
    return sorted(x for x, count in Counter(items).items() if count > 1)


def integrity_problems(f: Facts) -> list[str]:
    """Every way the records disagree with each other; [] when the books balance."""
    if f.num_pages is None:
        return ["its meta hash is missing (not registered, or the keys were deleted or evicted)"]
    problems = []
    free, owned, dirty, epochs = set(f.free), f.page_owner.keys(), f.dirty, f.page_epoch
    if twice_free := _repeated(f.free):
        problems.append(f"pages on the free list twice: {_few(twice_free)}")
    listers = defaultdict(list)  # page -> owners whose page set lists it
    for owner, pages in sorted(f.owner_sets.items()):
        for page in pages:
            listers[page].append(owner)
    seen = free | dirty | owned | epochs.keys() | listers.keys()
    if out_of_range := sorted(p for p in seen if not 0 <= p < f.num_pages):
        problems.append(f"page ids outside 0..{f.num_pages - 1}: {_few(out_of_range)}")
    for what, a, b in (("free and owned", free, owned), ("free and dirty", free, dirty),
                       ("dirty and owned", dirty, owned)):
        if a & b:
            problems.append(f"pages both {what}: {_few(sorted(a & b))}")
    if len(free) + len(owned) + len(dirty) != f.num_pages:
        problems.append(f"free {len(free)} + owned {len(owned)} + dirty {len(dirty)} != total {f.num_pages}")
    if lost := sorted(set(range(f.num_pages)) - seen):
        problems.append(f"pages in no state: {_few(lost)}")
    if owned != epochs.keys():
        problems.append(f"pages with an owner or an epoch but not both: {_few(sorted(owned ^ epochs.keys()))}")
    if twice := [(p, o) for p, o in sorted(listers.items()) if len(o) > 1]:
        problems.append(f"pages listed by two owners: {_few(twice)}")
    if disagree := [
        (p, f.page_owner.get(p), listers.get(p, []))
        for p in sorted(owned | listers.keys())
        if len(listers.get(p, [])) < 2 and listers.get(p) != [f.page_owner.get(p)]
    ]:
        problems.append(f"owner page sets disagree with page->owner for (page, owner, listed by): "
                        f"{_few(disagree)}")
    holders = {o for o, pages in f.owner_sets.items() if pages} | {o for o, pages in f.reads.items() if pages}
    problems += _shared_problems(f)
    if f.owner_index != holders:
        problems.append(f"owner index {sorted(f.owner_index)} != owners holding pages {sorted(holders)}")
    if unleased := sorted(holders - f.leases.keys()):
        problems.append(f"owners holding pages without a lease (never reaped): {_few(unleased)}")
    if idle := sorted(f.leases.keys() - holders):
        problems.append(f"leases of owners holding nothing: {_few(idle)}")
    if epochs and max(epochs.values()) > f.epoch_counter:
        problems.append(
            f"epoch counter {f.epoch_counter} is behind granted epoch {max(epochs.values())}: "
            "fencing tokens would repeat"
        )
    if shared := _repeated(epochs.values()):
        problems.append(f"pages share an epoch: {_few(shared)}")
    if claimed_clean := sorted(f.scrubbing.keys() - dirty):
        problems.append(f"pages claimed for scrubbing that are not dirty: {_few(claimed_clean)}")
    if not f.is_listed:
        problems.append("the pool is missing from the pools set")
    return problems


def _shared_problems(f: Facts) -> list[str]:
    """The prefix cache's records: each cached page owned by the one entry of its scope, every reader of
    a page inside that page's scope and under a lease, readers and reads mirroring each other."""
    problems = []
    if bad := [(p, f.page_owner.get(p)) for p, salt in sorted(f.scope.items())
               if f.page_owner.get(p) != CACHE_ENTRY_PREFIX + salt]:
        problems.append(f"cached pages not owned by their scope's cache entry (page, owner): {_few(bad)}")
    if unscoped := sorted(p for p, o in f.page_owner.items()
                          if o.startswith(CACHE_ENTRY_PREFIX) and p not in f.scope):
        problems.append(f"pages of a cache entry without a scope: {_few(unscoped)}")
    if stray := sorted(p for p, rs in f.readers.items() if rs and p not in f.scope):
        problems.append(f"readers of pages that are not cached: {_few(stray)}")
    pairs = {(r, p) for p, rs in f.readers.items() for r in rs}
    if pairs != {(r, p) for r, ps in f.reads.items() for p in ps}:
        problems.append(f"readers and reads disagree: {_few(sorted(pairs ^ {(r, p) for r, ps in f.reads.items() for p in ps}))}")
    if outside := sorted((r, p) for r, p in pairs if p in f.scope and f.reader_scope.get(r) != f.scope[p]):
        problems.append(f"reads outside the reader's scope (reader, page): {_few(outside)}")
    if unleased := sorted({r for r, _ in pairs} - f.leases.keys()):
        problems.append(f"readers without a lease: {_few(unleased)}")
    if own := sorted((r, p) for r, p in pairs if f.page_owner.get(p) == r):
        problems.append(f"owners reading their own pages as shared (reader, page): {_few(own)}")
    if idle := sorted(f.reader_scope.keys() - {r for r, _ in pairs}):
        problems.append(f"reader scopes of owners reading nothing: {_few(idle)}")
    return problems


def judge_eviction_policy(policy: str) -> None:
    """Raise LedgerError unless `policy` is noeviction: an evicted ledger key loses pages silently."""
    if policy != "noeviction":
        raise LedgerError(
            f"Redis maxmemory-policy is {policy!r}, so under memory pressure Redis may evict ledger keys and "
            "hand out pages that are in use. Run `redis-cli CONFIG SET maxmemory-policy noeviction` and set "
            "`maxmemory-policy noeviction` in redis.conf so it survives a restart"
        )


def check_eviction_policy(redis_client: redis.Redis) -> None:
    """Read the server's maxmemory-policy and judge it; a server that refuses CONFIG fails too."""
    try:
        reply = redis_client.config_get("maxmemory-policy")
    except ResponseError as e:
        raise LedgerError(
            f"cannot read Redis maxmemory-policy (CONFIG GET refused: {e}). Make sure the server runs with "
            "maxmemory-policy noeviction (managed Redis: set it in the provider's parameter group), or grant "
            "this user CONFIG GET so kvserve can check it"
        ) from None
    judge_eviction_policy(text(reply.get("maxmemory-policy", "")))


"""Fleet reads: what every registered pool holds, read without a RedisLedger per pool (for the web side, the
reaper, /metrics, the tenant budget and the canary)."""
from dataclasses import dataclass
from typing import Sequence

import redis

from inference.ledger.keys import ledger_key, owner_prefix, text
from inference.retry import repeat


def pool_ids(redis_client: redis.Redis, prefix: str = "kvs") -> list[str]:
    """Every pool in the ledger's pools set (registered, its worker live or not), sorted."""
    return sorted(text(p) for p in redis_client.smembers(ledger_key(prefix)))


@dataclass(frozen=True)
class PoolCounts:
    """One pool's page counts, read without touching its pages (for /metrics; check_integrity audits)."""

    pool_id: str
    role: str
    num_pages: int
    used: int
    free: int
    dirty: int
    cached: int = 0  # of `used`: pages held by the prefix cache

    @property
    def lost(self) -> int:
        """Pages in none of the three states (0 while the books balance)."""
        return max(0, self.num_pages - self.used - self.free - self.dirty)


def pool_counts(redis_client: redis.Redis, prefix: str = "kvs") -> list[PoolCounts]:
    """Every registered pool's counts in two round trips and O(1) Redis work per pool, whatever its size:
    one MULTI of HMGET meta, LLEN free, SCARD dirty, HLEN page_owner, HLEN scope per pool, so each pool's
    five numbers come from one instant. A pool retired between the listing and the read is left out."""
    pools = pool_ids(redis_client, prefix)
    if not pools:
        return []
    with redis_client.pipeline(transaction=True) as pipe:
        for pool_id in pools:
            meta, free, dirty, owners, scope = (ledger_key(prefix, pool_id, part) for part in (
                "meta", "free", "dirty", "page_owner", "scope"))
            pipe.hmget(meta, "role", "num_pages").llen(free).scard(dirty).hlen(owners).hlen(scope)
        replies = pipe.execute()
    out = []
    for i, pool_id in enumerate(pools):
        (role, num_pages), free, dirty, used, cached = replies[5 * i: 5 * i + 5]
        if num_pages is not None:
            out.append(PoolCounts(pool_id, text(role), int(num_pages), int(used), int(free), int(dirty), int(cached)))
    return out


def owners_held_tokens(redis_client: redis.Redis, owners: Sequence[str], prefix: str = "kvs") -> dict[str, int]:
    """owner -> tokens of KV its pages hold (pages x page size, summed over every registered pool), for the
    per-tenant budget (inference.tenant_budget). Two round trips: one SCARD per (pool, owner) and one HGET
    of each pool's page size, so O(pools x owners) whatever the pools' sizes; owners holding nothing map to 0.
    Reads only: repeated across a dropped connection (admission calls it; a killed connection must not refuse a
    request)."""
    owners = list(owners)
    return repeat(lambda: _owners_held_tokens(redis_client, owners, prefix), "reading the owners' holdings")


def _owners_held_tokens(redis_client: redis.Redis, owners: list[str], prefix: str) -> dict[str, int]:
    pools = pool_ids(redis_client, prefix) if owners else []
    held = dict.fromkeys(owners, 0)
    if not pools:
        return held
    with redis_client.pipeline(transaction=True) as pipe:
        for pool_id in pools:
            pipe.hget(ledger_key(prefix, pool_id, "meta"), "page_size")
            for owner in owners:
                pipe.scard(owner_prefix(prefix, pool_id) + owner)
        replies = pipe.execute()
    stride = 1 + len(owners)
    for i in range(len(pools)):
        page_size, counts = replies[i * stride], replies[i * stride + 1: (i + 1) * stride]
        if page_size is None:
            continue  # retired between the listing and the read
        for owner, n in zip(owners, counts):
            held[owner] += int(n) * int(page_size)
    return held

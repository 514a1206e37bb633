"""The page ledger in Redis: which owner holds which page of a pool, under which epoch, until when.

This package is the only code that reads or writes the ledger's keys (named in `keys`); every mutation is
one Lua script (`scripts`, with REPEAT: which of them may run again after a dropped connection). `pool`:
one pool's RedisLedger; `fleet`: reads over every pool; `audit`: integrity and the server's eviction policy.
"""
from inference.ledger.audit import check_eviction_policy, judge_eviction_policy
from inference.ledger.fleet import PoolCounts, owners_held_tokens, pool_counts, pool_ids
from inference.ledger.pool import GENERATION_SPAN, ROLES, Beat, ReclaimEvent, RedisLedger, ledger_from_url
from inference.ledger.scripts import REPEAT, Repeat

__all__ = [
    "GENERATION_SPAN", "REPEAT", "ROLES", "Beat", "PoolCounts", "ReclaimEvent", "RedisLedger", "Repeat",
    "check_eviction_policy", "judge_eviction_policy", "ledger_from_url", "owners_held_tokens", "pool_counts",
    "pool_ids",
]

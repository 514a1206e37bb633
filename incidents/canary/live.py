"""The live deployment as the canary sees it: Redis, the worker registry, the ledger's pools, the broker's
queues, output streams. Every name comes from settings, so a test stack's prefixes are honoured."""
import json
from functools import lru_cache

import redis
from django.conf import settings

from inference.allocator import LedgerError
from inference.ledger import RedisLedger, pool_ids as ledger_pool_ids
from inference.registry import SERVING_ROLES, WorkerInfo
from inference.streams import OutputStream
from kvserve.workers import redis_get, registry_get

QUEUES = ("prefill", "decode", "maintenance")


def prefix() -> str:
    return settings.KVSERVE_LEDGER_PREFIX


@lru_cache(maxsize=8)
def _blocking_client(url: str, socket_timeout_s: float) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=socket_timeout_s, health_check_interval=30)


def outputs(block_s: float = 30) -> OutputStream:
    """Output streams on a client whose socket timeout outlasts one blocking read of `block_s`."""
    return OutputStream(_blocking_client(settings.REDIS_URL, block_s + 10), prefix=prefix())


def live_workers(role: str | None = None) -> list[WorkerInfo]:
    return registry_get().live_workers(role)


def serving_workers() -> list[WorkerInfo]:
    return [w for w in live_workers() if w.role in SERVING_ROLES]


def pool_ids() -> list[str]:
    """Every pool in the ledger's pools set (live or not)."""
    return ledger_pool_ids(redis_get(), prefix())


def live_pools() -> dict[str, RedisLedger]:
    """The ledger pools of live workers (a worker's pool id is its worker id)."""
    live = {w.worker_id for w in live_workers()}
    pools = {}
    for pool_id in pool_ids():
        if pool_id in live:
            try:
                pools[pool_id] = RedisLedger(redis_get(), pool_id, prefix=prefix())
            except LedgerError:  # unregistered between the listing and now: its worker just stopped
                continue
    return pools


def broker_queue_key(queue: str) -> str:
    """The broker's list for `queue`: Celery's Redis transport prefixes every key with global_keyprefix."""
    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", {}) or {}
    return f"{options.get('global_keyprefix') or ''}{queue}"


def broker_queue_lengths() -> dict[str, int]:
    r = redis_get()
    return {q: int(r.llen(broker_queue_key(q))) for q in QUEUES}


def broker_messages(queue: str, limit: int = 1000) -> list[dict]:
    """The task messages waiting in `queue` (headers: task name, id, argsrepr), newest first (LPUSH)."""
    out = []
    for raw in redis_get().lrange(broker_queue_key(queue), 0, limit - 1):
        try:
            msg = json.loads(raw)
        except ValueError:
            continue
        headers = msg.get("headers") or {}
        out.append({"task": headers.get("task"), "id": headers.get("id"), "argsrepr": headers.get("argsrepr") or ""})
    return out

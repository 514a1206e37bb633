"""Read-only project-level queries: service health derived from live worker registrations."""
import logging

import redis

from kvserve.workers import registry_get

log = logging.getLogger(__name__)


def health_get() -> dict:
    """Whether the service can serve (a live, unquarantined prefill and decode worker) and the admission
    limit clients must fit (prompt + max_tokens). Nothing else: the detail (workers, hosts, faults,
    quarantine) is for staff at /api/pools/ and for /metrics."""
    try:
        limit = registry_get().effective_limit()
    except redis.RedisError:
        log.warning("/healthz: the worker registry is unreachable", exc_info=True)
        limit = None
    return {"status": "ok" if limit is not None else "unavailable", "effective_context_limit": limit}

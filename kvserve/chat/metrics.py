"""Admission rejections counted in Redis (shared by every web process; rejections write no row), read by /metrics."""
import logging

import redis
from django.conf import settings

from kvserve.workers import redis_get

log = logging.getLogger(__name__)


def _key() -> str:
    return f"{settings.KVSERVE_LEDGER_PREFIX}:metrics:admission_rejections"


def admission_rejection_count_incr(reason: str = "context_length_exceeded") -> None:
    """Call where the API refuses a request at admission. Never raises: a metric must not break admission."""
    try:
        redis_get().hincrby(_key(), reason, 1)
    except redis.RedisError:
        log.warning("could not count an admission rejection (%s)", reason, exc_info=True)


def admission_rejection_counts() -> dict[str, int]:
    """reason -> count since the counter was created (raises redis.RedisError when Redis is down)."""
    raw = redis_get().hgetall(_key())
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}

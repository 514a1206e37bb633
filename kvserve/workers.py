"""Django-side access to Redis-backed engine state: the worker registry and output streams, built from settings."""
import logging
from functools import lru_cache

import redis
from django.conf import settings

from inference.cancel import Cancellations
from inference.registry import Registry
from inference.streams import OutputStream

log = logging.getLogger(__name__)


@lru_cache(maxsize=8)
def redis_client(url: str) -> redis.Redis:
    """The process's client for short commands: a dead or cut-off server answers with an error within
    seconds instead of hanging its caller (blocking reads use clients of their own)."""
    return redis.Redis.from_url(url, health_check_interval=30, socket_timeout=10, socket_connect_timeout=5)


def redis_get() -> redis.Redis:
    return redis_client(settings.REDIS_URL)


def outputs_get():
    return OutputStream(redis_get(), prefix=settings.KVSERVE_LEDGER_PREFIX)


def cancels_get():
    return Cancellations(redis_get(), prefix=settings.KVSERVE_LEDGER_PREFIX)


def registry_get() -> Registry:
    """The registry at settings.REDIS_URL under settings.KVSERVE_LEDGER_PREFIX (read per call: tests override)."""
    return Registry(
        redis_client(settings.REDIS_URL),
        prefix=settings.KVSERVE_LEDGER_PREFIX,
        ttl_s=settings.KVSERVE_REGISTRY_TTL_S,
    )


def metrics_send(batch, what: str) -> None:
    """Sends a batch of metric increments (inference.metrics.Batch) under the deployment's prefix in one round
    trip. Never raises: a metric must not break what it measures."""
    try:
        batch.send(redis_get(), settings.KVSERVE_LEDGER_PREFIX)
    except redis.RedisError:
        log.warning("metrics of %s not recorded: Redis unreachable", what, exc_info=True)

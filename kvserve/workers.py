"""Django-side access to the worker registry: builds inference.registry.Registry from settings."""
from functools import lru_cache

import redis
from django.conf import settings

from inference.registry import Registry


@lru_cache(maxsize=8)
def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def registry_get() -> Registry:
    """The registry at settings.REDIS_URL under settings.KVSERVE_LEDGER_PREFIX (read per call: tests override)."""
    return Registry(
        _client(settings.REDIS_URL),
        prefix=settings.KVSERVE_LEDGER_PREFIX,
        ttl_s=settings.KVSERVE_REGISTRY_TTL_S,
    )

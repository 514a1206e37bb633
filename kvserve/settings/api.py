"""The public chat API's limits: per-key throttle rate, request body cap, output wait, and the cache
(Redis, under the deployment's key prefix) that holds throttle counters for every web process."""
from inference.settings import env_float, env_int, env_parsed
from kvserve.settings.redis import KVSERVE_LEDGER_PREFIX, REDIS_URL


def _throttle_rate(value: str) -> str:
    num, _, period = value.partition("/")
    if value.lower() not in ("off", "none") and not (num.isdigit() and period[:1] in tuple("smhd")):
        raise ValueError("not a rate")
    return value


# DRF rate syntax "<n>/<s|min|hour|day>", counted per API key across all web processes; "off" disables.
KVSERVE_THROTTLE_RATE = env_parsed("KVSERVE_THROTTLE_RATE", "120/min", _throttle_rate, "'<n>/<s|min|hour|day>' or 'off'")
# Bodies above this are refused with 413 before they are read: by the ASGI middleware (kvserve/bodylimit.py)
# from Content-Length, or as soon as a chunked body passes it; Django's own cap is the same number.
KVSERVE_MAX_BODY_BYTES = env_int("KVSERVE_MAX_BODY_BYTES", 1024 * 1024, low=1)
DATA_UPLOAD_MAX_MEMORY_SIZE = KVSERVE_MAX_BODY_BYTES
# max_tokens when a request names neither max_tokens nor max_completion_tokens.
KVSERVE_DEFAULT_MAX_TOKENS = env_int("KVSERVE_DEFAULT_MAX_TOKENS", 256, low=1)
# Longest silence tolerated between a request's output events (queueing included) before it fails with 503.
KVSERVE_RESPONSE_TIMEOUT_S = env_int("KVSERVE_RESPONSE_TIMEOUT_S", 600, low=1)
# SSE comment sent after this much silence so proxies keep an idle stream open.
KVSERVE_SSE_KEEPALIVE_S = env_int("KVSERVE_SSE_KEEPALIVE_S", 15, low=1)
# How long a finished request's output stream (its deltas, in Redis) stays replayable after its final
# event: the replay window for tenants without store_text, the hour for tenants with it.
KVSERVE_STREAM_REPLAY_S = env_int("KVSERVE_STREAM_REPLAY_S", 60, low=1)
KVSERVE_STREAM_RETENTION_S = env_int("KVSERVE_STREAM_RETENTION_S", 3600, low=1)

# Fair share (kvserve/chat/tenant_limits.py), work-conserving: a tenant alone is never refused; while another
# tenant has requests in flight, a tenant over either share gets 429 with Retry-After, at once.
# Per tenant, Tenant.max_in_flight / Tenant.kv_share override these; 0 switches a limit off.
KVSERVE_TENANT_MAX_IN_FLIGHT = env_int("KVSERVE_TENANT_MAX_IN_FLIGHT", 16, low=0)
KVSERVE_TENANT_KV_SHARE = env_float("KVSERVE_TENANT_KV_SHARE", 0.5, low=0, high=1)
KVSERVE_TENANT_RETRY_AFTER_S = env_int("KVSERVE_TENANT_RETRY_AFTER_S", 1, low=1)

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": f"{KVSERVE_LEDGER_PREFIX}:cache",
    }
}

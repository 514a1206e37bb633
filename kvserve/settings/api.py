"""The public chat API's limits: per-key throttle rate, request body cap, output wait, and the cache
(Redis, under the deployment's key prefix) that holds throttle counters for every web process."""
from kvserve.settings.env import env_float, env_int, env_str
from kvserve.settings.redis import KVSERVE_LEDGER_PREFIX, REDIS_URL

# DRF rate syntax "<n>/<s|min|hour|day>", counted per API key across all web processes; "off" disables.
KVSERVE_THROTTLE_RATE = env_str("KVSERVE_THROTTLE_RATE", "120/min")
_num, _, _period = KVSERVE_THROTTLE_RATE.partition("/")
if KVSERVE_THROTTLE_RATE.lower() not in ("", "off", "none") and not (_num.isdigit() and _period[:1] in tuple("smhd")):
    raise ValueError(f"KVSERVE_THROTTLE_RATE={KVSERVE_THROTTLE_RATE!r}: use '<n>/<s|min|hour|day>' or 'off'")
# Bodies above this are refused with 413 before they are read: by the ASGI middleware (kvserve/bodylimit.py)
# from Content-Length, or as soon as a chunked body passes it; Django's own cap is the same number.
KVSERVE_MAX_BODY_BYTES = env_int("KVSERVE_MAX_BODY_BYTES", 1024 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = KVSERVE_MAX_BODY_BYTES
# max_tokens when a request names neither max_tokens nor max_completion_tokens.
KVSERVE_DEFAULT_MAX_TOKENS = env_int("KVSERVE_DEFAULT_MAX_TOKENS", 256)
# Longest silence tolerated between a request's output events (queueing included) before it fails with 503.
KVSERVE_RESPONSE_TIMEOUT_S = env_int("KVSERVE_RESPONSE_TIMEOUT_S", 600)
# SSE comment sent after this much silence so proxies keep an idle stream open.
KVSERVE_SSE_KEEPALIVE_S = env_int("KVSERVE_SSE_KEEPALIVE_S", 15)
# How long a finished request's output stream (its deltas, in Redis) stays replayable after its final
# event: the replay window for tenants without store_text, the hour for tenants with it.
KVSERVE_STREAM_REPLAY_S = env_int("KVSERVE_STREAM_REPLAY_S", 60)
KVSERVE_STREAM_RETENTION_S = env_int("KVSERVE_STREAM_RETENTION_S", 3600)

# Fair share (kvserve/chat/tenant_limits.py), work-conserving: a tenant alone is never refused; while another
# tenant has requests in flight, a tenant over either share gets 429 with Retry-After, at once.
# Per tenant, Tenant.max_in_flight / Tenant.kv_share override these; 0 switches a limit off.
KVSERVE_TENANT_MAX_IN_FLIGHT = env_int("KVSERVE_TENANT_MAX_IN_FLIGHT", 16)
KVSERVE_TENANT_KV_SHARE = env_float("KVSERVE_TENANT_KV_SHARE", 0.5)
if not 0 <= KVSERVE_TENANT_KV_SHARE <= 1 or KVSERVE_TENANT_MAX_IN_FLIGHT < 0:
    raise ValueError("KVSERVE_TENANT_KV_SHARE must be 0..1 and KVSERVE_TENANT_MAX_IN_FLIGHT >= 0")
KVSERVE_TENANT_RETRY_AFTER_S = env_int("KVSERVE_TENANT_RETRY_AFTER_S", 1)

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": f"{KVSERVE_LEDGER_PREFIX}:cache",
    }
}

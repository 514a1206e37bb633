"""Redis: one URL for broker, ledger, transport and pub/sub; the key prefix shared by ledger and registry."""
from inference.settings import env_int, env_str

REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")
KVSERVE_LEDGER_PREFIX = env_str("KVSERVE_LEDGER_PREFIX", "kvs")
# A worker whose heartbeat is older than this drops out of the registry (and out of admission).
KVSERVE_REGISTRY_TTL_S = env_int("KVSERVE_REGISTRY_TTL_S", 15, low=1)

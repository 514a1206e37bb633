"""Redis: one URL for broker, ledger, transport and output streams; the key prefix shared by ledger and registry
(read where the workers read them, inference/settings.py, so web and workers never disagree)."""
from inference.settings import redis_url_setting, runtime_settings

REDIS_URL = redis_url_setting()
_runtime = runtime_settings()
KVSERVE_LEDGER_PREFIX = _runtime["prefix"]
# A worker whose heartbeat is older than this drops out of the registry (and out of admission).
KVSERVE_REGISTRY_TTL_S = _runtime["registry_ttl_s"]

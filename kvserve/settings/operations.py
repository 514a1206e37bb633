"""The operator surfaces' costs: how long one /metrics rendering is served to every scraper."""
from inference.settings import env_float

# Seconds a /metrics rendering is reused (per web process); 0 renders on every scrape.
KVSERVE_METRICS_CACHE_S = env_float("KVSERVE_METRICS_CACHE_S", 1.0, low=0)

# The history beat samples (incidents/history.py): every KVSERVE_HISTORY_SAMPLE_S, kept KVSERVE_HISTORY_RETENTION_S.
KVSERVE_HISTORY_SAMPLE_S = env_float("KVSERVE_HISTORY_SAMPLE_S", 15.0, low=1)
KVSERVE_HISTORY_RETENTION_S = env_float("KVSERVE_HISTORY_RETENTION_S", 86400.0, low=60)

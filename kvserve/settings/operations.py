"""The operator surfaces' costs: how long one /metrics rendering is served to every scraper."""
from inference.settings import env_float

# Seconds a /metrics rendering is reused (per web process); 0 renders on every scrape.
KVSERVE_METRICS_CACHE_S = env_float("KVSERVE_METRICS_CACHE_S", 1.0, low=0)

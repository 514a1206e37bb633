"""kvserve engine knobs read from env for the Django side (the inference package reads its own env too)."""
from kvserve.settings.env import env_int, env_list, env_str

KVSERVE_MODEL = env_str("KVSERVE_MODEL", "")  # empty: the bundled SmolLM2-135M-Instruct GGUF
KVSERVE_WINDOW = env_int("KVSERVE_WINDOW", 8192)  # tokens one request may span (prompt + output)
KVSERVE_PAGE_SIZE = env_int("KVSERVE_PAGE_SIZE", 16)  # tokens per KV page
KVSERVE_NUM_PAGES = env_int("KVSERVE_NUM_PAGES", 1024)  # pages per pool: 16384 tokens >= window
KVSERVE_SCRUB = env_str("KVSERVE_SCRUB", "on_free")  # on_free | on_alloc | off (off only via KVSERVE_FAULTS=no_scrub)
KVSERVE_FAULTS = env_list("KVSERVE_FAULTS", "")  # fault injection; empty in production
KVSERVE_PORT = env_int("KVSERVE_PORT", 8000)

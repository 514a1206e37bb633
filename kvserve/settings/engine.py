"""Engine settings the Django side needs. Window, pool size, page size, scrub policy and faults are the
workers' own (read by inference.engine.EngineConfig.from_env); the web process derives what it
enforces from their live registrations, never from a copy here that could drift."""
from inference.settings import port_setting
from inference.settings_check import settings_validate

settings_validate()  # a malformed engine or runtime setting stops every process at start, this one too
KVSERVE_PORT = port_setting()

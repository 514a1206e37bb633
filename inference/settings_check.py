"""The start-up check of the engine's and runtime's settings (inference/settings.py reads them): every process
runs it, the web from kvserve/settings/engine.py, so a malformed value stops it at start, named. No torch here."""
from inference.faults import Faults
from inference.settings import (attn_isa_setting, engine_settings, int4_rows_setting, port_setting, redis_url_setting,
                                role_setting, runtime_settings, thread_budget_setting, w4a8_rows_setting)


def settings_validate() -> None:
    """Reads the engine's and runtime's settings (no torch: the web process checks them too, from
    kvserve/settings/engine.py): SettingError at the first malformed one."""
    engine_settings()
    runtime_settings()
    role_setting()
    redis_url_setting()
    port_setting()
    thread_budget_setting()
    attn_isa_setting()
    int4_rows_setting()
    w4a8_rows_setting()
    Faults.from_env()

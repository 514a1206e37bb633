"""A worker's start-up check, before its model loads: every engine and runtime setting, and those read where the
model is built (torch threads, attention backend, GEMM, the model file). Called by kvserve/worker_boot.py."""
from inference.attention import backend_wanted
from inference.loader import resolve_model_path
from inference.model import gemm_wanted
from inference.settings import SettingError, model_setting
from inference.settings_check import settings_validate
from inference.threads import torch_threads_for


def worker_settings_validate(role: str | None = None) -> None:
    """settings_validate and the settings read where the model is built (threads, attention, GEMM, the model
    file): called at worker boot, before the model loads."""
    settings_validate()
    torch_threads_for(role)
    backend_wanted()
    gemm_wanted()
    try:
        resolve_model_path()
    except FileNotFoundError as exc:
        raise SettingError("KVSERVE_MODEL", model_setting(), str(exc)) from None

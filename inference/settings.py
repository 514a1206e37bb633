"""Every setting read from the environment, by kvserve's processes (Django's settings modules, the workers'
engine and runtime, scripts): strict parsers that refuse a malformed value with a SettingError naming the
variable and the forms it accepts, and the engine's and runtime's settings read in one place, so that a
process checks them all when it starts (inference/settings_check.py) instead of failing on first use.
No Django here: workers read these before (and without) Django settings."""
import os
from collections.abc import Callable, Mapping

SCRUB_POLICIES = ("on_free", "on_alloc", "off")
DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = ("fp32", "bf16", "fp16w", "int4w", "w4a8", "auto")  # inference.precision.SETTING_CHOICES
KV_DTYPES = ("auto", "float32", "bfloat16", "int8")  # inference.precision.kv_dtype_for
ROLES = ("prefill", "decode")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SettingError(ValueError):
    """A setting's value that cannot be used; the message names the variable and what it accepts."""

    def __init__(self, name: str, value, accepted: str):
        super().__init__(f"{name}={value!r} is not valid: {accepted}")
        self.name = name


def env_raw(name: str, env: Mapping | None = None) -> str | None:
    """The variable's value, None when unset or empty (an empty value means the default)."""
    value = (os.environ if env is None else env).get(name)
    return None if value is None or value.strip() == "" else value


def env_str(name: str, default: str, env: Mapping | None = None) -> str:
    value = env_raw(name, env)
    return default if value is None else value


def _bounded(name, raw: str, value, low, high, kind: str):
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "" if low is None else f" >= {low}"
        hi = "" if high is None else f" <= {high}"
        raise SettingError(name, raw, f"use {kind}{lo}{' and' if lo and hi else ''}{hi}")
    return value


def env_int(name: str, default, *, low: int | None = None, high: int | None = None, env: Mapping | None = None):
    raw = env_raw(name, env)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise SettingError(name, raw, "use a whole number, e.g. 30") from None
    return _bounded(name, raw, value, low, high, "a whole number")


def env_float(name: str, default, *, low: float | None = None, high: float | None = None,
              env: Mapping | None = None):
    raw = env_raw(name, env)
    if raw is None:
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise SettingError(name, raw, "use a number, e.g. 0.5") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise SettingError(name, raw, "use a finite number")
    return _bounded(name, raw, value, low, high, "a number")


def env_bool(name: str, default: bool, env: Mapping | None = None) -> bool:
    raw = env_raw(name, env)
    if raw is None:
        return default
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise SettingError(name, raw, "use 1/0, true/false, yes/no or on/off")


def env_choice(name: str, default: str, choices, env: Mapping | None = None, *, lower: bool = True) -> str:
    raw = env_raw(name, env)
    if raw is None:
        return default
    value = raw.strip().lower() if lower else raw.strip()
    if value not in choices:
        raise SettingError(name, raw, f"use one of {', '.join(choices)} (or unset it)")
    return value


def env_list(name: str, default: str, env: Mapping | None = None) -> list[str]:
    return [item.strip() for item in env_str(name, default, env).split(",") if item.strip()]


def env_parsed(name: str, default: str, parse: Callable, accepted: str, env: Mapping | None = None):
    """`parse(value)`; its ValueError becomes a SettingError naming the variable and `accepted`."""
    raw = env_str(name, default, env)
    try:
        return parse(raw)
    except ValueError as exc:
        raise SettingError(name, raw, f"{exc} (the form: {accepted})") from None


# ---- the engine's and the worker runtime's settings (inference.engine / inference.worker from_env) -------

def engine_settings(env: Mapping | None = None) -> dict:
    """EngineConfig fields from the environment (device None: the engine picks cuda if present, else cpu)."""
    num_pages = env_int("KVSERVE_NUM_PAGES", None, low=1, env=env)
    values = dict(
        num_pages=1024 if num_pages is None else num_pages,
        page_size=env_int("KVSERVE_PAGE_SIZE", 16, low=1, env=env),
        chunk_size=env_int("KVSERVE_CHUNK_SIZE", 512, low=1, env=env),
        max_num_seqs=env_int("KVSERVE_MAX_SEQS", 64, low=1, env=env),
        window=env_int("KVSERVE_WINDOW", None, low=1, env=env),
        scrub_policy=env_choice("KVSERVE_SCRUB", "on_free", SCRUB_POLICIES, env),
        watermark=env_float("KVSERVE_WATERMARK", 0.01, low=0, high=1, env=env),
        probe_reserve_pages=env_int("KVSERVE_PROBE_RESERVE_PAGES", None, low=0, env=env),  # None: the engine's
        dtype=env_choice("KVSERVE_DTYPE", "float32", DTYPES, env),
        precision=env_choice("KVSERVE_PRECISION", "fp32", PRECISIONS, env),  # inference.precision
        kv_dtype=env_choice("KVSERVE_KV_DTYPE", "auto", KV_DTYPES, env),  # inference.precision.kv_dtype_for
        device=env_str("KVSERVE_DEVICE", "", env).strip() or None,
        prefix_cache=env_bool("KVSERVE_PREFIX_CACHE", True, env),
    )
    pool_mb = env_int("KVSERVE_POOL_MB", None, low=1, env=env)
    if pool_mb and num_pages is None:
        values["pool_mb"] = pool_mb
    return values


def runtime_settings(env: Mapping | None = None) -> dict:
    """RuntimeOptions fields from the environment."""
    return dict(
        prefix=env_str("KVSERVE_LEDGER_PREFIX", "kvs", env),
        lease_ttl_s=env_float("KVSERVE_LEASE_TTL_S", 30.0, low=0.1, env=env),
        registry_ttl_s=env_float("KVSERVE_REGISTRY_TTL_S", 15.0, low=0.1, env=env),
        clamp_window=env_bool("KVSERVE_CLAMP_WINDOW", False, env),
        transport_ttl_s=env_int("KVSERVE_TRANSPORT_TTL_S", 300, low=1, env=env),
        loop_stall_s=env_float("KVSERVE_LOOP_STALL_S", 300.0, low=0.1, env=env),
        loop_max_failures=env_int("KVSERVE_LOOP_MAX_FAILURES", 3, low=1, env=env),
    )


def redis_url_setting(env: Mapping | None = None) -> str:
    """REDIS_URL: broker, ledger, registry, transport and output streams (web, workers, bench)."""
    return env_str("REDIS_URL", "redis://127.0.0.1:6379/0", env)


def port_setting(env: Mapping | None = None) -> int:
    """KVSERVE_PORT: the web server's port (`make run`, and the stack's log directory named after it)."""
    return env_int("KVSERVE_PORT", 8000, low=1, high=65535, env=env)


def log_dir_setting(default: str, env: Mapping | None = None) -> str:
    """KVSERVE_LOG_DIR: where a launcher (`make run`) files each process's log; `default` when unset."""
    return env_str("KVSERVE_LOG_DIR", default, env)


def model_setting(env: Mapping | None = None) -> str:
    """KVSERVE_MODEL: a .gguf file or an HF directory; "" for the default model (inference.loader)."""
    return env_str("KVSERVE_MODEL", "", env)


def role_setting(env: Mapping | None = None) -> str | None:
    """KVSERVE_ROLE (prefill or decode), None when unset."""
    return env_choice("KVSERVE_ROLE", "", ROLES, env) or None


def thread_budget_setting(env: Mapping | None = None) -> str:
    """KVSERVE_THREAD_BUDGET: lend (the default: workers on one host lend each other their cores for the native
    kernels), fixed (each keeps its own) or shared (torch's threads move too); bench.cores measures them side by
    side (bench/RESULTS.md)."""
    return env_choice("KVSERVE_THREAD_BUDGET", "lend", ("lend", "shared", "fixed"), env)


def _rows_parsed(name: str, env: Mapping | None) -> int | None:
    def parse(raw: str) -> int | None:
        if raw.strip().lower() == "auto":
            return None
        if not raw.strip().isdigit() or int(raw) < 1:
            raise ValueError("not auto or a whole number >= 1")
        return int(raw)
    return env_parsed(name, "auto", parse, "auto or a row count, e.g. 4", env)


def int4_rows_setting(env: Mapping | None = None) -> int | None:
    """KVSERVE_INT4_ROWS: the most rows precision int4w multiplies with 4-bit codes (bf16 above); None (auto,
    unset): timed at start (inference.precision.int4_max_rows)."""
    return _rows_parsed("KVSERVE_INT4_ROWS", env)


def w4a8_rows_setting(env: Mapping | None = None) -> int | None:
    """KVSERVE_W4A8_ROWS: the most rows precision w4a8 multiplies with the file's blocks (its dense fallback
    above); None (auto, unset): timed at start (inference.precision.w4a8_max_rows)."""
    return _rows_parsed("KVSERVE_W4A8_ROWS", env)


def attn_isa_setting(env: Mapping | None = None) -> str:
    """KVSERVE_ATTN_ISA: which build of the paged-attention loop runs (auto: the best this CPU has)."""
    return env_choice("KVSERVE_ATTN_ISA", "auto", ("auto", "avx512", "avx2", "generic"), env)

"""The worker process's engine runtime, built when a Celery prefill/decode worker starts (kvserve/worker_boot.py,
which passes it the engine's callbacks, kvserve/chat/callbacks.py) and never in the web process."""
import logging
import sys

from django.conf import settings

from inference.logs import log_context_set
from inference.settings import role_setting
from inference.threads import core_budget_for, torch_threads_apply
from inference.worker import RuntimeOptions, WorkerRuntime
from kvserve.secrets import secret_get
from kvserve.workers import redis_client

log = logging.getLogger(__name__)
_runtime = {}


def role_from_argv(argv=None) -> str | None:
    """KVSERVE_ROLE, else the role named by `-Q`/`--queues` (prefill or decode)."""
    if role_setting():
        return role_setting()
    argv = argv or sys.argv
    for i, arg in enumerate(argv):
        value = None
        if arg in ("-Q", "--queues") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--queues="):
            value = arg.split("=", 1)[1]
        elif arg.startswith("-Q") and len(arg) > 2:
            value = arg[2:]
        if value:
            queues = value.split(",")
            for role in ("decode", "prefill"):
                if role in queues:
                    return role
    return None


def handoff_key() -> bytes:
    return secret_get("KVSERVE_HANDOFF_KEY").encode()


def runtime_start(role: str, **overrides):
    """Builds this process's engine runtime; `overrides` (the Celery node, the engine's callbacks) go to
    WorkerRuntime."""
    torch_threads_apply(role)  # before the engine exists: its first ops size their thread pool
    options = RuntimeOptions.from_env()
    runtime = WorkerRuntime(role, redis_client(settings.REDIS_URL), handoff_key(), options=options,
                            cores=core_budget_for(role, options.prefix), **overrides)
    _runtime["current"] = runtime
    log_context_set(worker_id=runtime.worker_id)  # on every later log line of this process
    log.info("worker %s ready: %s", runtime.worker_id, runtime.info().to_dict())
    return runtime


def runtime_get():
    runtime = _runtime.get("current")
    if runtime is None:
        raise RuntimeError("this process runs no engine: start it with `celery -A kvserve worker -Q prefill|decode`")
    return runtime


def runtime_worker_id() -> str | None:
    """This process's engine worker id, or None where no engine runs (web, beat, a maintenance-only worker)."""
    runtime = _runtime.get("current")
    return runtime.worker_id if runtime else None


def runtime_stop() -> None:
    runtime = _runtime.pop("current", None)
    if runtime:
        runtime.stop()

"""The worker process's engine runtime, built when a Celery prefill/decode worker starts (and never
in the web process). Incidents from the engine flow through incidents.services.incident_record."""
import logging
import os
import sys

from django.conf import settings

from inference.logs import log_context_set
from inference.settings import role_setting, worker_settings_validate
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
    from inference.threads import torch_threads_apply
    from inference.worker import WorkerRuntime

    torch_threads_apply(role)  # before the engine exists: its first ops size their thread pool

    from kvserve.chat.services import (runtime_on_lease_lost, runtime_on_quarantine, runtime_on_reclaim,
                                       runtime_on_violation)

    runtime = WorkerRuntime(role, redis_client(settings.REDIS_URL), handoff_key(), node=_runtime.get("hostname", ""),
                            on_violation=runtime_on_violation, on_reclaim=runtime_on_reclaim,
                            on_lease_lost=runtime_on_lease_lost, on_quarantine=runtime_on_quarantine, **overrides)
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


def consumer_toggle(role: str, active: bool) -> None:
    """Stops (quarantine) or resumes this worker's consumption of its role's queue."""
    from kvserve.celery import app

    hostname = _runtime.get("hostname")
    if not hostname:
        return
    if active:
        app.control.add_consumer(role, destination=[hostname])
        log.warning("worker %s released from quarantine: consuming %s again", hostname, role)
    else:
        app.control.cancel_consumer(role, destination=[hostname])
        log.error("worker %s quarantined: stopped consuming %s", hostname, role)


def worker_started(hostname: str) -> None:
    """Celery worker_init hook: builds the engine for prefill/decode workers; refuses to start (exit 3) on a
    malformed setting (checked before the model loads, naming the variable), an unsafe pool or a configuration
    the engine refuses (e.g. KVSERVE_SCRUB=off without the no_scrub fault).
    Celery logs and swallows a hook's exceptions, which would leave a worker consuming without an engine."""
    from inference.worker import WindowTooLarge

    role = role_from_argv()
    if role not in ("prefill", "decode"):
        return
    log_context_set(role=role)
    _runtime["hostname"] = hostname
    try:
        worker_settings_validate(role)
        runtime_start(role)
    except (WindowTooLarge, ValueError) as exc:
        log.critical("refusing to start the %s worker: %s", role, exc)
        print(f"kvserve: refusing to start the {role} worker: {exc}", file=sys.stderr, flush=True)
        os._exit(3)

"""The composition root of a worker process (and beat): imported at start by every Celery worker, after
django.setup() (CELERY_IMPORTS, kvserve/settings/celery.py). It wires what kvserve/celery.py only configures:
the kombu hooks, the probe lane's consumer step, the engine runtime built at worker_init with the engine's
callbacks (incidents, kvserve/chat/callbacks.py; quarantine, the consumer toggle here) and stopped at
worker_shutdown, and the broker deliveries noted for the reaper (kvserve/deliveries.py)."""
import logging
import os
import sys

import django
import redis
from celery.signals import task_postrun, worker_init, worker_shutdown
from kombu.transport import redis as kombu_redis

from inference.logs import log_context_set
from inference.worker import WindowTooLarge
from inference.worker_settings import worker_settings_validate
from kvserve.celery import app
from kvserve.chat.callbacks import runtime_on_lease_lost, runtime_on_reclaim, runtime_on_violation
from kvserve.chat.runtime import role_from_argv, runtime_start, runtime_stop, runtime_worker_id
from kvserve.deliveries import delivery_done, delivery_note, worker_node_note
from kvserve.probe_lane import ProbeLane

log = logging.getLogger(__name__)
_node = {}  # this process's Celery node name, once worker_init named it (an engine worker only)


# ---- kombu hooks -----------------------------------------------------------------------------

def _survive_broker_restarts() -> None:
    """celery 5.7 / kombu 5.7: after the Redis connection drops, the old channel still restores its unacked
    messages on close and acks the tasks that finish afterwards, through a connection that is already
    gone; that raises AttributeError, which is no connection error, so Celery calls it unrecoverable and the
    worker process exits on every Redis restart. Raised as the connection error it is, kombu logs it and
    the consumer reconnects. The messages involved come back by the visibility timeout (or were lost with
    Redis), and a second delivery of a task is harmless here (claims are exclusive)."""
    connparams = kombu_redis.Channel._connparams

    def _connparams(self, *args, **kwargs):
        if self.connection is None or self.connection.client is None:
            raise redis.ConnectionError("this broker channel's connection is closed")
        return connparams(self, *args, **kwargs)

    kombu_redis.Channel._connparams = _connparams


# Deliveries an engine worker holds (kvserve/deliveries.py): the reaper puts them back when the worker is gone.
def _note_deliveries() -> None:
    """Notes each message as kombu records it unacked (QoS.append, when the consumer takes it off the queue),
    not at Celery's task_received, which comes later on a busy worker: a worker killed in between would
    leave a message no one puts back."""
    append = kombu_redis.QoS.append

    def _append(self, message, delivery_tag):
        append(self, message, delivery_tag)
        worker_id, task_id = runtime_worker_id(), (message.headers or {}).get("id")
        if worker_id and task_id:
            delivery_note(worker_id, task_id, delivery_tag)

    kombu_redis.QoS.append = _append


_survive_broker_restarts()
_note_deliveries()
app.steps["consumer"].add(ProbeLane)  # canary probes reach a busy worker on a lane of their own


# ---- the engine runtime ----------------------------------------------------------------------

def consumer_toggle(role: str, active: bool) -> None:
    """Stops (quarantine) or resumes this worker's consumption of its role's queue."""
    hostname = _node.get("hostname")
    if not hostname:
        return
    if active:
        app.control.add_consumer(role, destination=[hostname])
        log.warning("worker %s released from quarantine: consuming %s again", hostname, role)
    else:
        app.control.cancel_consumer(role, destination=[hostname])
        log.error("worker %s quarantined: stopped consuming %s", hostname, role)


def runtime_on_quarantine(runtime, quarantined: bool) -> None:
    consumer_toggle(runtime.role, active=not quarantined)


def worker_started(hostname: str) -> None:
    """Celery worker_init hook: builds the engine for prefill/decode workers; refuses to start (exit 3) on a
    malformed setting (checked before the model loads, naming the variable), an unsafe pool or a configuration
    the engine refuses (e.g. KVSERVE_SCRUB=off without the no_scrub fault).
    Celery logs and swallows a hook's exceptions, which would leave a worker consuming without an engine."""
    role = role_from_argv()
    if role not in ("prefill", "decode"):
        return
    log_context_set(role=role)  # on every later log line of this process
    _node["hostname"] = hostname
    try:
        worker_settings_validate(role)
        runtime_start(role, node=hostname, on_violation=runtime_on_violation, on_reclaim=runtime_on_reclaim,
                      on_lease_lost=runtime_on_lease_lost, on_quarantine=runtime_on_quarantine)
    except (WindowTooLarge, ValueError) as exc:
        log.critical("refusing to start the %s worker: %s", role, exc)
        print(f"kvserve: refusing to start the {role} worker: {exc}", file=sys.stderr, flush=True)
        os._exit(3)


# ---- Celery signals --------------------------------------------------------------------------

@worker_init.connect
def _engine_start(sender=None, **_):
    django.setup()
    hostname = getattr(sender, "hostname", None) or ""
    worker_started(hostname)
    if runtime_worker_id() and hostname:
        worker_node_note(runtime_worker_id(), hostname)


@worker_shutdown.connect
def _engine_stop(**_):
    runtime_stop()


@task_postrun.connect
def _delivery_ran(task_id=None, **_):
    worker_id = runtime_worker_id()
    if worker_id and task_id:
        delivery_done(worker_id, task_id)

"""The Celery app: configured from Django settings (CELERY_*), tasks autodiscovered from installed apps.

Deliveries are idempotent and redelivery is bounded. With acks_late + reject_on_worker_lost a task whose
worker dies is put back on its queue, and a broker may deliver a task twice. Every inference task takes
only a request id, and its service claims the ChatRequest row in one conditional UPDATE that also counts
the delivery (kvserve/chat/services.py): a row another live delivery holds is not claimed (the copy
returns), a prefill whose worker is gone may run again, and past settings.KVSERVE_TASK_MAX_DELIVERIES the
service marks the request failed (fail closed, client gets an error) without touching the engine.
Queues and routes: kvserve/settings/celery.py (inference.prefill* -> prefill, inference.decode* -> decode).
"""
import os

from celery import Celery
from celery.signals import setup_logging

from kvserve.logs import celery_logging_keep

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvserve.settings")


def _survive_broker_restarts() -> None:
    """celery 5.7 / kombu 5.7: after the Redis connection drops, the old channel still restores its unacked
    messages on close and acks the tasks that finish afterwards, through a connection that is already
    gone; that raises AttributeError, which is no connection error, so Celery calls it unrecoverable and the
    worker process exits on every Redis restart. Raised as the connection error it is, kombu logs it and
    the consumer reconnects. The messages involved come back by the visibility timeout (or were lost with
    Redis), and a second delivery of a task is harmless here (claims are exclusive)."""
    import redis
    from kombu.transport import redis as kombu_redis

    connparams = kombu_redis.Channel._connparams

    def _connparams(self, *args, **kwargs):
        if self.connection is None or self.connection.client is None:
            raise redis.ConnectionError("this broker channel's connection is closed")
        return connparams(self, *args, **kwargs)

    kombu_redis.Channel._connparams = _connparams


_survive_broker_restarts()

app = Celery("kvserve")
app.config_from_object("django.conf:settings", namespace="CELERY")
setup_logging.connect(celery_logging_keep)  # workers and beat log as settings.LOGGING says
app.autodiscover_tasks()  # <app>/tasks.py of every installed Django app
app.autodiscover_tasks(["inference"])  # inference/tasks.py, when the engine provides one

from kvserve.probe_lane import ProbeLane  # noqa: E402

app.steps["consumer"].add(ProbeLane)  # canary probes reach a busy worker on a lane of their own

from celery.signals import task_postrun, worker_init, worker_shutdown  # noqa: E402


@worker_init.connect
def _engine_start(sender=None, **_):
    import django

    django.setup()
    from kvserve.chat.runtime import runtime_worker_id, worker_started
    from kvserve.deliveries import worker_node_note

    hostname = getattr(sender, "hostname", None) or ""
    worker_started(hostname)
    if runtime_worker_id() and hostname:
        worker_node_note(runtime_worker_id(), hostname)


@worker_shutdown.connect
def _engine_stop(**_):
    from kvserve.chat.runtime import runtime_stop

    runtime_stop()


# Deliveries an engine worker holds (kvserve/deliveries.py): the reaper puts them back when the worker is gone.
def _note_deliveries() -> None:
    """Notes each message as kombu records it unacked (QoS.append, when the consumer takes it off the queue),
    not at Celery's task_received, which comes later on a busy worker: a worker killed in between would
    leave a message no one puts back."""
    from kombu.transport import redis as kombu_redis

    append = kombu_redis.QoS.append

    def _append(self, message, delivery_tag):
        append(self, message, delivery_tag)
        from kvserve.chat.runtime import runtime_worker_id

        worker_id, task_id = runtime_worker_id(), (message.headers or {}).get("id")
        if worker_id and task_id:
            from kvserve.deliveries import delivery_note

            delivery_note(worker_id, task_id, delivery_tag)

    kombu_redis.QoS.append = _append


_note_deliveries()


@task_postrun.connect
def _delivery_ran(task_id=None, **_):
    from kvserve.chat.runtime import runtime_worker_id
    from kvserve.deliveries import delivery_done

    worker_id = runtime_worker_id()
    if worker_id and task_id:
        delivery_done(worker_id, task_id)

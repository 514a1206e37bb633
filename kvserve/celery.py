"""The Celery app: configured from Django settings (CELERY_*), tasks autodiscovered from installed apps.

Redelivery is bounded. With acks_late + reject_on_worker_lost a task whose worker dies is put back
on its queue, so a poison request could kill workers forever. Every inference task therefore takes
only a request id, and its service first increments a delivery counter on the ChatRequest row in the
same transaction that claims it; past settings.KVSERVE_TASK_MAX_DELIVERIES the service marks the
request failed (fail closed, client gets an error) and the task returns without touching the engine.
Queues and routes: kvserve/settings/celery.py (inference.prefill* -> prefill, inference.decode* -> decode).
"""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvserve.settings")

app = Celery("kvserve")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()  # <app>/tasks.py of every installed Django app
app.autodiscover_tasks(["inference"])  # inference/tasks.py, when the engine provides one

from celery.signals import worker_init, worker_shutdown  # noqa: E402


@worker_init.connect
def _engine_start(sender=None, **_):
    import django

    django.setup()
    from kvserve.chat.runtime import worker_started

    worker_started(getattr(sender, "hostname", None) or "")


@worker_shutdown.connect
def _engine_stop(**_):
    from kvserve.chat.runtime import runtime_stop

    runtime_stop()

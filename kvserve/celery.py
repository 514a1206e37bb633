"""The Celery app: configured from Django settings (CELERY_*, kvserve/settings/celery.py), tasks autodiscovered
from installed apps (kvserve/chat/tasks.py, incidents/tasks.py). Configuration only: what a worker process does
at start and stop (signal handlers, kombu hooks, the engine runtime, the probe lane) is kvserve/worker_boot.py,
which the worker imports at start (CELERY_IMPORTS). Tasks are sent by name from kvserve/dispatch.py.

Deliveries are idempotent and redelivery is bounded. With acks_late + reject_on_worker_lost a task whose
worker dies is put back on its queue, and a broker may deliver a task twice. An inference task carries a
request id and what its stage needs (prefill: the prompt's token ids; decode: also the handoff), and its
service claims the ChatRequest row in one conditional UPDATE that also counts the delivery
(kvserve/chat/services.py): a row another live delivery holds is not claimed (the copy returns), a prefill
whose worker is gone may run again, and past settings.KVSERVE_TASK_MAX_DELIVERIES the service marks the
request failed (fail closed, client gets an error) without touching the engine.
Queues and routes: kvserve/settings/celery.py (inference.prefill* -> prefill, inference.decode* -> decode).
"""
import os

from celery import Celery
from celery.signals import setup_logging

from kvserve.logs import celery_logging_keep

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvserve.settings")

app = Celery("kvserve")
app.config_from_object("django.conf:settings", namespace="CELERY")
setup_logging.connect(celery_logging_keep)  # workers and beat log as settings.LOGGING says
app.autodiscover_tasks()  # <app>/tasks.py of every installed Django app

"""Celery (namespace CELERY_): Redis broker, prefill/decode queues, late acks, beat from the database."""
from kombu import Queue

from inference.settings import env_int, env_str
from kvserve.settings.redis import REDIS_URL

CELERY_BROKER_URL = REDIS_URL
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A task not acked within this many seconds is redelivered: keep it above the longest task.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env_int("KVSERVE_VISIBILITY_TIMEOUT_S", 3600, low=1),
    # lets two stacks (or a test run) share one Redis database without sharing queues
    "global_keyprefix": env_str("KVSERVE_BROKER_PREFIX", ""),
}
CELERY_TASK_IGNORE_RESULT = True  # results live in ChatRequest rows and the SSE stream
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]  # never pickle
# What a worker (and beat) process wires at start, imported after django.setup(): signal handlers, kombu hooks,
# the engine runtime, the probe lane (kvserve/worker_boot.py). The web process never imports it.
CELERY_IMPORTS = ("kvserve.worker_boot",)

CELERY_TASK_QUEUES = (Queue("prefill"), Queue("decode"), Queue("maintenance"))
CELERY_TASK_DEFAULT_QUEUE = "maintenance"
CELERY_TASK_ROUTES = {
    "inference.prefill*": {"queue": "prefill"},
    "inference.decode*": {"queue": "decode"},
    "kvserve.*": {"queue": "maintenance"},  # reaper, canaries: consumed by the prefill worker in `make run`
}
# One engine per process; its requests arrive on threads and share the engine's continuous batch.
CELERY_WORKER_POOL = "threads"
CELERY_WORKER_CONCURRENCY = env_int("KVSERVE_WORKER_CONCURRENCY", 64, low=1)

CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# every worker also consumes its own direct queue ({node}.dq2): prefix-affinity routing reaches one process
CELERY_WORKER_DIRECT = True
# the canary's live probes reach one engine process through its probe lane (kvserve/probe_lane.py): threads of
# their own beside the CELERY_WORKER_CONCURRENCY ones, so a worker whose every thread is busy is still probed
KVSERVE_PROBE_LANE_THREADS = env_int("KVSERVE_PROBE_LANE_THREADS", 2)
if KVSERVE_PROBE_LANE_THREADS < 1:
    raise ValueError(f"KVSERVE_PROBE_LANE_THREADS={KVSERVE_PROBE_LANE_THREADS}: set it to 1 or more (default 2)")
# acks_late + reject_on_worker_lost redeliver a task whose worker died, forever if it keeps
# killing workers. Tasks bound that: see kvserve/celery.py ("Redelivery is bounded").
KVSERVE_TASK_MAX_DELIVERIES = env_int("KVSERVE_TASK_MAX_DELIVERIES", 3, low=1)
# A request no worker has taken (queued, or prefilled and waiting for decode) this long is failed
# `queue_timeout` by the reaper: its task message was lost (Redis restarted, the web process died before
# queueing it) or nothing consumes the queue.
KVSERVE_QUEUE_TIMEOUT_S = env_int("KVSERVE_QUEUE_TIMEOUT_S", 600, low=1)
# A request still queued and never claimed this long is sent once more by the reaper (kvserve/deliveries.py):
# its message may have been handed to a worker that died before recording it.
KVSERVE_REQUEUE_AFTER_S = env_int("KVSERVE_REQUEUE_AFTER_S", 60, low=1)
# How often beat runs the reaper (`manage.py setup_schedules` creates the schedule with this interval).
KVSERVE_REAPER_INTERVAL_S = env_int("KVSERVE_REAPER_INTERVAL_S", 30, low=1)

CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_TIMEZONE = "UTC"
# Canaries (`manage.py setup_schedules` creates the schedule; incidents/canary/): how long the marker test
# waits for its traffic, and how long the scheduled run's lock keeps a second run from overlapping it
# (longer than the longest run: six checks at their bound).
KVSERVE_CANARY_TIMEOUT_S = env_int("KVSERVE_CANARY_TIMEOUT_S", 300, low=1)
# Every check of a run is bounded by this (a check still running then fails, named); a run by the sum.
KVSERVE_CANARY_CHECK_TIMEOUT_S = env_int("KVSERVE_CANARY_CHECK_TIMEOUT_S", KVSERVE_CANARY_TIMEOUT_S + 60, low=1)
KVSERVE_CANARY_LOCK_S = env_int("KVSERVE_CANARY_LOCK_S", 6 * KVSERVE_CANARY_CHECK_TIMEOUT_S + 60, low=1)

"""Sends every task of the project by name (Celery's send_task, routed by kvserve/settings/celery.py as the
task objects' apply_async would be): services, the reaper and the canary send through here and never import
a tasks module. Owns the task names and the probe queues' naming."""
from django.conf import settings
from kombu import Connection, Exchange, Queue

from kvserve.celery import app

PREFILL = "inference.prefill"  # kvserve/chat/tasks.py
DECODE = "inference.decode"
REAP = "kvserve.reap"
CANARY = "kvserve.canary"  # incidents/tasks.py
HISTORY = "kvserve.history_sample"  # incidents/tasks.py
PROBE = "kvserve.probe"

PROBE_EXCHANGE = Exchange("kvserve.probes", type="direct")


def probe_queue(node: str) -> Queue:
    """The probe queue of Celery node `node` (a worker's registered `node`)."""
    return Queue(f"{node}.probes", PROBE_EXCHANGE, routing_key=node)


def _send(name: str, args: tuple, **options):
    """Task `name` with `args`, its result ignored (as every task declares); options left None are not passed."""
    return app.send_task(name, args=args, ignore_result=True, **{k: v for k, v in options.items() if v is not None})


def prefill_send(request_id: str, prompt_ids: list[int], *, queue=None, producer=None):
    """A request's prefill: to `queue` (a worker's direct queue), else routed to the shared `prefill` queue."""
    return _send(PREFILL, (request_id, prompt_ids), queue=queue, producer=producer)


def decode_send(request_id: str, prompt_ids: list[int], handoff: dict, *, queue=None):
    """A prefilled request's decode, with its handoff: routed to `decode` unless `queue` (a probe queue) is given."""
    return _send(DECODE, (request_id, prompt_ids, handoff), queue=queue)


def probe_send(name: str, probe_id: str, *, node: str):
    """A canary live probe (`guard`, `scrub`) to the probe queue of Celery node `node`."""
    return _send(PROBE, (name, probe_id), queue=probe_queue(node))


def prefill_task_requeue(request_id: str, prompt_ids: list[int], producer=None) -> None:
    """Sends a request's prefill task to the shared prefill queue (claims are exclusive: a copy is harmless)."""
    if producer is not None:
        return prefill_send(request_id, prompt_ids, queue="prefill", producer=producer)
    with Connection(settings.CELERY_BROKER_URL, transport_options=settings.CELERY_BROKER_TRANSPORT_OPTIONS) as conn:
        prefill_send(request_id, prompt_ids, queue="prefill", producer=conn.Producer())

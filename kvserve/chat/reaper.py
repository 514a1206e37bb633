"""Orphan reaping (the `kvserve.reap` task, run by beat every KVSERVE_REAPER_INTERVAL_S): fails the requests whose
worker is gone or that waited in a queue too long (through chat_request_fail), sends an unclaimed stage (prefill,
or a prefilled request's decode) once more, puts back what a gone worker had received, and retires the pools of
workers gone long enough."""
import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from inference.allocator import LedgerError
from inference.handoff import Verdict
from inference.ledger import RedisLedger, pool_ids
from kvserve.chat.callbacks import record_safely
from kvserve.chat.models import ChatRequest
from kvserve.chat.services import chat_request_fail
from kvserve.deliveries import deliveries_restore, handed_requeue, queued_requeue
from kvserve.incident_hooks import incident_report
from kvserve.workers import redis_get, registry_get

log = logging.getLogger(__name__)
Status = ChatRequest.Status

# A worker is judged gone only when it is not registered AND did not beat at all between two reaper rounds
# (Registry.silence): a registration that lapsed on Redis' clock, or a worker paused for less than a reaper
# interval, is not enough. The reaper never marks a page clean: only a pool's own worker scrubs. It retires
# (deletes) the pool of a worker gone for POOL_RETIRE_ROUNDS rounds; if that worker was alive after all,
# its next heartbeat finds the pool missing and it scrubs its whole tensor before registering again.
# The task messages a gone worker had received (prefetched or running) go back on their queues at once
# (kvserve/deliveries.py) instead of after the broker's visibility timeout.
WORKER_LOST_ROUNDS = 1
POOL_RETIRE_ROUNDS = 3


def requests_reap_orphans() -> dict:
    """Fails requests whose worker is gone or that waited in a queue past KVSERVE_QUEUE_TIMEOUT_S, and retires
    the pools of workers gone long enough. Returns what it did."""
    registry, redis_client = registry_get(), redis_get()
    prefix = settings.KVSERVE_LEDGER_PREFIX
    live = {w.worker_id for w in registry.live_workers()}
    rows = list(ChatRequest.objects.exclude(status__in=ChatRequest.FINAL))
    pools = pool_ids(redis_client, prefix)
    holders = {row.id: _holder(row) for row in rows}
    silence = registry.silence(live | set(pools) | {w for w in holders.values() if w})
    gone = {w for w, rounds in silence.items() if w not in live and rounds >= WORKER_LOST_ROUNDS}
    failed, timed_out, requeued = [], [], []
    restored = {w: ids for w in sorted(gone) if (ids := deliveries_restore(w))}
    waited_since = timezone.now() - timedelta(seconds=settings.KVSERVE_QUEUE_TIMEOUT_S)
    unclaimed_since = timezone.now() - timedelta(seconds=settings.KVSERVE_REQUEUE_AFTER_S)
    for row in rows:
        worker = holders[row.id]
        if worker in gone:
            if chat_request_fail(row, code="worker_lost", message=f"{row.status} worker {worker} stopped "
                                 f"responding; the request did not complete"):
                failed.append(row.id)
        elif (row.status == Status.QUEUED and not row.prefill_deliveries and row.created_at < unclaimed_since
              and row.created_at >= waited_since and queued_requeue(row.id)):
            requeued.append(row.id)
        elif (row.status == Status.PREFILLING and row.handoff_verdict == Verdict.OK.value and not row.decode_deliveries
              and row.prefill_finished_at and waited_since <= row.prefill_finished_at < unclaimed_since
              and handed_requeue(row.id)):
            requeued.append(row.id)
        elif worker is None and (row.prefill_finished_at or row.created_at) < waited_since:
            if chat_request_fail(row, code="queue_timeout", message=f"no worker took the request within "
                                 f"{settings.KVSERVE_QUEUE_TIMEOUT_S}s (its task was lost or the queue is stuck)"):
                timed_out.append(row.id)
    report = []
    for pool_id in pools:
        entry = {"pool": pool_id, "live": pool_id in live, "silent_rounds": silence.get(pool_id, 0)}
        if pool_id not in live and silence.get(pool_id, 0) >= POOL_RETIRE_ROUNDS:
            entry.update(_retire(registry, redis_client, prefix, pool_id))
        report.append(entry)
    return {"failed_requests": failed, "timed_out_requests": timed_out, "restored_tasks": restored,
            "requeued_requests": requeued, "pools": report}


def _holder(row: ChatRequest) -> str | None:
    """The worker a request waits on, or None while it waits in a queue (queued, or prefilled for decode)."""
    if row.status == Status.DECODING:
        return row.decode_worker or None
    if row.status == Status.PREFILLING and row.handoff_verdict != Verdict.OK.value:
        return row.prefill_worker or None
    return None


def _retire(registry, redis_client, prefix: str, pool_id: str) -> dict:
    try:
        ledger = RedisLedger(redis_client, pool_id, prefix=prefix)
    except LedgerError as exc:
        return {"retired": False, "integrity": str(exc)}
    try:
        ledger.check_integrity()
        integrity = "ok"
    except LedgerError as exc:  # recorded, not acted on: the pool is deleted either way
        integrity = str(exc)
        record_safely(lambda: incident_report(kind="integrity", severity="warning", pool=pool_id,
                                              detected_by="periodic reaper (retiring a gone worker's pool)",
                                              details={"error": integrity}))
    ledger.unregister()
    registry.forget(pool_id)
    log.warning("retired the pool of gone worker %s (integrity: %s)", pool_id, integrity)
    return {"retired": True, "integrity": integrity}

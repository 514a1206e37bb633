"""Writes for incidents. `incident_record` is the ONE way anything records an incident (kvserve reports through
kvserve/incident_hooks.py, where incidents/apps.py installs it); a critical incident on a worker quarantines that
worker in the registry until an admin calls `worker_release`.
"""
import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeout

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from incidents.models import Incident, WorkerRelease
from inference.metrics import Batch
from inference.probes import ProbeRecords
from kvserve.chat.runtime import runtime_get
from kvserve.workers import metrics_send, redis_get, registry_get

log = logging.getLogger(__name__)


def incident_record(
    *,
    kind: str,
    severity: str,
    pool: str = "",
    worker: str = "",
    pages: list[int] | None = None,
    reader_request: str = "",
    previous_owner_request: str = "",
    epochs: list | dict | None = None,
    detected_by: str,
    details: dict | None = None,
) -> Incident:
    """Records one incident; a critical one on a worker quarantines it. Ids of any length are accepted:
    a value longer than its column is clipped there and kept whole in details["full_ids"]."""
    ids = {"pool": pool, "worker": worker, "reader_request": reader_request,
           "previous_owner_request": previous_owner_request, "detected_by": detected_by}
    clipped, full = {}, {}
    for name, value in ids.items():
        value, limit = str(value or ""), Incident._meta.get_field(name).max_length
        clipped[name] = value if len(value) <= limit else value[: limit - 1] + "…"
        if len(value) > limit:
            full[name] = value
    incident = Incident(
        kind=Incident.Kind(kind),
        severity=Incident.Severity(severity),
        pages=[int(p) for p in (pages or [])],
        epochs=epochs if epochs is not None else [],
        details={**(details or {}), **({"full_ids": full} if full else {})},
        **clipped,
    )
    incident.full_clean()
    incident.save()
    metrics_send(Batch().inc("incidents", kind=incident.kind, severity=incident.severity), f"incident #{incident.pk}")
    log.error(
        "INCIDENT #%s %s %s pool=%s worker=%s pages=%s reader=%s previous_owner=%s detected_by=%s",
        incident.pk, incident.severity, incident.kind, pool, worker, incident.pages,
        reader_request, previous_owner_request, detected_by,
    )
    if incident.severity == Incident.Severity.CRITICAL and incident.worker:
        _quarantine(incident, full.get("worker", incident.worker))
    return incident


def _quarantine(incident: Incident, worker_id: str) -> None:
    # Not deferred to on_commit: the quarantine must hold even if the caller's transaction rolls back.
    try:
        registry_get().quarantine(worker_id, reason=f"incident #{incident.pk}: {incident.kind}")
    except Exception as exc:  # the incident row must survive; the failure is recorded on it, loudly
        log.critical("could not quarantine worker %s for incident #%s", worker_id, incident.pk, exc_info=True)
        incident.details = {**incident.details, "quarantine_error": repr(exc)}
        incident.save(update_fields=["details"])
        return
    incident.quarantined = True
    incident.save(update_fields=["quarantined"])
    log.critical("worker %s QUARANTINED for incident #%s", worker_id, incident.pk)


def incident_acknowledge(*, incident: Incident, by_user) -> Incident:
    if incident.acknowledged_at is None:
        incident.acknowledged_by, incident.acknowledged_at = by_user, timezone.now()
        incident.save(update_fields=["acknowledged_by", "acknowledged_at"])
    return incident


@transaction.atomic
def incident_resolve(*, incident: Incident, by_user, notes: str = "") -> Incident:
    """Marks the incident resolved (acknowledging it too if needed). Does not release the worker."""
    incident_acknowledge(incident=incident, by_user=by_user)
    if incident.resolved_at is None:
        incident.resolved_by, incident.resolved_at = by_user, timezone.now()
        counted = Batch().inc("incidents_resolved", kind=incident.kind, severity=incident.severity)
        transaction.on_commit(lambda: metrics_send(counted, f"the resolution of incident #{incident.pk}"))
    if notes:
        incident.notes = f"{incident.notes}\n{notes}".strip()
    incident.save(update_fields=["resolved_by", "resolved_at", "notes"])
    return incident


def worker_release(worker_id: str, by_user, *, notes: str = "") -> WorkerRelease:
    """Lifts a worker's quarantine and logs who did it as a WorkerRelease row."""
    registry = registry_get()
    reason = registry.quarantine_reason(worker_id) or ""
    was_quarantined = registry.release(worker_id)
    release = WorkerRelease.objects.create(
        worker=worker_id,
        released_by=by_user,
        was_quarantined=was_quarantined,
        quarantine_reason=reason,
        notes=notes,
    )
    log.warning("worker %s released from quarantine by %s (was quarantined: %s, reason: %s)",
                worker_id, by_user, was_quarantined, reason)
    return release


def probe_record(probe_id: str, record: dict) -> None:
    """Stores what a live probe found (inference.probes.ProbeRecords), for the canary that sent it."""
    ProbeRecords(redis_get(), settings.KVSERVE_LEDGER_PREFIX).put(probe_id, record)


def probe_run(name: str, probe_id: str) -> None:
    """Runs canary probe `name` in this worker process's engine and stores its result, naming the worker."""
    runtime = runtime_get()
    try:
        result = runtime.probe(name)
    except FutureTimeout:
        result = {"ok": False, "reason": "timed out: the engine loop did not run the probe in time"}
    except Exception as exc:  # no answer to the probe's question: not judged (incidents/canary/probes.py)
        log.exception("canary probe %s failed in this worker", name)
        result = {"ok": False, "reason": f"error: the probe raised {type(exc).__name__}: {exc}"}
    probe_record(probe_id, {"probe": name, "worker": runtime.worker_id, "role": runtime.role,
                            "thread": threading.current_thread().name, **result})

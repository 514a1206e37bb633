"""What the worker side reports to the incidents app, through kvserve's hook point (kvserve/incident_hooks.py):
the engine's callbacks (a read-guard violation, leases reclaimed or lost) and a handoff decode refused."""
import logging
import threading

from inference.handoff import HandoffRefused
from inference.probes import CANARY_PROBE_PREFIX
from kvserve.incident_hooks import incident_report, probe_report

log = logging.getLogger(__name__)


def record_safely(record, *args) -> None:
    """Runs `record(*args)`; its failure is logged, never raised (the request already ended, failed closed)."""
    try:
        record(*args)
    except Exception:
        log.exception("could not record an incident (the request already failed closed)")


def handoff_refusal_record(runtime, req, refused: HandoffRefused, handoff: dict) -> None:
    """A handoff decode refused: the canary's probe record for a canary-probe request, else an incident when
    the refusal is one (a forged, mismatching or stale handoff)."""
    if req.id.startswith(CANARY_PROBE_PREFIX):  # the canary's handoff probe: its record, not an incident
        return probe_report(req.id, {"probe": "handoff", "worker": runtime.worker_id, "request": req.id,
                                     "refused": refused.kind, "reason": refused.reason[:500],
                                     "thread": threading.current_thread().name})
    if not refused.is_incident or refused.kind == "kv_missing":
        return
    kind = refused.kind if refused.kind in ("handoff_forged", "handoff_mismatch", "stale_epoch") else "handoff_mismatch"
    incident_report(
        kind=kind, severity="critical", pool=runtime.worker_id,
        # a forged handoff names no trustworthy worker; a mismatching one points at its prefill worker
        worker="" if kind == "handoff_forged" else str(handoff.get("prefill_worker", "")),
        reader_request=req.id, detected_by="decode handoff verification",
        epochs=list(handoff.get("page_epochs", []))[:64] if isinstance(handoff.get("page_epochs"), list) else None,
        details={"reason": refused.reason, "verdict": str(handoff.get("verdict")),
                 "expected_tokens": handoff.get("expected_tokens"), "transferred_tokens": handoff.get("transferred_tokens")},
    )


# ---- engine callbacks (run in worker threads; kvserve/worker_boot.py passes them to the runtime) -----------

def runtime_on_violation(runtime, violation) -> None:
    incident_report(kind=violation.kind, severity="critical", pool=violation.pool, worker=runtime.worker_id,
                    pages=[violation.page], reader_request=violation.reader,
                    previous_owner_request=violation.page_owner or "",
                    epochs={"reader": violation.reader_epoch, "page": violation.page_epoch},
                    detected_by="ownership guard (before attention)", details=violation.to_dict())


def runtime_on_reclaim(runtime, events) -> None:
    for ev in events:
        incident_report(kind="lease_expired", severity="warning", pool=ev.pool_id, worker=runtime.worker_id,
                        pages=list(ev.pages), previous_owner_request=ev.owner, epochs=list(ev.epochs),
                        detected_by="lease reaper (worker heartbeat)", details={"expired_at_ms": ev.expired_at_ms})


def runtime_on_lease_lost(runtime, request_id: str, pages: list[int]) -> None:
    """A request that was still running lost its lease: a warning (a timeout is not a violation)."""
    incident_report(kind="lease_expired", severity="warning", pool=runtime.worker_id, worker=runtime.worker_id,
                    pages=pages, reader_request=request_id, detected_by="worker lease check",
                    details={"outcome": "the request failed with lease_lost; its pages were scrubbed by its worker"})

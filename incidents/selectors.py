"""Reads for the dashboard and /api/pools/: latest canary run, open incidents, and the whole overview."""
import time

import redis
from django.urls import reverse

from incidents.canary.result import outcome_of_run, outcome_stored
from incidents.models import CanaryRun, Incident
from incidents.pools import pool_state_list
from kvserve.workers import registry_get


def _per_worker(details) -> dict:
    """{worker: {probe: outcome}} for a check whose details list live probes per worker (live_probes)."""
    workers = details.get("workers") if isinstance(details, dict) else None
    if not isinstance(workers, dict):
        return {}
    return {w: {name: outcome_stored({"outcome": r.get("outcome"), "passed": r.get("ok")})
                for name, r in v["checks"].items() if isinstance(r, dict)}
            for w, v in workers.items() if isinstance(v, dict) and isinstance(v.get("checks"), dict)}


def canary_latest_get() -> dict | None:
    run = CanaryRun.objects.first()  # ordered newest first
    if run is None:
        return None
    stored = [c for c in (run.checks or []) if isinstance(c, dict)]
    checks = [{"name": str(c.get("name", "?")), "passed": bool(c.get("passed")), "outcome": outcome_stored(c),
               "duration_s": c.get("duration_s"), "details": c.get("details", {}),
               "per_worker": _per_worker(c.get("details", {}))} for c in stored]
    return {"id": run.pk, "url": reverse("canary-run", args=[run.pk]), "started_at": run.started_at.isoformat(),
            "finished_at": run.finished_at.isoformat() if run.finished_at else None,
            "passed": run.passed, "outcome": outcome_of_run(stored), "checks": checks}


def _canary_url(incident: Incident) -> str | None:
    """The page of the canary run that raised the incident (its details name the run), else None."""
    run = incident.details.get("canary_run") if isinstance(incident.details, dict) else None
    return reverse("canary-run", args=[run]) if isinstance(run, int) else None


def incident_open_list(limit: int = 50) -> list[dict]:
    """Unresolved incidents, newest first."""
    return [{"id": i.pk, "created_at": i.created_at.isoformat(), "severity": i.severity, "kind": i.kind,
             "pool": i.pool, "worker": i.worker, "pages": i.pages[:32], "reader_request": i.reader_request,
             "previous_owner_request": i.previous_owner_request, "detected_by": i.detected_by,
             "quarantined": i.quarantined, "acknowledged": i.acknowledged_at is not None,
             "admin_url": reverse("admin:incidents_incident_change", args=[i.pk]),
             "canary_url": _canary_url(i)}
            for i in Incident.objects.filter(resolved_at__isnull=True)[:limit]]


def dashboard_get(*, user) -> dict:
    """Everything the dashboard shows; "error" is set (and workers empty) when Redis cannot be read."""
    body = {"generated_at": time.time(), "served_window": None, "workers": [],
            "page_maps": {}, "effective_context_limit": None, "latest_canary": canary_latest_get(),
            "open_incidents": incident_open_list(), "open_incidents_total":
                Incident.objects.filter(resolved_at__isnull=True).count()}
    try:
        body["workers"], body["page_maps"] = pool_state_list(user=user)
        registry = registry_get()
        body["effective_context_limit"] = registry.effective_limit()
        body["served_window"] = registry.served_window()
    except redis.RedisError as exc:
        body["error"] = f"Redis unreachable ({exc.__class__.__name__}): live worker and pool state unavailable"
    return body

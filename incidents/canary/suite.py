"""The canary suite: runs the checks, stores one CanaryRun, and turns every failed check into incidents
(a critical one on a live worker quarantines it, through incident_record). Each check ends passed, wrong
(critical incidents) or not judged (warnings only, never a quarantine): incidents/canary/result.py. `manage.py canary` and the
scheduled task `kvserve.canary` both call `canary_run`.

Every check runs in a thread of its own, bounded by KVSERVE_CANARY_CHECK_TIMEOUT_S: a check that has not
returned by then fails, named ("did not finish within ..."), the run goes on to the next check and is
stored. A canary that can hang is a detector that goes silent."""
import logging
import threading
import time
import uuid

from django import db
from django.conf import settings
from django.utils import timezone

from incidents.canary.handoff_contract import check_handoff_contract
from incidents.canary.integrity import check_integrity, check_worker_config
from incidents.canary.marker import check_marker
from incidents.canary.probes import check_live_probes
from incidents.canary.prefix_scope import check_prefix_scope
from incidents.canary.reproduction import check_reproduction
from incidents.canary.result import LABEL, NOT_JUDGED, CheckResult, IncidentSpec, outcome_of_run
from incidents.canary.selftest import check_selftest
from incidents.models import CanaryRun, Incident
from incidents.services import incident_record
from inference.metrics import Batch
from kvserve.workers import metrics_send, registry_get

log = logging.getLogger(__name__)

# run in this order: the traffic-free checks first, the marker's traffic before integrity looks at the books
CHECKS = {
    "live_probes": check_live_probes,
    "worker_config": check_worker_config,
    "handoff_contract": check_handoff_contract,
    "reproduction": check_reproduction,
    "marker": check_marker,
    "prefix_scope": check_prefix_scope,
    "integrity": check_integrity,
    "selftest": check_selftest,
}


def select_checks(only=None, skip=None) -> list[str]:
    names = list(only) if only else list(CHECKS)
    unknown = sorted((set(names) | set(skip or ())) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown canary checks {unknown}; known: {list(CHECKS)}")
    return [n for n in CHECKS if n in names and n not in set(skip or ())]


def _failed(name: str, reason: str) -> CheckResult:
    """A check that could not run, or not finish, has not passed; its incident is a warning on no worker."""
    return CheckResult(name, False, details={"reason": reason}, incidents=[IncidentSpec(
        kind="canary_leak", severity="warning", details={"reason": f"vacuous: check {name}: {reason}"})])


def _run_check(name: str, fn, timeout_s: float) -> CheckResult:
    started = time.perf_counter()
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = fn()
        except Exception as exc:
            log.exception("canary check %s raised", name)
            outcome["result"] = _failed(name, f"the check raised {type(exc).__name__}: {exc}")
        finally:
            db.connections.close_all()  # this thread's own connections

    thread = threading.Thread(target=run, name=f"canary-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "result" in outcome:
        result = outcome["result"]
    else:  # left running: it holds nothing the next check needs, and ends with its own deadlines
        log.error("canary check %s did not finish within %.0fs", name, timeout_s)
        result = _failed(name, f"the check did not finish within {timeout_s:.0f}s")
    result.name = name
    result.duration_s = time.perf_counter() - started
    return result


def _open_duplicate(spec: IncidentSpec, detected_by: str) -> Incident | None:
    """An incident this one would repeat: a condition that persists (a broken worker that stays quarantined,
    a canary that still cannot see) would otherwise collect one incident per run, every 5 minutes."""
    same = Incident.objects.filter(kind=spec.kind, severity=spec.severity, worker=spec.worker, detected_by=detected_by,
                                   resolved_at__isnull=True)
    if spec.severity == "critical":
        # still quarantined: nobody released it; once released, a new failure is a new incident (and quarantine)
        return same.first() if spec.worker and registry_get().is_quarantined(spec.worker) else None
    return same.filter(acknowledged_at__isnull=True).first()


def _record(result: CheckResult, run: CanaryRun) -> list[int]:
    """Records the failed check's incidents (or names the open ones they repeat); their ids."""
    ids = []
    detected_by = f"canary {result.name}"
    for spec in result.incidents:
        duplicate = _open_duplicate(spec, detected_by)
        if duplicate is not None:
            ids.append(duplicate.pk)
            continue
        incident = incident_record(
            kind=spec.kind, severity=spec.severity, pool=spec.pool, worker=spec.worker, pages=spec.pages,
            reader_request=spec.reader_request, previous_owner_request=spec.previous_owner_request,
            epochs=spec.epochs, detected_by=detected_by,
            details={**spec.details, "canary_run": run.pk, "check": result.name})
        ids.append(incident.pk)
    return ids


def _result_counts(result: CheckResult, batch: Batch) -> None:
    """kvserve_canary_checks_total: the check as a whole (worker ""), and each worker it covered (the workers
    or pools its details list) or blamed (its incidents name), by outcome (incidents/canary/result.py)."""
    batch.inc("canary_checks", check=result.name, worker="", result=result.outcome)
    covered = {w for part in ("workers", "pools") if isinstance(result.details.get(part), dict)
               for w in result.details[part]}
    blamed = {spec.worker for spec in result.incidents if spec.worker}
    for worker in sorted(covered | blamed):
        batch.inc("canary_checks", check=result.name, worker=worker, result=result.outcome_for(worker))


def canary_run(only=None, skip=None, checks: dict | None = None, check_timeout_s: float | None = None) -> CanaryRun:
    """Runs the selected checks now, each bounded by `check_timeout_s` (KVSERVE_CANARY_CHECK_TIMEOUT_S);
    returns the stored CanaryRun (passed only if every check passed)."""
    table = CHECKS if checks is None else checks  # `checks`: tests and callers with their own table
    timeout_s = check_timeout_s or settings.KVSERVE_CANARY_CHECK_TIMEOUT_S
    names = select_checks(only, skip) if checks is None else list(checks)
    run = CanaryRun.objects.create(started_at=timezone.now(), passed=False, checks=[])
    tag = uuid.uuid4().hex[:8]
    log.info("canary run #%s (%s) starting: %s", run.pk, tag, names)
    results, counts = [], Batch()
    for name in names:
        result = _run_check(name, table[name], timeout_s)
        _result_counts(result, counts)
        if not result.passed:
            result.details["incidents"] = _record(result, run)
        results.append(result)
        run.checks = [r.to_dict() for r in results]
        run.save(update_fields=["checks"])  # progress is visible while the run goes on
        log.log(logging.INFO if result.passed else logging.WARNING if result.outcome == NOT_JUDGED else logging.ERROR,
                "canary check %s %s in %.1fs%s", name, LABEL[result.outcome], result.duration_s,
                "" if result.passed else f": {result.details.get('reason') or result.details.get('problems')}")
    run.passed = bool(results) and all(r.passed for r in results)
    run.finished_at = timezone.now()
    run.save(update_fields=["passed", "finished_at"])
    metrics_send(counts.inc("canary_runs", result=outcome_of_run(run.checks)), f"canary run #{run.pk}")
    return run

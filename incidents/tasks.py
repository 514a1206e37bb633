"""The scheduled canary (`kvserve.canary`) and history sampler (`kvserve.history_sample`), routed to the maintenance
queue by the `kvserve.*` route."""
import logging
import uuid

from celery import shared_task
from django.conf import settings

from incidents.canary.suite import canary_run
from incidents.history import history_sample
from incidents.services import probe_run
from kvserve.dispatch import CANARY, HISTORY, PROBE
from kvserve.workers import redis_get

log = logging.getLogger(__name__)
_UNLOCK = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


@shared_task(name=CANARY, ignore_result=True)
def canary(only: list[str] | None = None, skip: list[str] | None = None) -> dict | None:
    """One canary run (all checks, or `only`/`skip` as in `manage.py canary`), unless one is still going:
    runs never overlap (the lock outlives the slowest run)."""
    r = redis_get()
    key, token = f"{settings.KVSERVE_LEDGER_PREFIX}:canary:lock", uuid.uuid4().hex
    if not r.set(key, token, nx=True, ex=settings.KVSERVE_CANARY_LOCK_S):
        log.warning("canary: the previous run is still going; skipping this one")
        return None
    try:
        run = canary_run(only, skip)
        return {"id": run.pk, "passed": run.passed}
    finally:
        r.eval(_UNLOCK, 1, key, token)


@shared_task(name=PROBE, ignore_result=True)
def probe(name: str, probe_id: str) -> None:
    """A canary live probe, sent to one worker's probe queue (kvserve/probe_lane.py): runs in its engine loop."""
    probe_run(name, probe_id)


@shared_task(name=HISTORY, ignore_result=True)
def history() -> dict | None:
    """One sample of the service and pool series (incidents/history.py); None when this interval has one."""
    sample = history_sample()
    return None if sample is None else {"ts": sample.ts}

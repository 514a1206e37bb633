"""Checks on the live pools and workers that need no traffic: ledger integrity of every live pool, and
every live worker's registered configuration (no fault injection, scrubbing on, window <= pool)."""
import time

from inference.allocator import LedgerError
from incidents.canary import live
from incidents.canary.result import CheckResult, IncidentSpec


def check_integrity() -> CheckResult:
    """`check_integrity()` on every pool of the ledger's pools set whose worker is live."""
    started = time.perf_counter()
    all_pools = live.pool_ids()
    pools = live.live_pools()
    if not pools:
        return CheckResult.vacuous("integrity", "no live worker has a ledger pool", pools_set=all_pools)
    report, incidents = {}, []
    for pool_id, ledger in pools.items():
        try:
            ledger.check_integrity()
            report[pool_id] = {"ok": True, "free": ledger.num_free(), "pages": ledger.num_pages}
        except LedgerError as exc:
            report[pool_id] = {"ok": False, "error": str(exc)}
            incidents.append(IncidentSpec(kind="integrity", worker=pool_id, pool=pool_id,
                                          details={"error": str(exc)}))
    skipped = [p for p in all_pools if p not in pools]
    return CheckResult("integrity", not incidents, time.perf_counter() - started,
                       {"pools": report, "not_live": skipped}, incidents)


def worker_problems(w) -> list[str]:
    problems = [f"fault injection active: {name}" for name in sorted(w.faults)]
    if w.scrub_policy == "off":
        problems.append("freed pages are not scrubbed (scrub policy off)")
    if w.window > w.capacity_tokens:
        problems.append(f"window {w.window} > pool capacity {w.capacity_tokens} tokens")
    return problems


def check_worker_config() -> CheckResult:
    """Every live serving worker is registered safe: no KVSERVE_FAULTS, scrubbing on, window <= pool
    (invariants 4 and 5). A guard switched off on a live worker is only visible here: nothing else
    can make a correct deployment leak on purpose."""
    started = time.perf_counter()
    workers = live.serving_workers()
    roles = {w.role for w in workers}
    if not {"prefill", "decode"} <= roles:
        return CheckResult.vacuous("worker_config", f"live serving roles are {sorted(roles)}; need prefill and decode")
    report, incidents = {}, []
    for w in workers:
        problems = worker_problems(w)
        report[w.worker_id] = {"role": w.role, "faults": list(w.faults), "scrub_policy": w.scrub_policy,
                               "window": w.window, "capacity_tokens": w.capacity_tokens, "problems": problems}
        if problems:
            incidents.append(IncidentSpec(kind="config_unsafe", worker=w.worker_id, pool=w.worker_id,
                                          details={"problems": problems, "faults": list(w.faults), "role": w.role}))
    return CheckResult("worker_config", not incidents, time.perf_counter() - started, {"workers": report}, incidents)

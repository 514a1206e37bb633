"""Live pool state for the dashboard, /api/pools/ and the Workers admin page: registry + ledger snapshot per worker."""
import time

from django.conf import settings
from redis.exceptions import ResponseError

from incidents.history import pool_history_get
from inference.allocator import LedgerError
from inference.choices import SCOPE_PREFIX, request_of
from inference.ledger import RedisLedger
from kvserve.chat.models import ChatRequest
from kvserve.chat.salt import scope_owners
from kvserve.workers import redis_get, registry_get

# page-map cell codes; a positive code is the owning request's tenant id
FREE, DIRTY, LOST, OTHER = 0, -1, -2, -3


def _tenants_of(owners: set[str]) -> dict[str, tuple[int, str]]:
    rows = ChatRequest.objects.filter(id__in=owners).values_list("id", "tenant_id", "tenant__name")
    return {rid: (tenant_id, name) for rid, tenant_id, name in rows}


def page_map_get(snapshot: dict, *, show_names: bool) -> dict:
    """One cell per page (FREE, DIRTY, LOST, OTHER or the owner's tenant id) and a legend of the owners; a
    prefix-cache page counts for the tenant whose scope it is in (legend `cached`).

    Tenant names (and request ids) only when show_names (superusers); others see "tenant #n".
    """
    owners = {request_of(state["owner"]) for state in snapshot.values() if isinstance(state, dict) and "scope" not in state}
    owners |= {request_of(r) for state in snapshot.values() if isinstance(state, dict)  # n choices' shared prompt
               and str(state.get("scope", "")).startswith(SCOPE_PREFIX) for r in state.get("readers") or ()}
    tenants = _tenants_of(owners)
    scopes = scope_owners() if any(isinstance(s, dict) and "scope" in s for s in snapshot.values()) else {}
    cells, legend = [], {}
    for page in sorted(snapshot):
        state = snapshot[page]
        if not isinstance(state, dict):
            cells.append({"free": FREE, "dirty": DIRTY}.get(state, LOST))
            continue
        cached = "scope" in state  # a prefix-cache page: its owner is its scope's cache entry
        if cached and state["scope"].startswith(SCOPE_PREFIX):  # one request's shared prompt: its readers' tenant
            readers = [request_of(r) for r in state.get("readers") or ()]
            tenant_id, name = next((tenants[r] for r in readers if r in tenants),
                                   (OTHER, "the shared prompt of a request's choices"))
        elif cached:
            tenant_id, name = scopes.get(state["scope"], (None, "a scope narrowed by user"))
            tenant_id, name = (OTHER, f"prefix cache ({name})") if tenant_id is None else (tenant_id, name)
        else:
            tenant_id, name = tenants.get(request_of(state["owner"]), (OTHER, "not a chat request"))
        label = name if tenant_id == OTHER or show_names else f"tenant #{tenant_id}"
        entry = legend.setdefault(tenant_id, {"code": tenant_id, "label": label, "pages": 0, "cached": 0,
                                              "requests": set()})
        entry["pages"] += 1
        if cached:
            entry["cached"] += 1
        else:
            entry["requests"].add(request_of(state["owner"]))
        cells.append(tenant_id)
    for entry in legend.values():
        requests = sorted(entry.pop("requests"))
        entry["num_requests"] = len(requests)
        if show_names:
            entry["request_ids"] = requests[:20]
    return {"cells": cells, "legend": sorted(legend.values(), key=lambda e: -e["pages"])}


def page_counts(snapshot: dict) -> dict:
    """Pages by state: used (owned), free, dirty (awaiting scrub), lost (books do not balance)."""
    states = [("used" if isinstance(s, dict) else s) for s in snapshot.values()]
    return {k: states.count(k) for k in ("used", "free", "dirty", "lost")}


def pool_state_list(*, user) -> tuple[list[dict], dict[str, dict]]:
    """(workers, page_maps by worker id) for every live worker, with its last hour of utilization samples (taken
    by the history beat, incidents/history.py: reading samples nothing)."""
    redis, registry, prefix = redis_get(), registry_get(), settings.KVSERVE_LEDGER_PREFIX
    now = time.time()
    workers, page_maps = [], {}
    for w in sorted(registry.live_workers(), key=lambda w: (w.role != "prefill", w.worker_id)):
        row = {
            "id": w.worker_id, "role": w.role, "host": w.host, "pid": w.pid,
            "capacity_tokens": w.capacity_tokens, "window": w.window, "safe": w.capacity_tokens >= w.window,
            "num_pages": w.num_pages, "page_size": w.page_size, "used": None, "free": None, "dirty": None,
            "lost": None, "utilization": None, "faults": list(w.faults), "quarantined": w.quarantined,
            "quarantine_reason": registry.quarantine_reason(w.worker_id) if w.quarantined else None,
            "heartbeat": w.heartbeat_at, "heartbeat_age_s": round(max(0.0, now - w.heartbeat_at), 1),
            "device": w.device, "dtype": w.dtype, "scrub_policy": w.scrub_policy, "history": [],
            "precision": w.precision, "pool_mb": None if w.pool_bytes is None else round(w.pool_bytes / 2**20, 1),
        }
        try:
            snapshot = RedisLedger(redis, w.worker_id, prefix=prefix).snapshot()
        except (LedgerError, ResponseError) as exc:
            row["ledger_error"] = str(exc)
        else:
            counts = page_counts(snapshot)
            row.update(counts, num_pages=len(snapshot),
                       utilization=round(counts["used"] / len(snapshot), 4) if snapshot else 0.0)
            page_maps[w.worker_id] = page_map_get(snapshot, show_names=bool(user and user.is_superuser))
        row["history"] = pool_history_get(redis, prefix, w.worker_id, now, 3600)
        workers.append(row)
    return workers, page_maps


def worker_admin_list() -> list[dict]:
    """Live workers plus quarantined workers that are no longer live (their quarantine outlives them)."""
    registry = registry_get()
    rows = [{"id": w.worker_id, "role": w.role, "host": w.host, "live": True,
             "capacity_tokens": w.capacity_tokens, "window": w.window, "safe": w.capacity_tokens >= w.window,
             "faults": list(w.faults), "quarantined": w.quarantined,
             "quarantine_reason": registry.quarantine_reason(w.worker_id) if w.quarantined else None}
            for w in sorted(registry.live_workers(), key=lambda w: (w.role, w.worker_id))]
    live = {r["id"] for r in rows}
    for worker_id in registry.quarantined_ids():
        if worker_id not in live:
            rows.append({"id": worker_id, "role": "", "host": "", "live": False, "capacity_tokens": None,
                         "window": None, "safe": None, "faults": [], "quarantined": True,
                         "quarantine_reason": registry.quarantine_reason(worker_id)})
    return rows

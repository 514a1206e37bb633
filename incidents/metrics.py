"""Prometheus exposition for /metrics, rendered at most once per KVSERVE_METRICS_CACHE_S in this process however
many scrapers ask. Live state comes from Redis: pool page counts (four O(1) counts per pool in one MULTI, never a
page scan), the worker registry and each live worker's gauges (one MGET), the broker's queue lengths, and the
deployment-wide counters and histograms every process adds to (inference.metrics: one HGETALL per family). The
database adds only indexed reads: requests in flight, the owners of pages held (by primary key), the latest
canary run. So a rendering costs the same after a million requests as after one.

Tenants appear as their ids (`tenant="7"`), never their names: /metrics is read by monitoring, not only staff."""
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable

import redis
from django.conf import settings
from django.db import DatabaseError
from django.db.models import Count
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from incidents.canary.live import broker_queue_lengths
from incidents.canary.result import OUTCOMES, outcome_stored
from incidents.models import CanaryRun
from inference import metrics as aggregated
from inference.block_manager import VIOLATION_KINDS
from inference.ledger import pool_counts
from inference.tenant_budget import LIMITS as TENANT_LIMITS
from kvserve.chat.models import ChatRequest
from kvserve.chat.throttling import RATE_LIMITED
from kvserve.chat.selectors import model_get
from kvserve.workers import redis_get, registry_get

log = logging.getLogger(__name__)
PAGE_STATES = ("used", "free", "dirty", "lost")
ROLES = ("prefill", "decode")
SEVERITIES = ("critical", "warning")
IN_FLIGHT = (ChatRequest.Status.QUEUED, ChatRequest.Status.PREFILLING, ChatRequest.Status.DECODING)


def _gauge(name, doc, labels, rows):
    g = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in rows:
        g.add_metric(list(values), value)
    return g


# ---- Redis: pools, workers, queues, the aggregated families -----------------------------------------------

def pool_families(scrape: dict):
    pages = GaugeMetricFamily("kvserve_pool_pages", "KV pages per pool by state (used, free, dirty, lost)",
                              labels=["pool", "role", "state"])
    usage = GaugeMetricFamily("kvserve_kv_cache_usage_perc", "Fraction of the pool's KV pages in use (1 = full)",
                              labels=["model_name", "pool", "role"])
    cached = GaugeMetricFamily("kvserve_pool_prefix_cached_pages", "Of a pool's used pages, those held by the "
                               "prefix cache (evicted on demand)", labels=["pool", "role"])
    for c in pool_counts(redis_get(), settings.KVSERVE_LEDGER_PREFIX):
        for state in PAGE_STATES:
            pages.add_metric([c.pool_id, c.role, state], getattr(c, state))
        usage.add_metric([scrape["model_name"], c.pool_id, c.role], c.used / c.num_pages if c.num_pages else 0.0)
        cached.add_metric([c.pool_id, c.role], c.cached)
    yield pages
    yield usage
    yield cached


def worker_families(scrape: dict):
    registry = registry_get()
    workers = registry.live_workers()
    yield _gauge("kvserve_worker_capacity_tokens", "Tokens the worker's page pool holds", ["worker", "role"],
                 [((w.worker_id, w.role), w.capacity_tokens) for w in workers])
    yield _gauge("kvserve_worker_window_tokens", "Context window the worker serves", ["worker", "role"],
                 [((w.worker_id, w.role), w.window) for w in workers])
    yield _gauge("kvserve_worker_quarantined", "1 while the worker is quarantined", ["worker", "role"],
                 [((w.worker_id, w.role), int(w.quarantined)) for w in workers])
    live = dict.fromkeys(ROLES, 0)
    for w in workers:
        live[w.role] = live.get(w.role, 0) + 1
    yield _gauge("kvserve_workers_live", "Live (registered, heartbeating) workers per role; 0 is an outage of that "
                 "role", ["role"], [((role,), n) for role, n in live.items()])
    yield _gauge("kvserve_cache_config_info", "The KV cache of each live worker (vLLM's cache_config_info): pages "
                 "(num_gpu_blocks), tokens per page (block_size), element type (cache_dtype)",
                 ["worker", "role", "block_size", "num_gpu_blocks", "cache_dtype"],
                 [((w.worker_id, w.role, str(w.page_size), str(w.num_pages), str(w.dtype)), 1) for w in workers])
    yield _gauge("kvserve_worker_kv_pool_bytes", "Bytes of KV the worker's page pool holds (pages x layers x K,V x "
                 "page size x kv heads x head dim x the element's size: a bf16 pool half an fp32 one's)",
                 ["worker", "role"], [((w.worker_id, w.role), w.pool_bytes) for w in workers if w.pool_bytes])
    yield _gauge("kvserve_precision_info", "The matmul precision each live worker runs (inference.precision: "
                 "fp32, bf16, fp16w, int4w, w4a8)", ["worker", "role", "mode"],
                 [((w.worker_id, w.role, w.precision), 1) for w in workers])
    limit = registry.effective_limit()
    yield _gauge("kvserve_effective_context_limit_tokens",
                 "Admission limit (prompt + max_tokens); 0 when no prefill and decode worker can serve", [],
                 [((), limit or 0)])
    gauges = aggregated.worker_gauges_read(redis_get(), settings.KVSERVE_LEDGER_PREFIX, [w.worker_id for w in workers])
    scrape["pages"] = {w: g.get("pages", {}) for w, g in gauges.items()}
    m = scrape["model_name"]
    rows = [(w, g) for w, g in gauges.items() if g]
    yield _gauge("kvserve_num_requests_running", "Requests in the worker's engine batch (prefilling or decoding)",
                 ["model_name", "worker", "role"], [((m, w, g["role"]), g["running"]) for w, g in rows])
    yield _gauge("kvserve_num_requests_waiting", "Requests taken by the worker but waiting for pages",
                 ["model_name", "worker", "role"], [((m, w, g["role"]), g["waiting"]) for w, g in rows])


def queue_families(scrape: dict):
    yield _gauge("kvserve_queue_tasks", "Tasks waiting in the broker's queue for a worker", ["queue"],
                 [((q,), n) for q, n in broker_queue_lengths().items()])


def aggregated_families(scrape: dict):
    raw = aggregated.families_read(redis_get(), settings.KVSERVE_LEDGER_PREFIX)
    m = scrape["model_name"]
    defaults = {"admission_rejections": [{"reason": r} for r in ("context_length_exceeded", *TENANT_LIMITS,
                                                                    RATE_LIMITED)],
                # at 0 from the start: Prometheus' increase() never counts a series' first sample, so a violation
                # counter born at 1 would never alert
                "guard_violations": [{"model_name": m, "role": r, "kind": k} for r in ROLES for k in VIOLATION_KINDS],
                **{name: [{"model_name": m}] for name, f in aggregated.FAMILIES.items() if f.labels == ("model_name",)}}
    yield from aggregated.families_render(raw, defaults)
    open_by = dict.fromkeys(SEVERITIES, 0.0)  # both severities always: an alert on 0 -> 1 needs the 0
    for name, sign in (("incidents", 1.0), ("incidents_resolved", -1.0)):
        for labels, value in raw[name].items():
            severity = json.loads(labels)[1]  # ("kind", "severity")
            open_by[severity] = open_by.get(severity, 0.0) + sign * float(value)
    yield _gauge("kvserve_incidents_open", "Incidents recorded and not (yet) resolved, by severity", ["severity"],
                 [((severity,), max(0.0, n)) for severity, n in sorted(open_by.items())])


# ---- the database: indexed reads only ------------------------------------------------------------------

def request_families(scrape: dict):
    rows = ChatRequest.objects.filter(status__in=IN_FLIGHT).values("status").annotate(n=Count("pk")).order_by()
    counts = dict.fromkeys(IN_FLIGHT, 0)
    counts.update({row["status"]: row["n"] for row in rows})  # through the status index: in-flight rows only
    yield _gauge("kvserve_requests_in_flight", "Admitted requests not yet finished, by status", ["status"],
                 [((s,), n) for s, n in counts.items()])


def tenant_page_families(scrape: dict):
    """Pages held per tenant per pool, from the workers' gauges; tenants by id."""
    held = scrape.get("pages") or {}
    owners = {rid for pages in held.values() for rid in pages}
    tenants = dict(ChatRequest.objects.filter(id__in=owners).values_list("id", "tenant_id")) if owners else {}
    totals: dict[tuple[str, str], int] = {}
    for pool, pages in held.items():
        for rid, n in pages.items():
            key = (pool, str(tenants.get(rid, "none")))
            totals[key] = totals.get(key, 0) + int(n)
    yield _gauge("kvserve_kv_pages_held", "KV pages held per pool per tenant (tenant id; \"none\": not a chat "
                 "request, e.g. a canary probe)", ["model_name", "pool", "tenant"],
                 [((scrape["model_name"], pool, tenant), n) for (pool, tenant), n in sorted(totals.items())])


def canary_families(scrape: dict):
    run = CanaryRun.objects.first()  # the started_at index
    checks = [c for c in (run.checks or []) if isinstance(c, dict) and "name" in c] if run else []
    yield _gauge("kvserve_canary_check_passed", "1 when the check passed in the latest canary run", ["check"],
                 [((str(c["name"]),), int(bool(c.get("passed")))) for c in checks])
    yield _gauge("kvserve_canary_check_outcome", "1 for the outcome of each check in the latest canary run "
                 "(passed; wrong: critical; not_judged: busy, unreachable, timed out, vacuous)", ["check", "outcome"],
                 [((str(c["name"]), outcome), int(outcome_stored(c) == outcome)) for c in checks for outcome in OUTCOMES])
    yield _gauge("kvserve_canary_check_duration_seconds", "Duration of each check in the latest canary run",
                 ["check"], [((str(c["name"]),), float(c["duration_s"])) for c in checks
                             if isinstance(c.get("duration_s"), (int, float))])
    yield _gauge("kvserve_canary_last_run_timestamp_seconds", "Start of the latest canary run (Unix time); 0 when "
                 "none ever ran, so that an alert on its age fires before the first run too", [],
                 [((), run.started_at.timestamp() if run else 0.0)])
    yield _gauge("kvserve_canary_last_run_passed", "1 when the latest canary run passed", [],
                 [((), int(run.passed))] if run else [])


# (backend, the exception that means it is down, family sources). Add a family by adding a source to its
# backend; a backend that fails leaves all of its families out of the scrape and reports kvserve_<name>_up 0.
# Sources share one `scrape` dict: what a later source needs from an earlier one (the workers' pages).
BACKENDS: tuple[tuple[str, type[Exception], tuple[Callable[[dict], Iterable[Metric]], ...]], ...] = (
    ("redis", redis.RedisError, (pool_families, worker_families, queue_families, aggregated_families)),
    ("database", DatabaseError, (request_families, tenant_page_families, canary_families)),
)


class KvserveCollector:
    """Shared state per rendering: nothing is counted in this process, so every web process reports the same."""

    def collect(self):
        scrape = {"model_name": model_get()["id"]}
        for name, down, sources in BACKENDS:
            try:
                families = [family for source in sources for family in source(scrape)]  # all or nothing
                up = 1
            except down:
                log.warning("/metrics: %s unreachable; its metrics are left out", name, exc_info=True)
                families, up = [], 0
            yield from families
            yield _gauge(f"kvserve_{name}_up", f"1 when {name} answered this scrape", [], [((), up)])


def _render() -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvserveCollector())
    return generate_latest(registry)


class ScrapeCache:
    """The latest rendering, served to every scrape within `ttl_s` of it. Renders one at a time: scrapes
    that arrive while one renders wait for it and share its result."""

    def __init__(self, render: Callable[[], bytes]):
        self._render = render
        self._lock = threading.Lock()
        self._key, self._at, self._body = None, 0.0, b""
        self.renders = 0

    def get(self, key, ttl_s: float, now: float) -> bytes:
        with self._lock:
            if self._key == key and 0 <= now - self._at < ttl_s:
                return self._body
            body = self._render()
            self._key, self._at, self._body = key, now, body
            self.renders += 1
            return body


scrape_cache = ScrapeCache(_render)


def metrics_render(now: float | None = None) -> bytes:
    """The exposition text, at most KVSERVE_METRICS_CACHE_S old (0 renders every scrape)."""
    now = time.monotonic() if now is None else now
    key = (settings.REDIS_URL, settings.KVSERVE_LEDGER_PREFIX, settings.DATABASES["default"]["NAME"])
    return scrape_cache.get(key, settings.KVSERVE_METRICS_CACHE_S, now)

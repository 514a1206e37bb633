"""Prometheus exposition for /metrics: metric families from live state (Redis, the database), rendered at
most once per KVSERVE_METRICS_CACHE_S in this process however many scrapers ask. One rendering costs two
Redis round trips for all pools together (four O(1) counts per pool, never a page scan), a few for the
workers, and a handful of database aggregates."""
import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import redis
from django.conf import settings
from django.db import DatabaseError
from django.db.models import Count, Sum
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from incidents.models import CanaryRun, Incident
from inference.ledger import pool_counts
from kvserve.chat.metrics import admission_rejection_counts
from kvserve.chat.models import ChatRequest
from kvserve.workers import redis_get, registry_get

log = logging.getLogger(__name__)
TOKENS_PER_SECOND_WINDOW_S = 60
PAGE_STATES = ("used", "free", "dirty", "lost")


def _gauge(name, doc, labels, rows):
    g = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in rows:
        g.add_metric(list(values), value)
    return g


# ---- Redis: pools, workers, admission -------------------------------------------------------------

def pool_families():
    pages = GaugeMetricFamily("kvserve_pool_pages", "KV pages per pool by state (used, free, dirty, lost)",
                              labels=["pool", "role", "state"])
    for c in pool_counts(redis_get(), settings.KVSERVE_LEDGER_PREFIX):
        for state in PAGE_STATES:
            pages.add_metric([c.pool_id, c.role, state], getattr(c, state))
    yield pages


def worker_families():
    registry = registry_get()
    workers = registry.live_workers()
    yield _gauge("kvserve_worker_capacity_tokens", "Tokens the worker's page pool holds", ["worker", "role"],
                 [((w.worker_id, w.role), w.capacity_tokens) for w in workers])
    yield _gauge("kvserve_worker_window_tokens", "Context window the worker serves", ["worker", "role"],
                 [((w.worker_id, w.role), w.window) for w in workers])
    yield _gauge("kvserve_worker_quarantined", "1 while the worker is quarantined", ["worker", "role"],
                 [((w.worker_id, w.role), int(w.quarantined)) for w in workers])
    limit = registry.effective_limit()
    yield _gauge("kvserve_effective_context_limit_tokens",
                 "Admission limit (prompt + max_tokens); 0 when no prefill and decode worker can serve", [],
                 [((), limit or 0)])


def admission_families():
    c = CounterMetricFamily("kvserve_admission_rejections", "Requests refused at admission (no row written), by reason",
                            labels=["reason"])
    counts = {"context_length_exceeded": 0, **admission_rejection_counts()}
    for reason, n in sorted(counts.items()):
        c.add_metric([reason], n)
    yield c


# ---- the database: requests, incidents, canaries ---------------------------------------------------

def _count_by(field: str, **filters) -> list:
    qs = ChatRequest.objects.filter(**filters).values(field).annotate(n=Count("pk")).order_by(field)
    return [((row[field],), row["n"]) for row in qs]


def request_families():
    statuses = dict.fromkeys(ChatRequest.Status.values, 0)
    statuses.update({values[0]: n for values, n in _count_by("status")})
    yield _gauge("kvserve_chat_requests", "ChatRequest rows by status", ["status"],
                 [((s,), n) for s, n in statuses.items()])
    yield _gauge("kvserve_handoff_verdicts", "ChatRequest rows by prefill->decode handoff verdict", ["verdict"],
                 _count_by("handoff_verdict", handoff_verdict__gt=""))
    yield _gauge("kvserve_decode_verdicts", "ChatRequest rows by decode-side verdict", ["verdict"],
                 _count_by("decode_verdict", decode_verdict__gt=""))
    since = timezone.now() - timedelta(seconds=TOKENS_PER_SECOND_WINDOW_S)
    tokens = ChatRequest.objects.filter(finished_at__gte=since).aggregate(t=Sum("completion_tokens"))["t"] or 0
    yield _gauge("kvserve_decode_tokens_per_second",
                 f"Completion tokens of requests finished in the last {TOKENS_PER_SECOND_WINDOW_S} s, per second",
                 [], [((), tokens / TOKENS_PER_SECOND_WINDOW_S)])


def incident_families():
    incidents = Incident.objects.values("kind", "severity").annotate(n=Count("pk")).order_by("kind", "severity")
    yield _gauge("kvserve_incidents", "Incidents recorded, by kind and severity", ["kind", "severity"],
                 [((row["kind"], row["severity"]), row["n"]) for row in incidents])
    yield _gauge("kvserve_incidents_open", "Incidents not resolved", [],
                 [((), Incident.objects.filter(resolved_at__isnull=True).count())])


def canary_families():
    yield _gauge("kvserve_canary_runs", "Canary runs by result", ["result"],
                 [(("passed",), CanaryRun.objects.filter(passed=True).count()),
                  (("failed",), CanaryRun.objects.filter(passed=False).count())])
    run = CanaryRun.objects.first()
    checks = [c for c in (run.checks or []) if isinstance(c, dict) and "name" in c] if run else []
    yield _gauge("kvserve_canary_check_passed", "1 when the check passed in the latest canary run", ["check"],
                 [((str(c["name"]),), int(bool(c.get("passed")))) for c in checks])
    yield _gauge("kvserve_canary_check_duration_seconds", "Duration of each check in the latest canary run",
                 ["check"], [((str(c["name"]),), float(c["duration_s"])) for c in checks
                             if isinstance(c.get("duration_s"), (int, float))])
    if run is not None:
        yield _gauge("kvserve_canary_last_run_timestamp_seconds", "Start of the latest canary run (Unix time)", [],
                     [((), run.started_at.timestamp())])
        yield _gauge("kvserve_canary_last_run_passed", "1 when the latest canary run passed", [],
                     [((), int(run.passed))])


# (backend, the exception that means it is down, family sources). Add a family by adding a source to its
# backend; a backend that fails leaves all of its families out of the scrape and reports kvserve_<name>_up 0.
BACKENDS: tuple[tuple[str, type[Exception], tuple[Callable[[], Iterable[Metric]], ...]], ...] = (
    ("redis", redis.RedisError, (pool_families, worker_families, admission_families)),
    ("database", DatabaseError, (request_families, incident_families, canary_families)),
)


class KvserveCollector:
    """Live state per rendering: nothing is counted in this process, so every web process reports the same."""

    def collect(self):
        for name, down, sources in BACKENDS:
            try:
                families = [family for source in sources for family in source()]  # all or nothing
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

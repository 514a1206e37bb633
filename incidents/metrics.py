"""Prometheus exposition for /metrics: one custom collector that reads Redis and the database on every scrape."""
import logging
from datetime import timedelta

import redis
from django.conf import settings
from django.db.models import Count, Sum
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from redis.exceptions import ResponseError

from incidents.models import CanaryRun, Incident
from incidents.pools import page_counts
from inference.allocator import LedgerError
from inference.ledger import RedisLedger, ledger_key
from kvserve.chat.metrics import admission_rejection_counts
from kvserve.chat.models import ChatRequest
from kvserve.workers import redis_get, registry_get

log = logging.getLogger(__name__)
TOKENS_PER_SECOND_WINDOW_S = 60


def _gauge(name, doc, labels, rows):
    g = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in rows:
        g.add_metric(list(values), value)
    return g


def _pool_metrics():
    r, prefix = redis_get(), settings.KVSERVE_LEDGER_PREFIX
    pages = GaugeMetricFamily("kvserve_pool_pages", "KV pages per pool by state (used, free, dirty, lost)",
                              labels=["pool", "role", "state"])
    for raw in sorted(r.smembers(ledger_key(prefix))):
        pool = raw.decode() if isinstance(raw, bytes) else raw
        try:
            ledger = RedisLedger(r, pool, prefix=prefix)
            snapshot = ledger.snapshot()
        except (LedgerError, ResponseError):
            continue  # retired between the listing and the read
        for state, n in page_counts(snapshot).items():
            pages.add_metric([pool, ledger.role, state], n)
    yield pages
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

def _admission_metrics():
    c = CounterMetricFamily("kvserve_admission_rejections", "Requests refused at admission (no row written), by reason",
                            labels=["reason"])
    counts = {"context_length_exceeded": 0, **admission_rejection_counts()}
    for reason, n in sorted(counts.items()):
        c.add_metric([reason], n)
    yield c


def _count_by(field: str, **filters) -> list:
    qs = ChatRequest.objects.filter(**filters).values(field).annotate(n=Count("pk")).order_by(field)
    return [((row[field],), row["n"]) for row in qs]


def _db_metrics():
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
    incidents = Incident.objects.values("kind", "severity").annotate(n=Count("pk")).order_by("kind", "severity")
    yield _gauge("kvserve_incidents", "Incidents recorded, by kind and severity", ["kind", "severity"],
                 [((row["kind"], row["severity"]), row["n"]) for row in incidents])
    yield _gauge("kvserve_incidents_open", "Incidents not resolved", [],
                 [((), Incident.objects.filter(resolved_at__isnull=True).count())])
    yield _gauge("kvserve_canary_runs", "Canary runs by result", ["result"],
                 [(("passed",), CanaryRun.objects.filter(passed=True).count()),
                  (("failed",), CanaryRun.objects.filter(passed=False).count())])
    yield from _canary_latest_metrics()


def _canary_latest_metrics():
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


class KvserveCollector:
    """Live state per scrape: nothing is counted in this process, so every web process reports the same."""

    def collect(self):
        try:
            live = [*_pool_metrics(), *_admission_metrics()]  # all or nothing, never half a pool
            redis_up = 1
        except redis.RedisError:
            log.warning("/metrics: Redis unreachable; pool and admission metrics left out", exc_info=True)
            live, redis_up = [], 0
        yield from live
        yield _gauge("kvserve_redis_up", "1 when Redis (ledger, registry) answered this scrape", [], [((), redis_up)])
        yield from _db_metrics()


def metrics_render() -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvserveCollector())
    return generate_latest(registry)

"""The service's history, recorded by the `kvserve.history_sample` beat task every KVSERVE_HISTORY_SAMPLE_S whether
or not anyone watches: one sample of the service series (from the deltas of the aggregated counters and histograms
since the previous sample) and one utilization sample per live pool, each in a capped Redis list kept
KVSERVE_HISTORY_RETENTION_S. This module owns the `{prefix}:history:` keys."""
import json
import math
import time
from dataclasses import asdict, dataclass, field

from django.conf import settings

from incidents.canary.live import broker_queue_lengths
from inference import metrics as aggregated
from inference.ledger import pool_counts
from inference.tenant_budget import LIMITS as TENANT_LIMITS
from kvserve.chat.throttling import RATE_LIMITED
from kvserve.workers import redis_get, registry_get

REFUSED_429 = (*TENANT_LIMITS, RATE_LIMITED)  # admission_rejections reasons answered with 429
COUNTERS = ("generation_tokens", "num_preemptions", "prefix_cache_hits", "prefix_cache_queries")


@dataclass(frozen=True)
class ServiceSample:
    """One point of every service series; None where the interval has no value (no previous sample, no request)."""
    ts: float
    interval_s: float | None
    tokens_per_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    errors: dict[str, int] = field(default_factory=dict)  # request_failure by code, in the interval
    refused_429: int | None = None
    queue_tasks: int = 0  # tasks waiting in the broker for a prefill or decode worker
    waiting: int = 0  # requests the workers took but wait for pages
    preemptions: int | None = None
    prefix_cache_hit_rate: float | None = None


def _key(prefix: str, part: str) -> str:
    return f"{prefix}:history:{part}"


def max_samples() -> int:
    return int(settings.KVSERVE_HISTORY_RETENTION_S // settings.KVSERVE_HISTORY_SAMPLE_S) + 10


# ---- reading the aggregated families as totals -------------------------------------------------------

def totals_read(raw: dict[str, dict[str, str]]) -> dict:
    """The cumulative totals the sampler takes deltas of: counters summed over labels, errors by code, 429s,
    and the TTFT histogram's bucket counts (summed over labels)."""
    out = {name: sum(float(v) for v in raw.get(name, {}).values()) for name in COUNTERS}
    out["errors"] = {}
    for labels, v in raw.get("request_failure", {}).items():
        code = json.loads(labels)[-1]
        out["errors"][code] = out["errors"].get(code, 0) + int(v)
    out["refused_429"] = sum(int(v) for labels, v in raw.get("admission_rejections", {}).items()
                             if json.loads(labels)[0] in REFUSED_429)
    buckets = [0] * (len(aggregated.FAMILIES["time_to_first_token_seconds"].buckets) + 1)
    for k, v in raw.get("time_to_first_token_seconds", {}).items():
        part = k.rpartition("|")[2]
        if part.isdigit():
            buckets[int(part)] += int(v)
    out["ttft_buckets"] = buckets
    return out


def histogram_quantile(q: float, bounds: tuple[float, ...], counts: list[int]) -> float | None:
    """Prometheus' histogram_quantile over per-bucket (not cumulative) counts: linear within the bucket; the
    +Inf bucket answers its lower bound. None without observations."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, running = q * total, 0
    for i, n in enumerate(counts):
        if n and running + n >= rank:
            if i == len(bounds):
                return bounds[-1]
            lower = bounds[i - 1] if i else 0.0
            return lower + (bounds[i] - lower) * (rank - running) / n
        running += n
    return bounds[-1]


def sample_from(now: float, totals: dict, previous: dict | None, *, queue_tasks: int, waiting: int) -> ServiceSample:
    """The sample at `now` from the totals then and the previous sample's (None: the first one, or the counters went
    back, e.g. their Redis keys were deleted: rates are unknown for this interval)."""
    def delta(name):
        return totals[name] - previous[name]

    usable = previous is not None and now > previous["ts"] and all(delta(n) >= 0 for n in (*COUNTERS, "refused_429"))
    if not usable:
        return ServiceSample(now, None, None, None, None, queue_tasks=queue_tasks, waiting=waiting)
    interval = now - previous["ts"]
    ttft = [a - b for a, b in zip(totals["ttft_buckets"], previous["ttft_buckets"])]
    ttft = ttft if all(n >= 0 for n in ttft) else [0] * len(ttft)
    bounds = aggregated.FAMILIES["time_to_first_token_seconds"].buckets
    errors = {c: n - previous["errors"].get(c, 0) for c, n in totals["errors"].items()
              if n - previous["errors"].get(c, 0) > 0}
    queries = delta("prefix_cache_queries")
    return ServiceSample(
        ts=now, interval_s=round(interval, 3), tokens_per_s=round(delta("generation_tokens") / interval, 3),
        ttft_p50_s=_round(histogram_quantile(0.5, bounds, ttft)), ttft_p99_s=_round(histogram_quantile(0.99, bounds, ttft)),
        errors=errors, refused_429=int(delta("refused_429")), queue_tasks=queue_tasks, waiting=waiting,
        preemptions=int(delta("num_preemptions")),
        prefix_cache_hit_rate=round(delta("prefix_cache_hits") / queries, 4) if queries > 0 else None)


def _round(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else round(x, 4)


# ---- the sampler ------------------------------------------------------------------------------------------

def history_sample(now: float | None = None) -> ServiceSample | None:
    """Records one sample of every series (None: another sampler took this interval's). Called by beat."""
    redis, prefix = redis_get(), settings.KVSERVE_LEDGER_PREFIX
    now = time.time() if now is None else now
    every = settings.KVSERVE_HISTORY_SAMPLE_S
    # two beats (or a task delivered twice) in one interval record once
    if not redis.set(_key(prefix, f"gate:{int(now // every)}"), "1", nx=True, ex=max(1, int(2 * every))):
        return None
    keep, cap, ttl = settings.KVSERVE_HISTORY_RETENTION_S, max_samples(), int(settings.KVSERVE_HISTORY_RETENTION_S + 60)
    totals = totals_read(aggregated.families_read(redis, prefix))
    raw_previous = redis.get(_key(prefix, "totals"))
    previous = json.loads(raw_previous) if raw_previous else None
    workers = registry_get().live_workers()
    gauges = aggregated.worker_gauges_read(redis, prefix, [w.worker_id for w in workers])
    queues = broker_queue_lengths()
    sample = sample_from(now, totals, previous, queue_tasks=queues.get("prefill", 0) + queues.get("decode", 0),
                         waiting=sum(int(g.get("waiting", 0)) for g in gauges.values()))
    pipe = redis.pipeline()
    pipe.set(_key(prefix, "totals"), json.dumps({"ts": now, **totals}), ex=ttl)
    pipe.lpush(_key(prefix, "service"), json.dumps(asdict(sample), separators=(",", ":")))
    pipe.ltrim(_key(prefix, "service"), 0, cap - 1)
    pipe.expire(_key(prefix, "service"), ttl)
    live = {w.worker_id for w in workers}
    for c in pool_counts(redis, prefix):  # O(1) Redis work per pool, whatever its size (never a page scan)
        if c.pool_id not in live:
            continue
        pool_key = _key(prefix, f"pool:{c.pool_id}")
        pipe.lpush(pool_key, json.dumps([round(now, 3), c.used, c.free, c.dirty]))
        pipe.ltrim(pool_key, 0, cap - 1)
        pipe.expire(pool_key, ttl)  # a worker that is gone leaves nothing behind after the retention
        pipe.zadd(_key(prefix, "pools"), {c.pool_id: now})
    pipe.zremrangebyscore(_key(prefix, "pools"), "-inf", now - keep)
    pipe.expire(_key(prefix, "pools"), ttl)
    pipe.execute()
    return sample


# ---- reading -------------------------------------------------------------------------------------------

def _window(raws, now: float, window_s: float, ts=lambda s: s["ts"]) -> list:
    samples = [json.loads(r) for r in raws]
    return [s for s in reversed(samples) if now - window_s <= ts(s) <= now]


def pool_history_get(redis, prefix: str, worker_id: str, now: float, window_s: float) -> list[list]:
    """[[ts, used, free, dirty], ...] of the pool in the last window_s seconds, oldest first."""
    return _window(redis.lrange(_key(prefix, f"pool:{worker_id}"), 0, max_samples() - 1), now, window_s,
                   ts=lambda s: s[0])


def history_get(*, window_s: float, now: float | None = None) -> dict:
    """The service samples and every pool's utilization samples of the last window_s seconds, oldest first."""
    redis, prefix = redis_get(), settings.KVSERVE_LEDGER_PREFIX
    now = time.time() if now is None else now
    pools = [p.decode() if isinstance(p, bytes) else p
             for p in redis.zrangebyscore(_key(prefix, "pools"), now - window_s, "+inf")]
    return {"now": now, "window_s": window_s, "sample_every_s": settings.KVSERVE_HISTORY_SAMPLE_S,
            "retention_s": settings.KVSERVE_HISTORY_RETENTION_S,
            "service": _window(redis.lrange(_key(prefix, "service"), 0, max_samples() - 1), now, window_s),
            "pools": {p: pool_history_get(redis, prefix, p, now, window_s) for p in sorted(pools)}}

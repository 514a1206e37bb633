"""Prometheus metrics aggregated in Redis for a whole deployment: every process (web, workers, beat, on any host)
adds its observations to hashes under `{prefix}:metrics:` (this module's keys alone), and any web process's
/metrics reads them back and renders them, so one scrape of any web host sees all of them.

A counter family is one hash (field: its label values, value: the count). A histogram family is one hash with,
per label set, a field per bucket (counts, not yet cumulative), `sum` and `count`. A `Batch` collects increments
and sends them in one pipeline of HINCRBY/HINCRBYFLOAT; a worker's engine loop notes per-token observations in
memory (`WorkerMetrics`) and its heartbeat sends them, with its gauges (a key per worker that expires with it).
Reading costs one HGETALL per family and one MGET for all workers' gauges, whatever the traffic was. No Django."""
import json
import threading
import time
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

# Seconds. Request-scale phases (queue, prefill, decode, end to end) reach minutes; token-scale ones do not.
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                   1800.0, 3600.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                160.0, 640.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 10.0, 20.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Token counts: per request (vLLM's 1-2-5 series up to a long context) and per engine step (batch sizes)
REQUEST_TOKEN_BUCKETS = tuple(float(n) for n in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                                                 50000, 100000))
STEP_TOKEN_BUCKETS = tuple(float(n) for n in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096, 8192))


@dataclass(frozen=True)
class Family:
    name: str  # without the `kvserve_` prefix; counters without `_total`
    doc: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None  # a histogram when set

    @property
    def exposed(self) -> str:
        return f"kvserve_{self.name}"


M = ("model_name",)
FAMILIES = {f.name: f for f in (
    # vLLM's vocabulary
    Family("time_to_first_token_seconds", "Arrival at the API to the first token published by decode", M,
           TTFT_BUCKETS),
    Family("inter_token_latency_seconds", "Time between two consecutive output tokens of a request", M,
           TOKEN_BUCKETS),
    Family("e2e_request_latency_seconds", "Arrival at the API to the request's last token (finished requests)", M,
           REQUEST_BUCKETS),
    Family("request_queue_time_seconds", "Arrival at the API to a prefill worker taking the request", M,
           REQUEST_BUCKETS),
    Family("request_prefill_time_seconds", "Prefill worker: taking the request to its signed handoff", M,
           REQUEST_BUCKETS),
    Family("request_decode_time_seconds", "Decode worker: taking the request to its last token", M,
           REQUEST_BUCKETS),
    Family("kv_transfer_time_seconds", "Decode worker: pulling a handoff's KV pages from the transport", M,
           TRANSFER_BUCKETS),
    Family("request_inference_time_seconds", "A prefill worker taking the request to its last token (prefill, "
           "handoff and decode; finished requests)", M, REQUEST_BUCKETS),
    Family("request_prompt_tokens", "Prompt tokens per finished request", M, REQUEST_TOKEN_BUCKETS),
    Family("request_generation_tokens", "Generated tokens per finished request", M, REQUEST_TOKEN_BUCKETS),
    Family("iteration_tokens_total", "Tokens sampled per engine step of a decode worker (its batch)", M,
           STEP_TOKEN_BUCKETS),
    Family("prompt_tokens", "Prompt tokens prefilled (handoff OK)", M),
    Family("generation_tokens", "Tokens generated (published by decode workers)", M),
    Family("prefix_cache_queries", "Prompt tokens looked up in the prefill workers' prefix cache, per tenant (id)",
           M + ("tenant",)),
    Family("prefix_cache_hits", "Prompt tokens read from the prefix cache (the tenant's own scope), per tenant (id)",
           M + ("tenant",)),
    Family("request_success", "Requests finished with an answer, by finish reason", M + ("finished_reason",)),
    # kvserve's own
    Family("request_failure", "Requests that ended failed or rejected after admission, by error code",
           M + ("code",)),
    Family("admission_rejections", "Requests refused at admission (no row written), by reason", ("reason",)),
    Family("handoff_verdicts", "Prefill->decode handoffs by the verdict prefill signed", M + ("verdict",)),
    Family("decode_verdicts", "Handoffs by what decode made of them (accepted, or why refused)", M + ("verdict",)),
    Family("scrubbed_pages", "KV pages zeroed (on free, on alloc, reclaimed)", M + ("role",)),
    Family("guard_checks", "Ownership guard checks before attention (one per sequence per forward pass)",
           M + ("role",)),
    Family("guard_violations", "Ownership guard violations (the request failed closed)", M + ("role", "kind")),
    Family("num_preemptions", "Sequences preempted for pages (freed and scrubbed, recomputed later)",
           M + ("role",)),
    Family("incidents", "Incidents recorded, by kind and severity", ("kind", "severity")),
    Family("incidents_resolved", "Incidents resolved, by kind and severity", ("kind", "severity")),
    Family("canary_runs", "Canary suite runs by result", ("result",)),
    Family("canary_checks", "Canary check results per check and worker (worker \"\": the check as a whole)",
           ("check", "worker", "result")),
)}


def metrics_key(prefix: str, family: str) -> str:
    return f"{prefix}:metrics:{family}"


def worker_gauges_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:metrics:worker:{worker_id}"


def _labels(family: Family, labels: dict) -> str:
    if set(labels) != set(family.labels):
        raise ValueError(f"{family.exposed} takes labels {family.labels}, got {sorted(labels)}")
    return json.dumps([str(labels[k]) for k in family.labels], separators=(",", ":"))


class Batch:
    """Increments for one pipeline. Counters and histogram observations by family name and label values."""

    def __init__(self):
        self.ints: dict[tuple[str, str], int] = {}
        self.floats: dict[tuple[str, str], float] = {}

    def __bool__(self) -> bool:
        return bool(self.ints or self.floats)

    def inc(self, family: str, value: int = 1, **labels) -> "Batch":
        f = FAMILIES[family]
        if f.buckets is not None:
            raise ValueError(f"{f.exposed} is a histogram: observe() it")
        key = (family, _labels(f, labels))
        self.ints[key] = self.ints.get(key, 0) + int(value)
        return self

    def observe(self, family: str, seconds: float, **labels) -> "Batch":
        f = FAMILIES[family]
        if f.buckets is None:
            raise ValueError(f"{f.exposed} is a counter: inc() it")
        lv = _labels(f, labels)
        seconds = max(0.0, float(seconds))
        for field in (f"{lv}|{bisect_left(f.buckets, seconds)}", f"{lv}|count"):
            self.ints[(family, field)] = self.ints.get((family, field), 0) + 1
        self.floats[(family, f"{lv}|sum")] = self.floats.get((family, f"{lv}|sum"), 0.0) + seconds
        return self

    def merge(self, other: "Batch") -> None:
        for k, v in other.ints.items():
            self.ints[k] = self.ints.get(k, 0) + v
        for k, v in other.floats.items():
            self.floats[k] = self.floats.get(k, 0.0) + v

    def send(self, redis, prefix: str, pipe=None) -> None:
        """One round trip (or into the caller's pipeline `pipe`)."""
        if not self:
            return
        p = pipe if pipe is not None else redis.pipeline(transaction=False)
        for (family, field), n in self.ints.items():
            p.hincrby(metrics_key(prefix, family), field, n)
        for (family, field), x in self.floats.items():
            p.hincrbyfloat(metrics_key(prefix, family), field, x)
        if pipe is None:
            p.execute()


# ---- reading (web) ---------------------------------------------------------------------------------------

def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def families_read(redis, prefix: str) -> dict[str, dict[str, str]]:
    """Every family's hash (field -> value), one pipeline."""
    pipe = redis.pipeline(transaction=False)
    for name in FAMILIES:
        pipe.hgetall(metrics_key(prefix, name))
    return {name: {_text(k): _text(v) for k, v in raw.items()} for name, raw in zip(FAMILIES, pipe.execute())}


def families_render(raw: dict[str, dict[str, str]], defaults: dict[str, list[dict]] | None = None) -> list:
    """prometheus_client families from `families_read`. `defaults`: label sets to show at 0 when absent."""
    out = []
    for name, f in FAMILIES.items():
        fields = raw.get(name, {})
        if f.buckets is None:
            metric = CounterMetricFamily(f.exposed, f.doc, labels=list(f.labels))
            values = {tuple(json.loads(k)): float(v) for k, v in fields.items()}
            for labels in (defaults or {}).get(name, []):
                values.setdefault(tuple(str(labels[k]) for k in f.labels), 0.0)
            for lv, v in sorted(values.items()):
                metric.add_metric(list(lv), v)
        else:
            metric = HistogramMetricFamily(f.exposed, f.doc, labels=list(f.labels))
            per: dict[tuple, dict[str, float]] = {}
            for k, v in fields.items():
                lv, _, part = k.rpartition("|")
                per.setdefault(tuple(json.loads(lv)), {})[part] = float(v)
            for labels in (defaults or {}).get(name, []):
                per.setdefault(tuple(str(labels[k]) for k in f.labels), {})
            for lv, parts in sorted(per.items()):
                running, buckets = 0.0, []
                for i, bound in enumerate((*f.buckets, float("inf"))):
                    running += parts.get(str(i), 0.0)
                    buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
                metric.add_metric(list(lv), buckets, parts.get("sum", 0.0))
        out.append(metric)
    return out


def worker_gauges_read(redis, prefix: str, worker_ids: list[str]) -> dict[str, dict]:
    """worker id -> its latest gauges ({} for a worker that has sent none yet)."""
    if not worker_ids:
        return {}
    raws = redis.mget([worker_gauges_key(prefix, w) for w in worker_ids])
    return {w: json.loads(r) if r else {} for w, r in zip(worker_ids, raws)}


# ---- a worker's observations -----------------------------------------------------------------------------

class WorkerMetrics:
    """One worker process's metrics. The engine loop notes tokens as it publishes them (`on_step`, `on_token`);
    task threads note when a request arrived at the API (`arrived`); the heartbeat sends everything noted since
    its last beat, the engine's own counters (scrubs, guard checks) and this worker's gauges in one pipeline
    (`flush`). An observation never waits on Redis; a flush that fails keeps its increments for the next."""

    MAX_TRACKED = 10_000  # requests whose token timing is kept (a request that never finishes drops out)

    def __init__(self, redis, prefix: str, *, role: str, model_name: str, worker_id: str, gauges_ttl_s: float):
        self.redis, self.prefix = redis, prefix
        self.role, self.model_name, self.worker_id = role, model_name, worker_id
        self.gauges_ttl_s = max(1, int(gauges_ttl_s + 0.999))
        self._lock = threading.Lock()
        self._batch = Batch()
        self._arrival: OrderedDict[str, float] = OrderedDict()  # request id -> wall time it reached the API
        self._last: OrderedDict[str, float] = OrderedDict()  # request id -> monotonic time of its latest token
        self._engine_counts = {"scrubbed_pages": 0, "guard_checks": 0, "num_preemptions": 0}

    @staticmethod
    def _bounded_set(d: OrderedDict, key, value) -> None:
        d[key] = value
        if len(d) > WorkerMetrics.MAX_TRACKED:
            d.popitem(last=False)

    def arrived(self, request_id: str, arrival_s: float) -> None:
        """Wall time (time.time()) the API admitted the request: what its time to first token counts from."""
        self._bounded_set(self._arrival, request_id, float(arrival_s))

    def on_token(self, request_id: str, finished: bool, now: float | None = None, wall: float | None = None) -> None:
        """A request published a token: its first (time to first token) or a next one (inter-token latency)."""
        now = time.monotonic() if now is None else now
        m = self.model_name
        with self._lock:
            last = self._last.pop(request_id, None)
            if last is None:
                arrival = self._arrival.pop(request_id, None)
                if arrival is not None:
                    self._batch.observe("time_to_first_token_seconds", (time.time() if wall is None else wall)
                                        - arrival, model_name=m)
            else:
                self._batch.observe("inter_token_latency_seconds", now - last, model_name=m)
            self._batch.inc("generation_tokens", model_name=m)
            if finished:
                self._arrival.pop(request_id, None)
            else:
                self._bounded_set(self._last, request_id, now)

    def on_step(self, events) -> None:
        """An engine step's events (inference.engine.StepEvent): every decode token of the step."""
        now, wall = time.monotonic(), time.time()
        sampled = sum(1 for ev in events if ev.token is not None and not ev.seq.prefill_only)
        if sampled:
            with self._lock:
                self._batch.observe("iteration_tokens_total", sampled, model_name=self.model_name)
        for ev in events:
            if ev.token is not None and not ev.seq.prefill_only:
                self.on_token(ev.seq.request_id, ev.finished, now, wall)
            elif ev.finished:
                with self._lock:
                    self._last.pop(ev.seq.request_id, None)
                    self._arrival.pop(ev.seq.request_id, None)

    def on_violation(self, kind: str) -> None:
        with self._lock:
            self._batch.inc("guard_violations", model_name=self.model_name, role=self.role, kind=kind)

    def flush(self, engine, waiting: int = 0) -> None:
        """Sends what was noted since the last flush, the engine's counters and this worker's gauges."""
        stats = engine.stats()
        counts = {"scrubbed_pages": stats.scrubbed_pages, "guard_checks": stats.guard_checks,
                  "num_preemptions": stats.num_preemptions}
        gauges = {"role": self.role, "model_name": self.model_name, "running": stats.running,
                  "waiting": stats.waiting + waiting, "pages": stats.pages}
        with self._lock:
            batch, self._batch = self._batch, Batch()
            for name, total in counts.items():
                if total > self._engine_counts[name]:
                    batch.inc(name, total - self._engine_counts[name], model_name=self.model_name, role=self.role)
            self._engine_counts = counts
        pipe = self.redis.pipeline(transaction=False)
        batch.send(self.redis, self.prefix, pipe)
        pipe.set(worker_gauges_key(self.prefix, self.worker_id), json.dumps(gauges), ex=self.gauges_ttl_s)
        try:
            pipe.execute()
        except Exception:
            with self._lock:  # Redis unreachable: nothing of it counted; sent with the next beat
                batch.merge(self._batch)
                self._batch = batch
            raise

"""The chat requests' observations for /metrics (inference.metrics: aggregated in Redis for every process): one call
per event of a request's life, each one pipeline. Never raises: a metric must not break what it measures."""
import json

from django.conf import settings
from django.utils import timezone

from inference.metrics import Batch, families_read
from kvserve.workers import metrics_send as _send, redis_get


def _seconds(start, end) -> float | None:
    return (end - start).total_seconds() if start and end else None


def admission_rejection_count_incr(reason: str = "context_length_exceeded") -> None:
    """Call where the API refuses a request at admission."""
    _send(Batch().inc("admission_rejections", reason=reason), f"an admission rejection ({reason})")


def admission_rejection_counts() -> dict[str, int]:
    """reason -> count (raises redis.RedisError when Redis is down)."""
    raw = families_read(redis_get(), settings.KVSERVE_LEDGER_PREFIX)["admission_rejections"]
    return {json.loads(k)[0]: int(v) for k, v in raw.items()}


def chat_metrics_prefilled(req, verdict: str, cached_tokens: int = 0) -> None:
    """Prefill signed its handoff: the verdict; for OK also the prompt tokens (and how many came from the prefix
    cache, per tenant id), queue and prefill times."""
    m = req.model
    batch = Batch().inc("handoff_verdicts", model_name=m, verdict=verdict)
    if verdict == "OK":
        batch.inc("prompt_tokens", req.prompt_tokens, model_name=m)
        batch.inc("prefix_cache_queries", req.prompt_tokens, model_name=m, tenant=str(req.tenant_id))
        batch.inc("prefix_cache_hits", cached_tokens, model_name=m, tenant=str(req.tenant_id))
        for family, start, end in (("request_queue_time_seconds", req.created_at, req.prefill_started_at),
                                   ("request_prefill_time_seconds", req.prefill_started_at,
                                    req.prefill_finished_at or timezone.now())):
            if (seconds := _seconds(start, end)) is not None:
                batch.observe(family, seconds, model_name=m)
    _send(batch, f"prefill of {req.id}")


def chat_metrics_decoded(req, seq) -> None:
    """Decode accepted the handoff and ran to the end: the transfer, decode and end-to-end times and the outcome."""
    m, end = req.model, req.finished_at or timezone.now()
    batch = Batch().inc("decode_verdicts", model_name=m, verdict="accepted")
    if seq.transfer_ms is not None:
        batch.observe("kv_transfer_time_seconds", seq.transfer_ms / 1000, model_name=m)
    if seq.status.value == "failed":
        batch.inc("request_failure", model_name=m, code="kv_isolation_violation")
    else:
        batch.inc("request_success", model_name=m, finished_reason=seq.finish_reason or "stop")
        batch.observe("e2e_request_latency_seconds", _seconds(req.created_at, end), model_name=m)
        batch.observe("request_prompt_tokens", req.prompt_tokens, model_name=m)
        batch.observe("request_generation_tokens", len(seq.output_ids), model_name=m)
        if (seconds := _seconds(req.prefill_started_at, end)) is not None:
            batch.observe("request_inference_time_seconds", seconds, model_name=m)
        if (seconds := _seconds(req.decode_started_at, end)) is not None:
            batch.observe("request_decode_time_seconds", seconds, model_name=m)
    _send(batch, f"decode of {req.id}")


def chat_metrics_refused(req, kind: str) -> None:
    """Decode refused the handoff (`kind`: HandoffRefused.kind)."""
    _send(Batch().inc("decode_verdicts", model_name=req.model, verdict=kind), f"the refusal of {req.id}")


def chat_metrics_failed(req, code: str) -> None:
    """The request ended failed or rejected after admission."""
    _send(Batch().inc("request_failure", model_name=req.model, code=code), f"the failure of {req.id}")

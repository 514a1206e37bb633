"""Chat request lifecycle: admission and queueing (web), prefill and decode (workers), failure and
orphan reaping. Every state change of a ChatRequest row goes through here."""
import hashlib
import hmac
import json
import logging
import math
import threading
import uuid
from functools import lru_cache

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from inference.handoff import HandoffRefused, Verdict
from inference.ledger import RedisLedger, ledger_key
from inference.sequence import SamplingParams, SeqStatus
from incidents.services import incident_record
from kvserve.chat.metrics import (admission_rejection_count_incr, chat_metrics_decoded, chat_metrics_failed,
                                  chat_metrics_prefilled, chat_metrics_refused)
from kvserve.chat.models import ChatRequest
from kvserve.errors import ApiError
from kvserve.workers import outputs_get, redis_get, registry_get

log = logging.getLogger(__name__)
Status = ChatRequest.Status


@lru_cache(maxsize=1)
def tokenizer_get():
    """(ChatTokenizer, fingerprint, model name) of the served model; weights are not loaded here."""
    from inference.loader import load_tokenizer

    return load_tokenizer()


class _Count:
    def __init__(self):
        self.value, self._lock = 0, threading.Lock()

    def incr(self) -> None:
        with self._lock:
            self.value += 1


_prompts_tokenized = _Count()


def _prompt_encode(tokenizer, prompt: str) -> list[int]:
    """The one place the web process tokenizes a prompt; counted, so that what never gets here is observable."""
    _prompts_tokenized.incr()
    return tokenizer.encode(prompt)


def prompts_tokenized() -> int:
    """Prompts this process has tokenized since it started."""
    return _prompts_tokenized.value


def prompt_hash(prompt: str) -> str:
    """HMAC-SHA256 of the rendered prompt under the deployment's KVSERVE_PROMPT_HASH_KEY: equal prompts
    compare equal, but nobody without the key can confirm a guessed (short) prompt against a stored hash."""
    return hmac.new(settings.KVSERVE_PROMPT_HASH_KEY.encode(), prompt.encode(), hashlib.sha256).hexdigest()


def _context_length_exceeded(limit: int, total: str, prompt: str, max_tokens: int,
                             param: str = "messages") -> ApiError:
    admission_rejection_count_incr()
    return ApiError(
        f"This model's maximum context length is {limit} tokens. However, you requested {total} tokens "
        f"({prompt} in the {param}, {max_tokens} in the completion). Please reduce the length "
        f"of the {param} or completion.", param=param, code="context_length_exceeded")


def sampling_params(req: ChatRequest) -> SamplingParams:
    p = req.params
    return SamplingParams(max_tokens=req.max_tokens, temperature=p.get("temperature", 0.0), top_p=p.get("top_p", 1.0),
                          top_k=p.get("top_k", 0), seed=p.get("seed"), stop=tuple(p.get("stop", ())),
                          logprobs=p.get("logprobs"))


# ---- web side --------------------------------------------------------------------------------

def chat_request_create(*, api_key, messages: list[dict] | None = None, prompt: str | list[int] | None = None,
                        max_tokens: int, params: dict, stream: bool = False) -> tuple[ChatRequest, list[int]]:
    """Admission before reservation, for chat (`messages`, rendered with the model's chat template) and
    completions (`prompt`: text tokenized as it is, or token ids used as they are): an overlong request raises
    ApiError(400 context_length_exceeded) before any row is written, any page reserved or any task queued."""
    tokenizer, _, model_name = tokenizer_get()
    token_ids = None
    if messages is not None:
        text, param, id_prefix = tokenizer.render_chat(messages), "messages", "chatcmpl"
    elif isinstance(prompt, str):
        text, param, id_prefix = prompt, "prompt", "cmpl"
    else:  # token ids: used as they are, hashed as their JSON
        token_ids, text, param, id_prefix = list(prompt), json.dumps(list(prompt)), "prompt", "cmpl"
    limit = registry_get().effective_limit()
    if limit is None:
        admission_rejection_count_incr("no_workers")
        raise ApiError("no live prefill and decode workers are registered; try again shortly",
                       status_code=503, type="service_unavailable", code="no_workers")
    if token_ids is None:
        # Before tokenizing (which costs seconds per MB here): no token covers more than max_token_chars
        # characters, so a longer prompt than that many limits can never fit, and is never tokenized.
        per_token = tokenizer.max_token_chars
        if per_token and len(text) > per_token * limit:
            least = math.ceil(len(text) / per_token)
            raise _context_length_exceeded(limit, f"at least {least + max_tokens}", f"at least {least}: {len(text)} "
                                           f"characters, and no token of this model covers more than {per_token}",
                                           max_tokens, param)
        token_ids = _prompt_encode(tokenizer, text)
    prompt_ids = token_ids
    if not prompt_ids:
        raise ApiError("The prompt is empty: it encodes to no tokens.", param=param, code="empty_prompt")
    if len(prompt_ids) + max_tokens > limit:
        raise _context_length_exceeded(limit, str(len(prompt_ids) + max_tokens), str(len(prompt_ids)), max_tokens,
                                       param)
    tenant = api_key.tenant
    params = dict(params)
    if params.get("seed") is None:
        params["seed"] = uuid.uuid4().int & (2**63 - 1)  # fixed here so any worker samples the same stream
    req = ChatRequest.objects.create(
        id=f"{id_prefix}-{uuid.uuid4().hex}", tenant=tenant, api_key=api_key, model=model_name, stream=stream,
        params=params, max_tokens=max_tokens, prompt_tokens=len(prompt_ids),
        prompt_hash=prompt_hash(text),
        prompt_text=json.dumps(messages if messages is not None else prompt) if tenant.store_text else None,
    )
    from kvserve.chat.tasks import prefill

    def enqueue():
        try:  # the stream's retention is recorded before any worker can publish its final event
            outputs_get().retain(req.id, settings.KVSERVE_STREAM_RETENTION_S if tenant.store_text
                                 else settings.KVSERVE_STREAM_REPLAY_S)
            prefill.delay(req.id, prompt_ids)
        except Exception:  # broker down: the row must not sit queued forever
            chat_request_fail(req, code="backend_unavailable", message="the task queue is unreachable")
            raise

    transaction.on_commit(enqueue)
    return req, prompt_ids


def chat_request_fail(req: ChatRequest, *, code: str, message: str, status: str = Status.FAILED) -> None:
    req.status, req.error_code, req.error_message = status, code, message
    req.finished_at = timezone.now()
    req.save(update_fields=["status", "error_code", "error_message", "finished_at", "handoff_verdict",
                            "decode_verdict", "prefill_finished_at"])
    chat_metrics_failed(req, code)
    outputs_get().publish(req.id, {"type": "error", "code": code, "message": message})


def _claim(request_id: str, from_statuses, to_status, counter: str, **fields) -> ChatRequest | None:
    """Moves the row into a worker's hands once per delivery; None when it is already past this stage."""
    with transaction.atomic():
        n = ChatRequest.objects.filter(id=request_id, status__in=from_statuses).update(
            status=to_status, **{counter: F(counter) + 1}, **fields)
    return ChatRequest.objects.select_related("tenant").get(id=request_id) if n else None


# ---- worker side -----------------------------------------------------------------------------

def chat_request_prefill(request_id: str, prompt_ids: list[int]) -> None:
    from kvserve.chat.runtime import runtime_get

    runtime = runtime_get()
    req = _claim(request_id, [Status.QUEUED, Status.PREFILLING], Status.PREFILLING, "prefill_deliveries",
                 prefill_started_at=timezone.now(), prefill_worker=runtime.worker_id)
    if req is None:
        return
    if req.prefill_deliveries > settings.KVSERVE_TASK_MAX_DELIVERIES:
        return chat_request_fail(req, code="redelivery_limit",
                                 message=f"prefill was attempted {req.prefill_deliveries - 1} times without finishing")
    handoff = runtime.prefill(req.id, prompt_ids, sampling_params(req))
    req.handoff_verdict = handoff.verdict.value
    req.prefill_finished_at = timezone.now()
    chat_metrics_prefilled(req, handoff.verdict.value)
    if handoff.verdict is Verdict.REJECTED:
        return chat_request_fail(req, code="context_length_exceeded", message=handoff.reason, status=Status.REJECTED)
    if handoff.verdict is not Verdict.OK:
        return chat_request_fail(req, code="prefill_failed", message=handoff.reason)
    req.save(update_fields=["handoff_verdict", "prefill_finished_at"])
    from kvserve.chat.tasks import decode

    decode.delay(req.id, prompt_ids, handoff.to_dict())


def chat_request_decode(request_id: str, prompt_ids: list[int], handoff: dict) -> None:
    from kvserve.chat.runtime import runtime_get

    runtime = runtime_get()
    started = timezone.now()
    req = _claim(request_id, [Status.PREFILLING, Status.DECODING], Status.DECODING, "decode_deliveries",
                 decode_started_at=started, decode_worker=runtime.worker_id)
    if req is None:
        return
    if req.decode_deliveries > settings.KVSERVE_TASK_MAX_DELIVERIES:
        return chat_request_fail(req, code="redelivery_limit",
                                 message=f"decode was attempted {req.decode_deliveries - 1} times without finishing")
    runtime.metrics.arrived(req.id, req.created_at.timestamp())  # its time to first token counts from here
    try:
        seq = runtime.decode(req.id, prompt_ids, sampling_params(req), handoff)
    except HandoffRefused as refused:
        chat_metrics_refused(req, refused.kind)
        req.decode_verdict = refused.kind
        _handoff_incident(runtime, req, refused, handoff)
        return chat_request_fail(req, code="handoff_refused", message=f"decode refused the handoff: {refused.reason}")
    req.decode_verdict = "accepted"
    req.finished_at = timezone.now()
    req.transfer_ms = seq.transfer_ms
    req.completion_tokens = len(seq.output_ids)
    if seq.status is SeqStatus.FAILED:
        req.status, req.error_code, req.error_message = Status.FAILED, "kv_isolation_violation", "failed closed"
    else:
        req.status, req.finish_reason = Status.DONE, seq.finish_reason or ""
        if req.tenant.store_text:
            req.completion_text = seq.text
    req.save()
    chat_metrics_decoded(req, seq)


def _handoff_incident(runtime, req, refused: HandoffRefused, handoff: dict) -> None:
    if not refused.is_incident or refused.kind == "kv_missing":
        return
    kind = refused.kind if refused.kind in ("handoff_forged", "handoff_mismatch", "stale_epoch") else "handoff_mismatch"
    incident_record(
        kind=kind, severity="critical", pool=runtime.worker_id,
        # a forged handoff names no trustworthy worker; a mismatching one points at its prefill worker
        worker="" if kind == "handoff_forged" else str(handoff.get("prefill_worker", ""))[:200],
        reader_request=req.id, detected_by="decode handoff verification",
        epochs=list(handoff.get("page_epochs", []))[:64] if isinstance(handoff.get("page_epochs"), list) else None,
        details={"reason": refused.reason, "verdict": str(handoff.get("verdict")),
                 "expected_tokens": handoff.get("expected_tokens"), "transferred_tokens": handoff.get("transferred_tokens")},
    )


# ---- engine callbacks (run in worker threads) -------------------------------------------------

def runtime_on_violation(runtime, violation) -> None:
    incident_record(kind=violation.kind, severity="critical", pool=violation.pool, worker=runtime.worker_id,
                    pages=[violation.page], reader_request=violation.reader,
                    previous_owner_request=violation.page_owner or "",
                    epochs={"reader": violation.reader_epoch, "page": violation.page_epoch},
                    detected_by="ownership guard (before attention)", details=violation.to_dict())


def runtime_on_reclaim(runtime, events) -> None:
    for ev in events:
        incident_record(kind="lease_expired", severity="warning", pool=ev.pool_id, worker=runtime.worker_id,
                        pages=list(ev.pages), previous_owner_request=ev.owner, epochs=list(ev.epochs),
                        detected_by="lease reaper (worker heartbeat)", details={"expired_at_ms": ev.expired_at_ms})


def runtime_on_quarantine(runtime, quarantined: bool) -> None:
    from kvserve.chat.runtime import consumer_toggle

    consumer_toggle(runtime.role, active=not quarantined)


# ---- maintenance -----------------------------------------------------------------------------

def requests_reap_orphans() -> dict:
    """Fails requests whose worker died, reclaims expired leases in every pool, and retires the pools
    of dead workers once their books balance. Returns what it did."""
    registry, redis = registry_get(), redis_get()
    live = {w.worker_id for w in registry.live_workers()}
    failed = []
    for req in ChatRequest.objects.filter(status__in=[Status.PREFILLING, Status.DECODING]):
        worker = req.decode_worker if req.status == Status.DECODING else req.prefill_worker
        if worker and worker not in live:
            chat_request_fail(req, code="worker_lost",
                              message=f"{req.status} worker {worker} stopped responding; the request did not complete")
            failed.append(req.id)
    pools = []
    prefix = settings.KVSERVE_LEDGER_PREFIX
    for raw in redis.smembers(ledger_key(prefix)):
        pool_id = raw.decode() if isinstance(raw, bytes) else raw
        ledger = RedisLedger(redis, pool_id, prefix=prefix)
        events = ledger.reap_expired()
        for ev in events:
            incident_record(kind="lease_expired", severity="warning", pool=pool_id, worker=pool_id,
                            pages=list(ev.pages), previous_owner_request=ev.owner, epochs=list(ev.epochs),
                            detected_by="lease reaper (periodic task)", details={"expired_at_ms": ev.expired_at_ms})
        report = {"pool": pool_id, "reclaimed": sum(len(ev.pages) for ev in events), "live": pool_id in live}
        if pool_id not in live:
            dirty = ledger.take_dirty()
            if dirty:
                ledger.mark_clean(dirty)  # its tensor died with its process: nothing left to scrub
            try:
                ledger.check_integrity()
                report["integrity"] = "ok"
                if ledger.num_free() == ledger.num_pages:
                    ledger.unregister()
                    report["retired"] = True
            except Exception as exc:
                report["integrity"] = str(exc)
                incident_record(kind="integrity", severity="critical", pool=pool_id, detected_by="periodic reaper",
                                details={"error": str(exc)})
        pools.append(report)
    return {"failed_requests": failed, "pools": pools}

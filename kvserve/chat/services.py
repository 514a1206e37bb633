"""Chat request lifecycle: admission and queueing (web), prefill and decode (workers), failure and cancellation.
Every state change of a ChatRequest row goes through here or the reaper (kvserve/chat/reaper.py), which ends
orphans through chat_request_fail; the first terminal state wins (every write after a claim is conditional on it).
Tasks are sent by name (kvserve/dispatch.py); a refused handoff is reported by kvserve/chat/callbacks.py."""
import hashlib
import hmac
import json
import logging
import math
import threading
import uuid

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from inference.admission import admission_error
from inference.cancel import Cancel
from inference.events import Error
from inference.handoff import HandoffRefused, Verdict
from inference.params import RequestParams
from inference.registry import PREFILL
from inference.scheduler import RequestTooLarge
from inference.sequence import SamplingParams
from inference.tools import tool_messages
from inference.worker import RequestFailed
from kvserve.chat.callbacks import handoff_refusal_record, record_safely
from kvserve.chat.metrics import (admission_rejection_count_incr, chat_metrics_decoded, chat_metrics_failed,
                                  chat_metrics_prefilled, chat_metrics_refused)
from kvserve.chat.models import ChatRequest
from kvserve.chat.routing import prefill_queue_for
from kvserve.chat.runtime import runtime_get
from kvserve.chat.salt import request_salt
from kvserve.chat.tenant_limits import tenant_admission_enforce
from kvserve.chat.tokenizer import tokenizer_get
from kvserve.deliveries import handed_done, handed_note, queued_done, queued_note
from kvserve.dispatch import decode_send, prefill_send, prefill_task_requeue
from kvserve.errors import ApiError
from kvserve.tenants.models import Tenant
from kvserve.tenants.usage import usage_refusal_counted, usage_request_done, usage_request_failed
from kvserve.workers import cancels_get, outputs_get, registry_get

log = logging.getLogger(__name__)
Status = ChatRequest.Status


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


def chat_prompt_render(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation: the model's chat template, as admission renders it (and /tokenize)."""
    return tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)


def prompt_tokenize(*, messages: list[dict] | None = None, prompt: str | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
    """POST /tokenize: the token ids admission would give these messages (or this raw prompt), the same
    rendering and encoding, so their count is the request's usage.prompt_tokens."""
    tokenizer = tokenizer_get()[0]
    text = prompt if messages is None else chat_prompt_render(tokenizer, messages, add_generation_prompt)
    return _prompt_encode(tokenizer, text)


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
    return req.request_params.sampling_params(req.max_tokens, tenant=str(req.tenant_id))


# ---- web side --------------------------------------------------------------------------------

def chat_request_create(*, api_key, messages: list[dict] | None = None, prompt: str | list[int] | None = None,
                        max_tokens: int, params: RequestParams, stream: bool = False,
                        tools: list[dict] | None = None) -> tuple[ChatRequest, list[int]]:
    """Admission before reservation, for chat (`messages`, rendered with the model's chat template, `tools` and the
    turns' tool calls and results in kvserve's tool format: inference/tools.py) and completions (`prompt`: text
    tokenized as it is, or token ids used as they are): an overlong request raises ApiError(400
    context_length_exceeded) before any row is written, any page reserved or any task queued."""
    tokenizer, _, model_name = tokenizer_get()
    token_ids = None
    if messages is not None:
        text, param, id_prefix = chat_prompt_render(tokenizer, tool_messages(messages, tools)), "messages", "chatcmpl"
    elif isinstance(prompt, str):
        text, param, id_prefix = prompt, "prompt", "cmpl"
    else:  # token ids: used as they are, hashed as their JSON
        token_ids, text, param, id_prefix = list(prompt), json.dumps(list(prompt)), "prompt", "cmpl"
    choices = params.num_sequences  # admitted as one: the prompt once and every choice's max_tokens
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
            raise _context_length_exceeded(limit, f"at least {least + choices * max_tokens}", f"at least {least}: "
                                           f"{len(text)} characters, and no token of this model covers more than "
                                           f"{per_token}", choices * max_tokens, param)
        token_ids = _prompt_encode(tokenizer, text)
    prompt_ids = token_ids
    if not prompt_ids:
        raise ApiError("The prompt is empty: it encodes to no tokens.", param=param, code="empty_prompt")
    if admission_error(len(prompt_ids), choices * max_tokens, limit) is not None:  # the engines' own rule
        raise _context_length_exceeded(limit, str(len(prompt_ids) + choices * max_tokens), str(len(prompt_ids)),
                                       choices * max_tokens, param)
    tenant = api_key.tenant
    if params.sampling.seed is None:
        params = params.with_seed(uuid.uuid4().int & (2**63 - 1))  # fixed here so any worker samples the same stream
    with usage_refusal_counted(tenant.pk), transaction.atomic():  # the tenant's row lock orders its admissions:
        tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)  # the check and the row are one step
        tenant_admission_enforce(tenant, len(prompt_ids))  # 429 over a fair share while others wait
        req = ChatRequest.objects.create(
            id=f"{id_prefix}-{uuid.uuid4().hex}", tenant=tenant, api_key=api_key, model=model_name, stream=stream,
            params=params.to_dict(), max_tokens=max_tokens, prompt_tokens=len(prompt_ids),
            prompt_hash=prompt_hash(text),
            prompt_text=json.dumps(messages if messages is not None else prompt) if tenant.store_text else None,
        )
    def enqueue():
        try:  # the stream's retention is recorded before any worker can publish its final event
            outputs_get().retain(req.id, settings.KVSERVE_STREAM_RETENTION_S if tenant.store_text
                                 else settings.KVSERVE_STREAM_REPLAY_S)
            queued_note(req.id, prompt_ids)  # sent again by the reaper if no worker ever claims it
            queue = prefill_queue_for(tenant, params.user, prompt_ids)  # prefix affinity
            prefill_send(req.id, prompt_ids, queue=queue)
        except Exception:  # broker down: the row must not sit queued forever
            chat_request_fail(req, code="backend_unavailable", message="the task queue is unreachable")
            raise

    transaction.on_commit(enqueue)
    return req, prompt_ids


def chat_request_fail(req: ChatRequest, *, code: str, message: str, status: str = Status.FAILED,
                      claim: dict | None = None, **fields) -> bool:
    """Ends a request that has not ended yet, as failed (or rejected) with `code`: the first terminal state
    wins and this one is written only if none was (and, with `claim`, only while that delivery holds the
    row). Publishes the error event (a stream keeps only its first final event: when the worker gave the request
    up, its own came first) and raises the request's cancel flag, so any worker still holding it lets go. False
    when nothing was written."""
    now = timezone.now()
    with transaction.atomic():  # the row's end and its tenant's usage: both or neither
        changed = ChatRequest.objects.filter(id=req.id, **(claim or {})).exclude(status__in=ChatRequest.FINAL).update(
            status=status, error_code=code, error_message=message, finished_at=now, **fields)
        if changed:
            usage_request_failed(req.tenant_id, req.created_at, code)
    if not changed:
        return False
    req.status, req.error_code, req.error_message, req.finished_at = status, code, message, now
    for name, value in fields.items():
        setattr(req, name, value)
    chat_metrics_failed(req, code)
    try:
        outputs_get().publish(req.id, Error(code, message))
        cancels_get().request(Cancel(req.id, code, message))
    except redis.RedisError:
        log.warning("request %s failed (%s) but Redis is unreachable: no error event or cancel flag", req.id, code)
    return True


def chat_request_cancel(request_id: str, *, code: str, message: str) -> bool:
    """The web side gives up on a request (its client left, or it stopped waiting): it ends failed with
    `code` and its worker, if any, aborts it and frees its pages."""
    req = ChatRequest.objects.filter(id=request_id).first()
    return bool(req) and chat_request_fail(req, code=code, message=message)


# ---- worker side -----------------------------------------------------------------------------
# A delivery claims its row in one conditional UPDATE; the (worker, delivery count) it wrote is its claim
# token, and every later write of that delivery is conditional on it. So a task delivered twice runs
# once, a delivery whose row was ended or taken over meanwhile writes nothing, and a redelivered prefill
# whose worker is gone may run again (bounded by KVSERVE_TASK_MAX_DELIVERIES). Decode never runs twice:
# its output has been streamed; a decode whose worker died is ended by the reaper.

def _claim(request_id: str, claimable, to_status: str, worker_field: str, counter: str, worker_id: str,
           **fields) -> ChatRequest | None:
    with transaction.atomic():
        n = ChatRequest.objects.filter(claimable, id=request_id).update(
            status=to_status, **{worker_field: worker_id, counter: F(counter) + 1}, **fields)
    return ChatRequest.objects.select_related("tenant").get(id=request_id) if n else None


def _claim_token(req: ChatRequest, worker_field: str, counter: str) -> dict:
    return {"status": req.status, worker_field: getattr(req, worker_field), counter: getattr(req, counter)}


def chat_request_prefill(request_id: str, prompt_ids: list[int]) -> None:
    runtime = runtime_get()
    if not runtime.consuming:  # quarantined: a task routed to this worker's direct queue goes to the others
        log.warning("quarantined: handing prefill of %s back to the shared queue", request_id)
        return prefill_task_requeue(request_id, prompt_ids)
    live = {w.worker_id for w in registry_get().live_workers(PREFILL)}
    # queued, or prefilling under a delivery whose worker is gone (redelivered after it died)
    orphaned = Q(status=Status.PREFILLING, handoff_verdict="") & ~Q(prefill_worker__in=live | {runtime.worker_id})
    req = _claim(request_id, Q(status=Status.QUEUED) | orphaned, Status.PREFILLING, "prefill_worker",
                 "prefill_deliveries", runtime.worker_id, prefill_started_at=timezone.now())
    if req is None:
        log.info("prefill of %s not claimed: already ended, past prefill, or held by a live delivery", request_id)
        return
    queued_done(req.id)
    if req.prefill_deliveries > settings.KVSERVE_TASK_MAX_DELIVERIES:
        return chat_request_fail(req, code="redelivery_limit",
                                 message=f"prefill was attempted {req.prefill_deliveries - 1} times without finishing")
    claim = _claim_token(req, "prefill_worker", "prefill_deliveries")
    mine = ChatRequest.objects.filter(id=req.id, **claim)
    try:
        rp = req.request_params
        handoff = runtime.prefill(req.id, prompt_ids, sampling_params(req), still_wanted=mine.exists,
                                  salt=request_salt(req.tenant, rp.user, runtime.engine.config.faults),
                                  choices=rp.num_sequences, score=rp.ranked)
    except RequestFailed as exc:
        return chat_request_fail(req, code=exc.code, message=exc.message, claim=claim)
    except Exception as exc:
        log.exception("prefill of %s failed", req.id)
        return chat_request_fail(req, code="prefill_failed", message=f"prefill failed: {type(exc).__name__}: {exc}",
                                 claim=claim)
    if handoff.verdict is Verdict.ABORTED:
        return  # the row ended or was taken over while prefilling: nothing was sent
    req.handoff_verdict, req.prefill_finished_at = handoff.verdict.value, timezone.now()
    if handoff.verdict is Verdict.REJECTED:
        chat_metrics_prefilled(req, handoff.verdict.value)
        return chat_request_fail(req, code="context_length_exceeded", message=handoff.reason, status=Status.REJECTED,
                                 claim=claim, handoff_verdict=handoff.verdict.value)
    if not mine.update(handoff_verdict=handoff.verdict.value, prefill_finished_at=req.prefill_finished_at):
        runtime.transport.discard(req.id)  # ended meanwhile: nobody will decode it
        return
    chat_metrics_prefilled(req, handoff.verdict.value, handoff.cached_tokens)
    handed_note(req.id, prompt_ids, handoff.to_dict())  # sent again by the reaper if no decode worker claims it
    decode_send(req.id, prompt_ids, handoff.to_dict())


def chat_request_decode(request_id: str, prompt_ids: list[int], handoff: dict) -> None:
    runtime = runtime_get()
    req = _claim(request_id, Q(status=Status.PREFILLING), Status.DECODING,
                 "decode_worker", "decode_deliveries", runtime.worker_id, decode_started_at=timezone.now())
    if req is None:
        log.info("decode of %s not claimed: already ended or decoding under another delivery", request_id)
        return
    handed_done(req.id)
    claim = _claim_token(req, "decode_worker", "decode_deliveries")
    runtime.metrics.arrived(req.id, req.created_at.timestamp())  # its time to first token counts from here
    try:
        rp = req.request_params
        result = runtime.decode(req.id, prompt_ids, sampling_params(req), handoff, choices=rp.num_sequences,
                                returned=rp.num_returned, score=rp.ranked)
    except HandoffRefused as refused:  # fail closed first; the incident is recorded after, whatever it does
        chat_metrics_refused(req, refused.kind)
        chat_request_fail(req, code="handoff_refused", message=f"decode refused the handoff: {refused.reason}",
                          claim=claim, decode_verdict=refused.kind[:32])
        return record_safely(handoff_refusal_record, runtime, req, refused, handoff)
    except RequestFailed as exc:
        if exc.code != "duplicate_delivery":  # the original delivery runs on: leave it alone
            chat_request_fail(req, code=exc.code, message=exc.message, claim=claim, decode_verdict="accepted")
        return
    except RequestTooLarge as exc:  # this decode pool is smaller than what admission allowed
        return chat_request_fail(req, code="context_length_exceeded", message=str(exc), claim=claim,
                                 decode_verdict="accepted")
    except Exception as exc:
        log.exception("decode of %s failed", req.id)
        return chat_request_fail(req, code="engine_error", message=f"decode failed: {type(exc).__name__}: {exc}",
                                 claim=claim, decode_verdict="accepted")
    finished = timezone.now()
    seqs = result if isinstance(result, list) else [result]  # n > 1: the returned choices, in answer order
    seq = seqs[0]
    text = seq.text if len(seqs) == 1 else json.dumps([s.text for s in seqs])
    completion_tokens = sum(len(s.output_ids) for s in seqs)
    with transaction.atomic():  # the row's end and its tenant's usage (what `usage` reports): both or neither
        done = ChatRequest.objects.filter(id=req.id, **claim).update(
            status=Status.DONE, finish_reason=seq.finish_reason or "", decode_verdict="accepted", finished_at=finished,
            transfer_ms=seq.transfer_ms, completion_tokens=completion_tokens,
            completion_text=text if req.tenant.store_text else None)
        if done:
            usage_request_done(req.tenant_id, req.created_at, prompt_tokens=req.prompt_tokens,
                               completion_tokens=completion_tokens, cached_tokens=seq.cached_tokens)
    if done:
        req.finished_at = finished
        chat_metrics_decoded(req, seq)

"""Prefix-cache scope check: canary tenant A caches a sentinel prefix (and must hit it again: the check is not
vacuous); canary tenant B's identical prompt must report cached_tokens 0, and every live prefill pool's
books (scopes, readers, leases: `check_integrity`) must show no read outside a page's scope.

Everything goes through the API's own admission, queueing, salt derivation and usage reporting."""
import time

from django.conf import settings

from incidents.canary import live
from incidents.canary.prompts import TENANT_A, TENANT_B, canary_key, new_sentinel, prompt_tokens
from incidents.canary.result import CheckResult, IncidentSpec
from inference.allocator import LedgerError
from inference.events import Delta, Done
from inference.params import RequestParams, Sampling
from kvserve.chat.models import ChatRequest
from kvserve.chat.services import chat_request_create

FILLER = "The canary reads a long and uneventful report about quarterly figures. "
FILLER_REPEATS = 8  # about 120 prompt tokens: several full pages whatever the page size up to 64
GREEDY = RequestParams(Sampling(temperature=0.0))


def sentinel_prefix_messages(sentinel: str) -> list[dict]:
    """A prompt whose very first page holds a fresh sentinel: no page of it matches anything either canary tenant
    sent before (a common head, such as the chat template's default system prompt, would be a legitimate hit
    in B's own scope)."""
    return [{"role": "system", "content": f"Canary {sentinel}. " + FILLER * FILLER_REPEATS},
            {"role": "user", "content": "Reply with one word."}]


def _ask(key, messages: list[dict], deadline: float) -> dict:
    """{"request": id, "final": its final event (Done / Error; None: timed out)} of one greedy 1-token request."""
    req, _ = chat_request_create(api_key=key, messages=messages, max_tokens=1, params=GREEDY,
                                 stream=True)
    final = None
    try:
        for event in live.outputs(int(deadline - time.monotonic()) + 1).read(
                req.id, timeout_s=max(0.5, deadline - time.monotonic())):
            if not isinstance(event, Delta):
                final = event
    except TimeoutError:
        final = None
    return {"request": req.id, "final": final}


def _cached(result: dict) -> int | None:
    final = result["final"]
    if not isinstance(final, Done):
        return None
    return final.usage.cached_tokens if final.usage else 0


def check_prefix_scope(timeout_s: float | None = None) -> CheckResult:
    started = time.perf_counter()
    deadline = time.monotonic() + (timeout_s or getattr(settings, "KVSERVE_CANARY_TIMEOUT_S", 300))
    if not live.live_workers("prefill") or not live.live_workers("decode"):
        return CheckResult.vacuous("prefix_scope", "no live prefill and decode workers to send traffic to")
    messages = sentinel_prefix_messages(new_sentinel())
    n = prompt_tokens(messages)
    a_key, b_key = canary_key(TENANT_A), canary_key(TENANT_B)
    a_first = _ask(a_key, messages, deadline)  # caches the prefix in A's scope
    a_again = [_ask(a_key, messages, deadline) for _ in range(2)]  # proves the cache works for A
    b_same = _ask(b_key, messages, deadline)  # the identical prompt from another tenant
    problems, incidents = [], []
    hits = [_cached(r) for r in a_again]
    if _cached(a_first) is None or None in hits or _cached(b_same) is None:
        problems.append(f"a request did not finish: {[r['final'] or 'timeout' for r in (a_first, *a_again, b_same)]}")
    vacuous = not any(h for h in hits if h)
    if vacuous:
        problems.append("vacuous: tenant A's repeated prompt reported no cached tokens, so a cross-tenant hit "
                        "would not have been seen either (prefix cache off, or routed to other workers)")
        incidents.append(IncidentSpec(kind="canary_leak", severity="warning", details={
            "detected_by": "canary prefix_scope", "reason": "vacuous: no same-tenant hit"}))
    if _cached(b_same):
        problems.append(f"tenant B's identical prompt reported {_cached(b_same)} cached tokens from tenant A's scope")
        worker = ChatRequest.objects.filter(id=b_same["request"]).values_list("prefill_worker", flat=True).first() or ""
        incidents.append(IncidentSpec(kind="foreign_read", worker=worker, pool=worker,
                                      reader_request=b_same["request"][:100],
                                      previous_owner_request=a_first["request"][:100], details={
                                          "detected_by": "canary prefix_scope", "cached_tokens": _cached(b_same)}))
    audits = {}
    for pool_id, ledger in live.live_pools().items():
        if ledger.role != "prefill":
            continue
        try:
            ledger.check_integrity()
            audits[pool_id] = "ok"
        except LedgerError as exc:
            audits[pool_id] = str(exc)[:500]
            if "scope" in str(exc) or "reader" in str(exc):
                problems.append(f"prefill pool {pool_id}: {exc}")
                incidents.append(IncidentSpec(kind="foreign_read", worker=pool_id, pool=pool_id, details={
                    "detected_by": "canary prefix_scope ledger audit", "problem": str(exc)[:1000]}))
    details = {"prompt_tokens": n, "problems": problems, "vacuous": vacuous,
               "a_cached_tokens": [_cached(a_first), *hits], "b_cached_tokens": _cached(b_same),
               "requests": [r["request"] for r in (a_first, *a_again, b_same)], "prefill_audits": audits}
    return CheckResult("prefix_scope", not problems, time.perf_counter() - started, details, incidents)

"""Reproduction test: the incident's trigger, sent through the API's own admission code.

A prompt longer than the effective limit (min(window, smallest live pool), from live registrations) by a
margin must be refused with 400 context_length_exceeded before anything happens: no ChatRequest row, no
page reserved in any pool, no task queued. When some pool is smaller than the window (the incident's
configuration) the prompt is sized to fit the window but not that pool."""
import time

from django.utils import timezone

from incidents.canary import live
from incidents.canary.prompts import TENANT_B, canary_key, long_messages
from incidents.canary.result import CheckResult, IncidentSpec
from inference.params import RequestParams, Sampling
from kvserve.chat.models import ChatRequest
from kvserve.chat.services import chat_request_create
from kvserve.errors import ApiError
from kvserve.workers import registry_get


def _pools_state() -> dict:
    state = {}
    for pool_id, ledger in live.live_pools().items():
        owners = {v["owner"] for v in ledger.snapshot().values() if isinstance(v, dict)}
        state[pool_id] = {"free": ledger.num_free(), "owners": owners}
    return state


def _settled(request_id: str, wait_s: float) -> ChatRequest:
    deadline = time.monotonic() + wait_s
    row = ChatRequest.objects.get(id=request_id)
    while not row.is_final and time.monotonic() < deadline:
        time.sleep(0.25)
        row.refresh_from_db()
    return row


def check_reproduction(settle_s: float = 20.0) -> CheckResult:
    started = time.perf_counter()
    limit = registry_get().effective_limit()
    workers = live.serving_workers()
    if limit is None or not workers:
        return CheckResult.vacuous("reproduction", "no live prefill and decode workers: admission has no limit to test")
    window = max(w.window for w in workers)
    smallest = min(w.capacity_tokens for w in workers)
    margin = max(64, limit // 16)
    if smallest < window and smallest + margin < window:
        target, shape = smallest + margin, "within the window, over the smallest pool (the incident)"
    else:
        target, shape = limit + margin, "over the effective limit (every pool holds the window)"
    messages, n = long_messages(target)
    key = canary_key(TENANT_B)
    since = timezone.now()
    pools_before, queues_before = _pools_state(), live.broker_queue_lengths()
    refusal = None
    try:
        chat_request_create(api_key=key, messages=messages, max_tokens=1,
                            params=RequestParams(Sampling(temperature=0.0)))
    except ApiError as exc:
        refusal = {"status": exc.status_code, "code": exc.error_code, "message": str(exc.detail)[:300]}
    pools_after, queues_after = _pools_state(), live.broker_queue_lengths()

    rows = list(ChatRequest.objects.filter(tenant=key.tenant, created_at__gte=since, prompt_tokens=n)
                .values_list("id", flat=True))
    problems, incidents = [], []
    if not refusal or refusal["status"] != 400 or refusal["code"] != "context_length_exceeded":
        problems.append(f"expected 400 context_length_exceeded, got {refusal or 'an accepted request'}")
    if rows:
        problems.append(f"ChatRequest rows were written: {rows}")
    pools_report = {}
    for pool_id, after in pools_after.items():
        before = pools_before.get(pool_id, {"free": None, "owners": set()})
        taken = sorted(o for o in after["owners"] - before["owners"] if o in rows)
        new_owners = sorted(after["owners"] - before["owners"])
        # pages taken meanwhile by other traffic are reported, not blamed: the probe's would carry its row's id
        pools_report[pool_id] = {"free_before": before["free"], "free_after": after["free"],
                                 "unchanged": before["free"] == after["free"], "new_owners": new_owners[:20]}
        if taken:
            problems.append(f"pool {pool_id} reserved pages for {taken}")
            incidents.append(IncidentSpec(kind="config_unsafe", worker=pool_id, pool=pool_id, reader_request=taken[0][:100],
                                          details={"detected_by": "canary reproduction",
                                                   "problem": "pages reserved for an overlong prompt"}))
    queued = []
    for queue, length in queues_after.items():
        if length > queues_before.get(queue, 0):
            queued += [m for m in live.broker_messages(queue, limit=length - queues_before.get(queue, 0))
                       if any(r in m["argsrepr"] for r in rows)]
    if queued:
        problems.append(f"tasks were queued for the overlong prompt: {queued[:5]}")
    # admitted anyway: the workers' own re-check must still refuse it (defence in depth); a worker that took
    # it is involved, and quarantined
    admitted = {}
    for rid in rows:
        row = _settled(rid, settle_s)
        admitted[rid] = {"status": row.status, "handoff_verdict": row.handoff_verdict,
                         "prefill_worker": row.prefill_worker, "decode_worker": row.decode_worker}
        involved = ([row.prefill_worker] if row.handoff_verdict == "OK" else []) + \
                   ([row.decode_worker] if row.status == ChatRequest.Status.DONE else [])
        for worker in dict.fromkeys(w for w in involved if w):
            problems.append(f"worker {worker} served the overlong request {rid}")
            incidents.append(IncidentSpec(kind="config_unsafe", worker=worker, pool=worker, reader_request=rid[:100],
                                          details={"detected_by": "canary reproduction", "row": admitted[rid],
                                                   "problem": "a worker's admission re-check let it through"}))
    if problems and not incidents:
        incidents.append(IncidentSpec(kind="config_unsafe", details={
            "detected_by": "canary reproduction", "problems": problems, "requests": rows, "rows": admitted}))
    return CheckResult("reproduction", not problems, time.perf_counter() - started, {
        "limit": limit, "window": window, "smallest_pool": smallest, "shape": shape,
        "prompt_tokens": n, "max_tokens": 1, "refusal": refusal, "rows": rows, "admitted": admitted,
        "pools": pools_report, "queues_before": queues_before, "queues_after": queues_after,
        "problems": problems}, incidents)

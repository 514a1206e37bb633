"""Marker test: two canary tenants' concurrent traffic through the API's own admission and queueing code
(`chat_request_create`), every output event read back from the output streams.

Tenant A's prompts each carry a fresh sentinel and ask the model to repeat it. Tenant B sends concurrent
traffic of its own (with its own sentinels), one request exactly at the effective limit (prompt +
max_tokens == limit: the whole limit is reserved in both pools) and two just over it (which must be
refused with 400 context_length_exceeded, one by prompt length and one by max_tokens).

The check fails when any response or streamed delta shows another request's sentinel, when a read
record (`OutputStream.read_records`) shows a request reading a page it did not own at its epoch or more
tokens than were written for it, when an edge request is handled wrongly, and - so that it cannot pass
vacuously - when none of A's responses shows A's own sentinel."""
import time
import uuid
from dataclasses import asdict, dataclass, field

from django.conf import settings

from inference.events import Delta, Done, OutputEvent
from inference.params import RequestParams, Sampling
from inference.sandbox import audit_read_record, normalize, sentinel_seen
from incidents.canary import live
from incidents.canary.prompts import (ECHO_MAX_TOKENS, TENANT_A, TENANT_B, canary_key, echo_messages, long_messages,
                                      new_sentinel, prompt_tokens)
from incidents.canary.result import CheckResult, IncidentSpec
from kvserve.chat.models import ChatRequest
from kvserve.chat.services import chat_request_create
from kvserve.errors import ApiError
from kvserve.workers import registry_get

@dataclass
class Probe:
    name: str
    tenant: str
    messages: list[dict]
    max_tokens: int
    expect: str  # "accept" | "refuse"
    sentinel: str = ""
    params: RequestParams = RequestParams(Sampling(temperature=0.0))
    prompt_tokens: int = 0
    request_id: str = ""
    refusal: dict | None = None
    deltas: list[str] = field(default_factory=list)
    final: OutputEvent | None = None  # its final event (Done or Error)
    timed_out_after_s: float | None = None  # no final event came: how long past the deadline reading stopped

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    def final_fields(self) -> dict:
        """Its final event (or timeout) as the check's details record it; {} when it had none."""
        if self.final is not None:
            return {"type": self.final.type, **asdict(self.final)}
        return {} if self.timed_out_after_s is None else {"type": "timeout", "after_s": self.timed_out_after_s}


def plan(limit: int, per_tenant: int = 2) -> list[Probe]:
    probes = []
    for i in range(per_tenant):
        for tenant in (TENANT_A, TENANT_B):
            s = new_sentinel()
            probes.append(Probe(f"{tenant}-echo-{i}", tenant, echo_messages(s), ECHO_MAX_TOKENS, "accept", s))
    # exactly at the limit: a short prompt whose max_tokens fills the rest (stop strings end it early)
    s = new_sentinel()
    at = Probe(f"{TENANT_B}-at-limit", TENANT_B, echo_messages(s), 0, "accept", s,
               params=RequestParams(Sampling(temperature=0.0, stop=("\n",))))
    at.prompt_tokens = prompt_tokens(at.messages)
    at.max_tokens = limit - at.prompt_tokens
    # one token over: by prompt length, and by max_tokens
    s = new_sentinel()
    messages, n = long_messages(max(1, limit - 16), sentinel=s)
    over_prompt = Probe(f"{TENANT_B}-over-by-prompt", TENANT_B, messages, limit + 1 - n, "refuse", s)
    over_prompt.prompt_tokens = n
    s = new_sentinel()
    over_max = Probe(f"{TENANT_B}-over-by-max-tokens", TENANT_B, echo_messages(s), 0, "refuse", s)
    over_max.prompt_tokens = prompt_tokens(over_max.messages)
    over_max.max_tokens = limit + 1 - over_max.prompt_tokens
    if at.max_tokens < 1 or over_prompt.max_tokens < 1 or over_max.max_tokens < 1:
        raise ValueError(f"effective limit {limit} is too small for the edge probes")
    probes[2:2] = [at]
    probes += [over_prompt, over_max]
    return probes


def _submit(probe: Probe, keys: dict) -> None:
    try:
        req, prompt_ids = chat_request_create(api_key=keys[probe.tenant], messages=probe.messages,
                                              max_tokens=probe.max_tokens, params=probe.params, stream=True)
        probe.request_id, probe.prompt_tokens = req.id, len(prompt_ids)
    except ApiError as exc:
        probe.refusal = {"status": exc.status_code, "code": exc.error_code, "message": str(exc.detail)[:200]}


def _read(probes: list[Probe], deadline: float) -> None:
    """Every event of every accepted probe (streams keep their events: reading them one after another
    loses nothing); a probe still silent at the deadline ends with a timeout."""
    stream = live.outputs(int(deadline - time.monotonic()) + 1)
    for probe in probes:
        if not probe.request_id:
            continue
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0.5:
                raise TimeoutError
            for event in stream.read(probe.request_id, timeout_s=remaining):
                if isinstance(event, Delta):
                    probe.deltas.append(event.text)
                else:
                    probe.final = event
        except TimeoutError:
            probe.timed_out_after_s = round(time.monotonic() - deadline, 1)


def _row(request_id: str, wait_s: float = 10.0) -> ChatRequest | None:
    """The request's row once decode has written its final state (it does so just after the last event)."""
    deadline = time.monotonic() + wait_s
    while True:
        row = ChatRequest.objects.filter(id=request_id).first()
        if row is None or row.is_final or time.monotonic() > deadline:
            return row
        time.sleep(0.2)


def _workers_of(request_id: str) -> list[str]:
    row = _row(request_id)
    if row is None:
        return []
    return [w for w in dict.fromkeys([row.decode_worker, row.prefill_worker]) if w]


def check_marker(timeout_s: float | None = None) -> CheckResult:
    started = time.perf_counter()
    timeout_s = timeout_s or getattr(settings, "KVSERVE_CANARY_TIMEOUT_S", 300)
    limit = registry_get().effective_limit()
    if limit is None:
        return CheckResult.vacuous("marker", "no live prefill and decode workers to send traffic to")
    keys = {TENANT_A: canary_key(TENANT_A), TENANT_B: canary_key(TENANT_B)}
    probes = plan(limit)
    for probe in probes:  # submitted back to back: the workers batch them together
        _submit(probe, keys)
    _read(probes, time.monotonic() + timeout_s)

    problems, incidents = [], []
    accepted = [p for p in probes if p.request_id]
    # edge handling
    for p in probes:
        if p.expect == "refuse":
            ok = p.refusal is not None and p.refusal["status"] == 400 and p.refusal["code"] == "context_length_exceeded"
            if not ok:
                problems.append(f"{p.name}: {p.prompt_tokens}+{p.max_tokens} tokens (limit {limit}) was not refused "
                                f"with 400 context_length_exceeded: {p.refusal or p.request_id}")
                incidents.append(IncidentSpec(kind="config_unsafe", reader_request=p.request_id[:100], details={
                    "detected_by": "canary marker", "problem": "over-limit request admitted",
                    "prompt_tokens": p.prompt_tokens, "max_tokens": p.max_tokens, "limit": limit}))
        elif p.refusal is not None:
            problems.append(f"{p.name}: {p.prompt_tokens}+{p.max_tokens} tokens (limit {limit}) was refused: {p.refusal}")
            incidents.append(IncidentSpec(kind="config_unsafe", severity="warning", details={
                "detected_by": "canary marker", "problem": "request within the limit refused", "refusal": p.refusal}))
    for p in accepted:
        if not isinstance(p.final, Done):
            problems.append(f"{p.name} ({p.request_id}) did not finish: {p.final_fields() or None}")
            incidents.append(IncidentSpec(kind="canary_leak", severity="warning", reader_request=p.request_id[:100],
                                          details={"detected_by": "canary marker",
                                                   "final_event": p.final_fields() or None}))
    # leaks: every response and every delta against every other request's sentinel
    leaks = []
    for p in accepted:
        for q in probes:
            if q is p or not q.sentinel:
                continue
            where = [i for i, d in enumerate(p.deltas) if sentinel_seen(d, q.sentinel)]
            if where or sentinel_seen(p.text, q.sentinel):
                leaks.append({"reader": p.request_id, "reader_probe": p.name, "sentinel_of": q.name,
                              "owner_request": q.request_id, "deltas": where[:10]})
    for leak in leaks:
        problems.append(f"{leak['reader_probe']} shows the sentinel of {leak['sentinel_of']}")
        for worker in _workers_of(leak["reader"]) or [""]:
            incidents.append(IncidentSpec(kind="canary_leak", worker=worker, pool=worker,
                                          reader_request=leak["reader"][:100],
                                          previous_owner_request=(leak["owner_request"] or "")[:100],
                                          details={"detected_by": "canary marker", **leak}))
    # read records: every page the request's own at its epoch, reads within writes
    ids = {p.request_id for p in accepted}
    records = {r["request"]: r for r in live.outputs().read_records(ids)}
    audits = {}
    for rid, record in records.items():
        found = audit_read_record(record)
        audits[rid] = found
        for problem in found:
            problems.append(f"read record of {rid}: {problem}")
            incidents.append(IncidentSpec(kind=problem["kind"], worker=record.get("pool", ""),
                                          pool=record.get("pool", ""), reader_request=rid[:100],
                                          pages=[problem["page"]] if "page" in problem else [],
                                          previous_owner_request=str(problem.get("owner") or "")[:100],
                                          details={"detected_by": "canary read-record audit", "problem": problem,
                                                   "record": record}))
    decoded = [p for p in accepted if isinstance(p.final, Done) and p.final.usage
               and p.final.usage.completion_tokens >= 2]
    missing = [p.request_id for p in decoded if p.request_id not in records]
    if missing:
        problems.append(f"no read record for decoded requests {missing}")
        incidents.append(IncidentSpec(kind="canary_leak", severity="warning", details={
            "detected_by": "canary read-record audit", "reason": "vacuous: read records missing", "requests": missing}))
    # not vacuous: A's own sentinel must come back to A
    a_echoes = [p for p in accepted if p.tenant == TENANT_A and normalize(p.sentinel) in normalize(p.text)]
    vacuous = not a_echoes
    if vacuous:
        problems.append("vacuous: none of tenant A's responses shows its own sentinel, so a leaked one would not "
                        "have been seen either")
        incidents.append(IncidentSpec(kind="canary_leak", severity="warning", details={
            "detected_by": "canary marker", "reason": "vacuous: tenant A's sentinels were not echoed",
            "texts": [p.text[:200] for p in accepted if p.tenant == TENANT_A]}))
    details = {
        "run": uuid.uuid4().hex[:8], "limit": limit, "problems": problems, "vacuous": vacuous,
        "echoed": {TENANT_A: len(a_echoes),
                   TENANT_B: sum(1 for p in accepted if p.tenant == TENANT_B and p.sentinel
                                 and normalize(p.sentinel) in normalize(p.text))},
        "leaks": leaks, "read_records": {rid: {"pool": r.get("pool"), "pages": len(r.get("pages", [])),
                                               "read_len": r.get("read_len"), "problems": audits.get(rid, [])}
                                         for rid, r in records.items()},
        "requests": [{"probe": p.name, "tenant": p.tenant, "request": p.request_id, "prompt_tokens": p.prompt_tokens,
                      "max_tokens": p.max_tokens, "expect": p.expect, "refusal": p.refusal,
                      "final": p.final_fields().get("type"), "finish_reason": p.final_fields().get("finish_reason"),
                      "deltas": len(p.deltas)} for p in probes],
    }
    return CheckResult("marker", not problems, time.perf_counter() - started, details, incidents)

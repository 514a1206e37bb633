"""Live probes: every live worker's own code path, over the real queues, each result naming the worker.

- handoff (each live decode worker): canary handoffs sent with the real `inference.decode` task to that worker's
  probe queue — a REJECTED verdict with KV present, fewer tokens transferred than expected, a signature made
  with another key, a valid handoff of another canary request replayed onto this one, a KV blob swapped for
  another request's — each must be refused by that worker (its row's decode_worker and decode_verdict, no
  content event, the probe record its handoff refusal wrote); one correct handoff must be accepted and answered.
- guard and scrub (every live worker): `kvserve.probe` on the worker's probe queue runs inference.probes in its
  engine loop, on canary-owned pages of its real pool and ledger.
Probes travel in each worker's probe lane (kvserve/probe_lane.py: a consumer and threads of their own, and the
engine's page reserve for canary-probe requests), so a worker whose every Celery thread is busy is still judged.
Each probe's outcome (incidents/canary/result.py): passed; wrong where the worker answered wrongly (critical,
quarantine); not judged where it did not answer (not taken, timed out, busy, unreachable: a warning)."""
import time
import uuid
from dataclasses import replace

import torch
from django.conf import settings

from incidents.canary import live
from incidents.canary.prompts import TENANT_B, canary_key
from incidents.canary.result import NOT_JUDGED, PASSED, SEVERITY, WRONG, CheckResult, IncidentSpec, outcome_worst
from inference.handoff import KV_DTYPES, Handoff, Verdict, blob_metadata
from inference.kv_cache import cdiv, page_checksums
from inference.params import RequestParams, Sampling
from inference.probes import CANARY_PROBE_PREFIX, ProbeRecords
from inference.transport import RedisTransport
from kvserve.chat.models import ChatRequest
from kvserve.chat.runtime import handoff_key
from kvserve.dispatch import decode_send, probe_queue, probe_send
from kvserve.workers import redis_get

# case -> the decode_verdict the worker must record ("accepted" for the control)
HANDOFF_CASES = {"valid": "accepted", "rejected_kv": "rejected", "truncated": "handoff_mismatch",
                 "other_key": "handoff_forged", "replayed": "handoff_mismatch", "swapped_blob": "handoff_mismatch"}
INCIDENT_KIND = {"handoff": "handoff_mismatch", "guard": "foreign_read", "scrub": "canary_leak"}
# a probe record whose reason starts so gives no verdict (inference.probes: busy, unproven; probe_run: the rest)
NO_VERDICT = ("busy", "unproven", "unreachable", "timed out", "error")


def _blob(pages: int, w) -> torch.Tensor:
    gen = torch.Generator().manual_seed(time.time_ns() % 2**31)
    return (torch.randn(pages, *w.page_shape, generator=gen) * 0.1).to(KV_DTYPES.get(w.dtype, torch.float32))


def _handoff(rid: str, w, blob: torch.Tensor, tokens: int, key: bytes, **changes) -> Handoff:
    h = Handoff(request_id=rid, verdict=Verdict.OK, reason="", expected_tokens=tokens, transferred_tokens=tokens,
                num_pages=blob.shape[0], page_checksums=tuple(page_checksums(blob)),
                page_epochs=tuple(range(1, blob.shape[0] + 1)), model_fingerprint=w.model_fingerprint,
                page_size=w.page_size, dtype=w.dtype, prefill_worker="canary-probe", first_token=1,
                **blob_metadata(blob))
    return replace(h, **changes).signed(key)


def _handoff_cases(run: str, w, key: bytes) -> list[dict]:
    """Per case: the task's request id, the handoff on the task, and what is stored in the transport under which id."""
    tokens = 2 * w.page_size + 3
    pages = cdiv(tokens, w.page_size)
    rid = lambda case: f"{CANARY_PROBE_PREFIX}{case[:8]}-{run}-{w.worker_id[-4:]}"  # noqa: E731
    out = []
    b = _blob(pages, w)
    out.append({"case": "valid", "rid": rid("valid"), "handoff": _handoff(rid("valid"), w, b, tokens, key),
                "stored": [(rid("valid"), b)]})
    b1 = _blob(1, w)  # prefill refused it, but sent a placeholder page anyway (the incident's handoff)
    h = _handoff(rid("rejected_kv"), w, b1, tokens, key, verdict=Verdict.REJECTED, reason="canary: does not fit",
                 transferred_tokens=1)
    out.append({"case": "rejected_kv", "rid": rid("rejected_kv"), "handoff": h, "stored": [(rid("rejected_kv"), b1)]})
    b = _blob(1, w)
    h = _handoff(rid("truncated"), w, b, tokens, key, transferred_tokens=w.page_size)
    out.append({"case": "truncated", "rid": rid("truncated"), "handoff": h, "stored": [(rid("truncated"), b)]})
    b = _blob(pages, w)
    h = _handoff(rid("other_key"), w, b, tokens, uuid.uuid4().hex.encode())
    out.append({"case": "other_key", "rid": rid("other_key"), "handoff": h, "stored": [(rid("other_key"), b)]})
    b = _blob(pages, w)  # a valid handoff (and KV) of another canary request, on this request's task
    source = rid("replsrc")
    out.append({"case": "replayed", "rid": rid("replayed"), "handoff": _handoff(source, w, b, tokens, key),
                "stored": [(source, b)]})
    mine, other = _blob(pages, w), _blob(pages, w)  # this request's handoff, another request's KV in its place
    h = _handoff(rid("swapped_blob"), w, mine, tokens, key)
    out.append({"case": "swapped_blob", "rid": rid("swapped_blob"), "handoff": h, "stored": [(rid("swapped_blob"), other)]})
    for c in out:
        c["prompt_ids"] = list(range(1, tokens + 1))
    return out


def _send_handoff_probe(w, cases: list[dict], transport: RedisTransport, tenant) -> None:
    for c in cases:
        ChatRequest.objects.create(id=c["rid"], tenant=tenant, status=ChatRequest.Status.PREFILLING, model="canary-probe",
                                   max_tokens=4, prompt_tokens=len(c["prompt_ids"]), prompt_hash="canary-probe",
                                   handoff_verdict=Verdict.OK.value,
                                   params=RequestParams(Sampling(temperature=0.0, seed=0)).to_dict())
        for stored_id, blob in c["stored"]:
            h = c["handoff"] if stored_id == c["handoff"].request_id else replace(c["handoff"], request_id=stored_id)
            transport.send(h, blob)
        decode_send(c["rid"], c["prompt_ids"], c["handoff"].to_dict(), queue=probe_queue(w.node))


def _events(outputs, rid: str, timeout_s: float) -> list[str]:
    """The types of the output events `rid` has published so far (up to its final one)."""
    types = []
    try:
        for e in outputs.read(rid, timeout_s=timeout_s):
            types.append(e.type)
    except TimeoutError:
        pass
    return types


def _handoff_outcome(case: str, row, events: list[str], record: dict, worker_id: str) -> tuple[str, str]:
    """(outcome, why) of one handoff case: not judged unless this worker answered it; wrong only where it did,
    wrongly (accepted or answered a bad handoff, refused the valid one, refused for another reason)."""
    if row is None or not row.decode_worker:
        return NOT_JUDGED, "unreachable: the worker did not take the probe before the deadline"
    if row.decode_worker != worker_id:
        return NOT_JUDGED, f"unreachable: the probe was taken by {row.decode_worker}, not this worker"
    expected = HANDOFF_CASES[case]
    if expected == "accepted":
        if not row.is_final:
            return NOT_JUDGED, "timed out: the valid handoff was accepted and is still decoding"
        if row.status == ChatRequest.Status.DONE and row.completion_tokens >= 1 and "done" in events:
            return PASSED, ""
        if row.status == ChatRequest.Status.FAILED and row.error_code != "handoff_refused":
            return NOT_JUDGED, f"timed out: the valid handoff was accepted and ended {row.error_code}"
        if row.status == ChatRequest.Status.FAILED and row.decode_verdict == "kv_missing":
            # its KV was gone when the worker looked (a transport read whose reply a Redis blip lost): no
            # verdict on the handoff itself
            return NOT_JUDGED, "unreachable: the valid handoff's KV was gone from the transport"
        return WRONG, "the valid handoff was not answered"
    if "delta" in events:
        return WRONG, "content was published for a handoff that must be refused"
    if not row.is_final:
        return NOT_JUDGED, "timed out: taken and not answered before the deadline"
    if not (row.status == ChatRequest.Status.FAILED and row.error_code == "handoff_refused"
            and row.decode_verdict == expected):
        return WRONG, f"expected a {expected} refusal"
    if not record:
        return NOT_JUDGED, "unreachable: refused, but the worker's probe record is missing"
    if record.get("worker") != worker_id or record.get("refused") != expected:
        return WRONG, f"the probe record shows {record.get('refused')} by {record.get('worker')}"
    return PASSED, ""


def _judge_handoff(w, cases: list[dict], records: dict, outputs, seen: dict | None = None) -> dict:
    """`seen`: rid -> the events read when its row ended (a stream outlives its final event by the replay window
    only, and the check may wait long past that for another case's answer)."""
    results = {}
    for c in cases:
        row = ChatRequest.objects.filter(id=c["rid"]).first()
        got = {"status": row.status, "decode_worker": row.decode_worker, "decode_verdict": row.decode_verdict,
               "error_code": row.error_code, "completion_tokens": row.completion_tokens} if row else {}
        events = (seen or {}).get(c["rid"])
        if events is None:
            events = _events(outputs, c["rid"], 1 if row and row.is_final else 0.2) if row and row.decode_worker else []
        record = records.get(c["rid"]) or {}
        if HANDOFF_CASES[c["case"]] != "accepted":
            got["record"] = record
        outcome, why = _handoff_outcome(c["case"], row, events, record, w.worker_id)
        results[c["case"]] = {"expected": HANDOFF_CASES[c["case"]], "got": got, "events": events,
                              "ok": outcome == PASSED, "outcome": outcome, **({"reason": why} if why else {})}
    return results


def _probe_outcome(record: dict | None, worker_id: str, reachable: bool, wait_s: float) -> dict:
    """A guard or scrub probe's record judged: passed, wrong, or not judged (no answer, or an answer that
    says it could not prove anything)."""
    if record is None:
        reason = f"unreachable: no answer from this worker within {wait_s:.0f}s" if reachable \
            else "unreachable: no probe queue"
        return {"ok": False, "outcome": NOT_JUDGED, "reason": reason}
    ok = bool(record.get("ok")) and record.get("worker") == worker_id
    no_verdict = str(record.get("reason", "")).startswith(NO_VERDICT)
    return {**record, "ok": ok, "outcome": PASSED if ok else NOT_JUDGED if no_verdict else WRONG}


def _handoff_check(w, cases: dict) -> dict:
    if not cases:
        return {"ok": False, "outcome": NOT_JUDGED, "cases": {}, "reason": "unreachable: no probe queue"}
    outcome = outcome_worst(c["outcome"] for c in cases.values())
    return {"ok": outcome == PASSED, "outcome": outcome, "cases": cases}


def all_answered(probe_ids: list[str], handoff_ids: list[str], records: dict, rows: dict) -> bool:
    """Whether every probe has its answer: a record for each guard and scrub probe, each handoff row final, and
    the record of each refusal (the worker fails the row closed first, then writes the record)."""
    if not all(p in records for p in probe_ids):
        return False
    for rid in handoff_ids:
        status, code = rows.get(rid, ("", ""))
        if status not in ChatRequest.FINAL or (code == "handoff_refused" and rid not in records):
            return False
    return True


def check_live_probes(wait_s: float | None = None, key: bytes | None = None) -> CheckResult:
    started = time.perf_counter()
    workers = live.serving_workers()
    decoders = [w for w in workers if w.role == "decode"]
    if not decoders or not any(w.role == "prefill" for w in workers):
        return CheckResult.vacuous("live_probes", "no live prefill and decode workers to probe")
    wait_s = wait_s or max(5.0, min(120.0, settings.KVSERVE_CANARY_CHECK_TIMEOUT_S - 10))
    r = redis_get()
    prefix = live.prefix()
    records_store, transport = ProbeRecords(r, prefix), RedisTransport(r, prefix, ttl_s=int(wait_s) + 60)
    key, run, tenant = key or handoff_key(), uuid.uuid4().hex[:8], canary_key(TENANT_B).tenant
    sent: dict[str, dict] = {}  # worker -> {"probes": {name: id}, "handoff": cases}
    for w in workers:
        entry = sent[w.worker_id] = {"worker": w, "probes": {}, "handoff": []}
        if not w.node:
            continue  # no probe queue: unreachable, not judged below
        for name in ("guard", "scrub"):
            pid = entry["probes"][name] = f"{CANARY_PROBE_PREFIX}{name}-{run}-{w.worker_id[-4:]}"
            probe_send(name, pid, node=w.node)
        if w.role == "decode":
            entry["handoff"] = _handoff_cases(run, w, key)
            _send_handoff_probe(w, entry["handoff"], transport, tenant)
    probe_ids = [p for e in sent.values() for p in e["probes"].values()]
    handoff_ids = [c["rid"] for e in sent.values() for c in e["handoff"]]
    deadline = time.monotonic() + wait_s
    outputs, seen = live.outputs(2), {}  # seen: rid -> its events, read once its row is final
    while time.monotonic() < deadline:
        records = records_store.get_many(probe_ids + handoff_ids)
        rows = {rid: (status, code) for rid, status, code in
                ChatRequest.objects.filter(id__in=handoff_ids).values_list("id", "status", "error_code")}
        for rid, (status, _) in rows.items():
            if status in ChatRequest.FINAL and rid not in seen:
                seen[rid] = _events(outputs, rid, 1)
        if all_answered(probe_ids, handoff_ids, records, rows):
            break
        time.sleep(0.25)
    records = records_store.get_many(probe_ids + handoff_ids)
    report, incidents = {}, []
    for worker_id, e in sent.items():
        w = e["worker"]
        checks = {name: _probe_outcome(records.get(e["probes"].get(name, "")), worker_id, bool(w.node), wait_s)
                  for name in ("guard", "scrub")}
        if w.role == "decode":
            checks["handoff"] = _handoff_check(w, _judge_handoff(w, e["handoff"], records, outputs, seen)
                                               if w.node else {})
        failed = [n for n, c in checks.items() if c["outcome"] != PASSED]
        outcome = outcome_worst(c["outcome"] for c in checks.values())
        report[worker_id] = {"role": w.role, "passed": not failed, "outcome": outcome, "failed": failed,
                             "checks": checks}
        for name in failed:
            wrong = checks[name]["outcome"] == WRONG
            incidents.append(IncidentSpec(
                kind=INCIDENT_KIND[name] if wrong else "canary_leak", severity=SEVERITY[checks[name]["outcome"]],
                worker=worker_id, pool=worker_id,
                details={"detected_by": f"canary live {name} probe", "probe": name, "outcome": checks[name]["outcome"],
                         "result": checks[name]}))
    for c in (c for e in sent.values() for c in e["handoff"]):
        for stored_id, _ in c["stored"]:
            transport.discard(stored_id)
    return CheckResult("live_probes", not incidents, time.perf_counter() - started,
                       {"workers": report, "run": run}, incidents)

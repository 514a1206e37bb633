"""The prefill->decode handoff contract, checked against the code decode runs: for every live decode
worker, handoffs are built and signed with the deployment's handoff key, a real blob goes through
`RedisTransport` under a canary request id, and each is taken through what `WorkerRuntime.decode` does
before it reserves a page (the task's JSON round trip, then `inference.handoff.handoff_accept` with the
worker's fingerprint, page size, dtype and fault configuration, pulling the blob from `RedisTransport`).

A valid handoff must be accepted (else the check proves nothing); REJECTED, truncated, bad-checksum,
bad-signature, stale-epoch, replayed-onto-another-request and mislabelled-blob handoffs must each be refused
with the right kind."""
import json
import time
import uuid
from dataclasses import replace

import torch

from inference.arith import cdiv
from inference.handoff import DecodeSide, Handoff, HandoffRefused, Verdict, handoff_accept
from inference.handoff import blob_metadata
from inference.kv_cache import page_checksums
from inference.transport import RedisTransport
from incidents.canary import live
from incidents.canary.result import CheckResult, IncidentSpec
from kvserve.chat.runtime import handoff_key
from kvserve.workers import redis_get

# case -> the refusal kind decode must answer with ("accepted" for the control)
EXPECTED = {
    "valid": "accepted",
    "rejected": "rejected",
    "truncated": "handoff_mismatch",
    "bad_checksum": "handoff_mismatch",
    "bad_signature": "handoff_forged",
    "stale_epoch": "stale_epoch",
    "wrong_request": "handoff_mismatch",
    "blob_dtype": "handoff_mismatch",
}
# the incident kind when a case is wrongly accepted (or refused for the wrong reason)
INCIDENT_KIND = {"rejected": "handoff_mismatch", "truncated": "handoff_mismatch", "bad_checksum": "handoff_mismatch",
                 "bad_signature": "handoff_forged", "stale_epoch": "stale_epoch",
                 "wrong_request": "handoff_mismatch", "blob_dtype": "handoff_mismatch"}


def _blob(num_pages: int, page_size: int, dtype: str) -> torch.Tensor:
    """A small real page blob: [pages, layers=1, K/V, page_size, kv_heads=1, head_dim=4]."""
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
    return torch.randn(num_pages, 1, 2, page_size, 1, 4, generator=gen).to(getattr(torch, dtype, torch.float32))


def _cases(run: str, worker, key: bytes) -> list[tuple[str, Handoff, Handoff, torch.Tensor, str]]:
    """(case, handoff sent with the blob, handoff decode receives, blob, the task's request id) per case."""
    ps, dtype = worker.page_size, worker.dtype
    expected = 2 * ps + 3
    pages = cdiv(expected, ps)

    def handoff(case, verdict=Verdict.OK, transferred=expected, num_pages=pages, blob=None, epochs=None, reason=""):
        blob = _blob(num_pages, ps, dtype) if blob is None else blob
        epochs = tuple(epochs or range(1000, 1000 + num_pages))
        h = Handoff(request_id=f"canary-hc-{run}-{case}", verdict=verdict, reason=reason, expected_tokens=expected,
                    transferred_tokens=transferred, num_pages=num_pages, page_checksums=tuple(page_checksums(blob)),
                    page_epochs=epochs, model_fingerprint=worker.model_fingerprint, page_size=ps, dtype=dtype,
                    prefill_worker="canary", first_token=0, **blob_metadata(blob)).signed(key)
        return h, blob

    out = []
    h, blob = handoff("valid")
    out.append(("valid", h, h, blob))
    # prefill refused the prompt but sent a placeholder page anyway (the incident's handoff)
    h, blob = handoff("rejected", verdict=Verdict.REJECTED, transferred=1, num_pages=1, reason="canary: does not fit")
    out.append(("rejected", h, h, blob))
    h, blob = handoff("truncated", transferred=ps, num_pages=1)
    out.append(("truncated", h, h, blob))
    h, blob = handoff("bad_checksum")
    tampered = list(h.page_checksums)
    tampered[-1] = ("0" if tampered[-1][0] != "0" else "1") + tampered[-1][1:]
    out.append(("bad_checksum", h, replace(h, page_checksums=tuple(tampered)).signed(key), blob))
    h, blob = handoff("bad_signature")
    out.append(("bad_signature", h, h.signed(uuid.uuid4().hex.encode()), blob))
    h, blob = handoff("stale_epoch")
    stale = replace(h, page_epochs=tuple(e + 1 if i == 0 else e for i, e in enumerate(h.page_epochs))).signed(key)
    out.append(("stale_epoch", h, stale, blob))
    # a valid handoff of another canary request, delivered on this request's task (replay)
    h, blob = handoff("replayed-source")
    out.append(("wrong_request", h, h, blob))
    # the blob's dtype is not the signed one (same bytes, relabelled)
    h, blob = handoff("blob_dtype")
    out.append(("blob_dtype", h, replace(h, blob_dtype="float64").signed(key), blob))
    return [(case, sent, got, blob, f"canary-hc-{run}-{case}") for case, sent, got, blob in out]


def decode_side(message: dict, key: bytes, worker, transport: RedisTransport, request_id: str) -> torch.Tensor:
    """What a decode worker does with a handoff before it reserves pages: the task's JSON round trip, then the
    one acceptance rule (inference.handoff.handoff_accept) with that worker's geometry and fault configuration."""
    side = DecodeSide(request_id, json.loads(json.dumps(message)).get("expected_tokens", -1),
                      worker.model_fingerprint, worker.page_size, worker.dtype)
    _, blob = handoff_accept(json.loads(json.dumps(message)), key, side, transport.take,
                             check="no_handoff_check" not in worker.faults)
    return blob


def check_handoff_contract(key: bytes | None = None) -> CheckResult:
    started = time.perf_counter()
    key = key or handoff_key()
    workers = live.live_workers("decode")
    if not workers:
        return CheckResult.vacuous("handoff_contract", "no live decode worker to take its fingerprint and page size from")
    transport = RedisTransport(redis_get(), prefix=live.prefix(), ttl_s=60)
    run = uuid.uuid4().hex[:8]
    report, incidents, vacuous = {}, [], []
    for worker in workers:
        results = {}
        for case, sent, received, blob, task_request in _cases(f"{run}-{worker.worker_id[-4:]}", worker, key):
            try:
                transport.send(sent, blob)
                try:
                    got = decode_side(received.to_dict(), key, worker, transport, task_request)
                    outcome = "accepted" if torch.equal(got, blob) else "accepted_corrupt"
                except HandoffRefused as refused:
                    outcome = refused.kind
            finally:
                transport.discard(sent.request_id)
            results[case] = {"expected": EXPECTED[case], "got": outcome, "ok": outcome == EXPECTED[case]}
        report[worker.worker_id] = {"check_enabled": "no_handoff_check" not in worker.faults, "cases": results}
        if not results["valid"]["ok"]:
            vacuous.append(worker.worker_id)
        wrong = [c for c, r in results.items() if c != "valid" and not r["ok"]]
        if wrong:
            incidents.append(IncidentSpec(
                kind=INCIDENT_KIND[wrong[0]], worker=worker.worker_id, pool=worker.worker_id,
                details={"detected_by": "canary handoff contract", "wrongly_handled": {c: results[c] for c in wrong},
                         "faults": list(worker.faults)}))
    for worker_id in vacuous:
        incidents.append(IncidentSpec(kind="handoff_mismatch", severity="warning", worker=worker_id, pool=worker_id,
                                      details={"reason": "a valid handoff was refused: decode refuses everything, "
                                                         "so the contract check proves nothing",
                                               "result": report[worker_id]["cases"]["valid"]}))
    return CheckResult("handoff_contract", not incidents, time.perf_counter() - started,
                       {"workers": report, "request_prefix": f"canary-hc-{run}"}, incidents)

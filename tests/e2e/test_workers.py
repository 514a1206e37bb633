"""Real Celery worker processes: killed mid-generation, fed bad handoffs, misconfigured pools."""
import json
import signal
import time

from inference.events import Delta, Error
from inference.ledger import RedisLedger
from inference.streams import OutputStream

SHELL_SUBMIT = """
import json
from django.db import transaction
from inference.params import RequestParams, Sampling
from kvserve.chat.services import chat_request_create
from kvserve.tenants.services import api_key_create
key, _ = api_key_create("e2e")
with transaction.atomic():
    req, ids = chat_request_create(api_key=key, messages=[{"role": "user", "content": "Tell me a long story about a dragon."}],
                                   max_tokens=400, params=RequestParams(Sampling(temperature=0.0)))
print(json.dumps({"id": req.id}))
"""

SHELL_BAD_HANDOFFS = """
import dataclasses, json, time
from inference.handoff import Handoff, Verdict
from kvserve.chat.models import ChatRequest
from kvserve.chat.runtime import handoff_key
from kvserve.chat.tasks import decode
from kvserve.tenants.models import Tenant
from kvserve.workers import registry_get
tenant, _ = Tenant.objects.get_or_create(name="bad-handoffs")
(w,) = registry_get().live_workers("decode")
key = handoff_key()
base = Handoff(request_id="", verdict=Verdict.OK, reason="", expected_tokens=40, transferred_tokens=40, num_pages=3,
               page_checksums=("0" * 16,) * 3, page_epochs=(1, 2, 3), model_fingerprint=w.model_fingerprint,
               page_size=w.page_size, dtype=w.dtype, prefill_worker="prefill-x", first_token=5)
cases = {
    "forged": dataclasses.replace(base, request_id="bad-forged").signed(b"not-the-key"),
    "truncated": dataclasses.replace(base, request_id="bad-trunc", transferred_tokens=1).signed(key),
    "rejected": dataclasses.replace(base, request_id="bad-rej", verdict=Verdict.REJECTED, reason="prompt too long",
                                    transferred_tokens=0, num_pages=0, page_checksums=(), page_epochs=()).signed(key),
}
for h in cases.values():
    ChatRequest.objects.create(id=h.request_id, tenant=tenant, status="prefilling", model="m", max_tokens=8,
                               prompt_tokens=40, prompt_hash="x")
    decode.delay(h.request_id, list(range(40)), h.to_dict())
deadline = time.time() + 60
while time.time() < deadline and ChatRequest.objects.filter(id__startswith="bad-", status="prefilling").exists():
    time.sleep(0.2)
from incidents.models import Incident
print(json.dumps({
    "rows": {r.id: [r.status, r.decode_verdict, r.error_code] for r in ChatRequest.objects.filter(id__startswith="bad-")},
    "incidents": sorted([i.kind, i.reader_request] for i in Incident.objects.filter(reader_request__startswith="bad-")),
}))
"""


REAP_ROUNDS = """
import json, time
from kvserve.chat.reaper import requests_reap_orphans
for _ in range(%d):
    print(json.dumps(requests_reap_orphans()))
    time.sleep(0.5)
"""


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_bad_handoffs_on_the_decode_queue_fail_closed(own_stack):
    stack = own_stack.start()
    out = last_json(stack.manage("shell", "-c", SHELL_BAD_HANDOFFS))
    assert out["rows"] == {
        "bad-forged": ["failed", "handoff_forged", "handoff_refused"],
        "bad-trunc": ["failed", "handoff_mismatch", "handoff_refused"],
        "bad-rej": ["failed", "rejected", "handoff_refused"],
    }
    assert out["incidents"] == [["handoff_forged", "bad-forged"], ["handoff_mismatch", "bad-trunc"]]
    outputs = OutputStream(stack.redis, stack.prefix)
    for rid in out["rows"]:
        (event,) = list(outputs.read(rid, timeout_s=5))
        assert event == Error("handoff_refused", event.message)
    (w,) = stack.registry().live_workers("decode")
    assert RedisLedger(stack.redis, w.worker_id, prefix=stack.prefix).num_free() == w.num_pages  # nothing taken


def test_sigkill_of_the_decode_worker_fails_the_request_and_the_reaper_reclaims_its_pages(own_stack):
    stack = own_stack.start()
    (decoder,) = stack.registry().live_workers("decode")
    rid = last_json(stack.manage("shell", "-c", SHELL_SUBMIT))["id"]
    outputs = OutputStream(stack.redis, stack.prefix)
    first = next(outputs.read(rid, timeout_s=60))
    assert isinstance(first, Delta)  # decoding is under way
    ledger = RedisLedger(stack.redis, decoder.worker_id, prefix=stack.prefix)
    assert ledger.pages_of(rid)  # the request holds decode pages right now
    stack.stop("decode", sig=signal.SIGKILL)
    time.sleep(4)  # past the 3 s registration
    rounds = [last_json(r) for r in stack.manage("shell", "-c", REAP_ROUNDS % 5).strip().splitlines()[-5:]]
    # gone = not registered and no beat between two rounds: the second round fails its request
    assert rid not in rounds[0]["failed_requests"] and rid in rounds[1]["failed_requests"]
    pools = [next(p for p in r["pools"] if p["pool"] == decoder.worker_id) for r in rounds[:4]]
    assert [p.get("retired", False) for p in pools] == [False, False, False, True]  # after 3 silent rounds
    assert pools[3]["integrity"] == "ok" and not any(p["pool"] == decoder.worker_id for p in rounds[4]["pools"])
    events = list(outputs.read(rid, timeout_s=5))
    assert isinstance(events[-1], Error) and events[-1].code == "worker_lost"
    status = stack.manage("shell", "-c", f"from kvserve.chat.models import ChatRequest as C; print(C.objects.get(id='{rid}').status)")
    assert status.strip().splitlines()[-1] == "failed"


def test_a_worker_whose_pool_is_smaller_than_its_window_does_not_start(own_stack):
    stack = own_stack
    stack.manage("migrate", "--noinput")
    proc = stack.start_worker("decode", KVSERVE_NUM_PAGES="64", KVSERVE_WINDOW="8192")
    assert proc.wait(timeout=120) != 0
    assert "KVSERVE_NUM_PAGES >= 512" in stack.tail("decode")
    assert stack.registry().live_workers() == []
    stack.start_worker("decode", name="clamped", KVSERVE_NUM_PAGES="64", KVSERVE_WINDOW="8192",
                       KVSERVE_CLAMP_WINDOW="1")
    (w,) = stack.wait_workers("decode", 1)
    assert (w.capacity_tokens, w.window) == (1024, 1024)

"""A request's terminal state and the reaper, against the real database and Redis: the first terminal state
wins (and raises the request's cancel flag), a worker is gone only when it is unregistered and silent for a
whole reaper round, the reaper never marks a page clean and retires a gone worker's pool only after three
silent rounds, and a request no worker took ends `queue_timeout`."""
from datetime import timedelta

import pytest
from django.utils import timezone

from inference.cancel import Cancellations
from inference.events import Error, event_decode, is_final
from inference.ledger import RedisLedger
from inference.streams import OutputStream
from kvserve.chat.models import ChatRequest
from kvserve.chat.reaper import requests_reap_orphans
from kvserve.chat.services import chat_request_cancel, chat_request_fail
from kvserve.tenants.models import Tenant
from tests.incidents.helpers import chat_request, live_worker

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


@pytest.fixture
def tenant():
    return Tenant.objects.create(name="acme")


def test_the_first_terminal_state_wins_and_raises_the_cancel_flag(tenant, registry_redis, registry_prefix):
    req = chat_request(tenant, status="decoding")
    assert chat_request_fail(req, code="client_disconnected", message="gone")
    assert not chat_request_fail(req, code="worker_lost", message="later")  # it had ended already
    assert not chat_request_cancel(req.id, code="timeout", message="later still")
    stored = ChatRequest.objects.get(id=req.id)
    assert (stored.status, stored.error_code) == ("failed", "client_disconnected")
    (cancel,) = Cancellations(registry_redis, registry_prefix).pending([req.id])
    assert cancel.code == "client_disconnected"
    events = list(OutputStream(registry_redis, registry_prefix).read(req.id, timeout_s=2))
    assert [e.code for e in events] == ["client_disconnected"]


def test_a_finished_request_is_never_failed_afterwards(tenant, registry_redis, registry_prefix):
    req = chat_request(tenant, status="done")
    assert not chat_request_cancel(req.id, code="client_disconnected", message="hung up after the answer")
    assert ChatRequest.objects.get(id=req.id).status == "done"
    assert Cancellations(registry_redis, registry_prefix).pending([req.id]) == []


def test_a_worker_is_gone_only_when_unregistered_and_silent_for_a_whole_round(tenant, registry, make_worker):
    decode = live_worker(registry, make_worker, "decode", worker_id="decode-1")
    grant = decode.allocate("r-held", 2)
    req = chat_request(tenant, status="decoding", decode_worker="decode-1")
    assert requests_reap_orphans()["failed_requests"] == []  # registered
    registry.heartbeat("decode-1")
    registry.unregister("decode-1")  # then its registration lapses (a pause, or a step of Redis' clock)
    assert requests_reap_orphans()["failed_requests"] == []  # not registered, but it beat since the last round
    report = requests_reap_orphans()  # not registered and no beat for a whole round: gone
    assert report["failed_requests"] == [req.id]
    assert ChatRequest.objects.get(id=req.id).error_code == "worker_lost"
    assert decode.pages_of("r-held") == dict(zip(grant.pages, grant.epochs))  # its pages are left alone


def test_a_gone_workers_pool_is_retired_after_three_silent_rounds_and_never_marked_clean(registry, make_worker):
    decode = live_worker(registry, make_worker, "decode", worker_id="decode-2")
    decode.allocate("r", 3)
    decode.reap_expired(now_ms=10**15)  # dirty pages: only their own worker may scrub them
    registry.unregister("decode-2")
    rounds = [next(p for p in requests_reap_orphans()["pools"] if p["pool"] == "decode-2") for _ in range(4)]
    assert [r["silent_rounds"] for r in rounds] == [0, 1, 2, 3]
    assert [r.get("retired", False) for r in rounds] == [False, False, False, True]
    assert rounds[3]["integrity"] == "ok"
    assert not registry.redis.exists(decode.key("meta"))  # deleted, never freed unscrubbed


def test_a_live_workers_pool_with_dirty_pages_is_left_to_its_worker(registry, make_worker):
    decode = live_worker(registry, make_worker, "decode", worker_id="decode-3")
    decode.allocate("r", 3)
    decode.reap_expired(now_ms=10**15)
    for _ in range(4):
        registry.heartbeat("decode-3")
        requests_reap_orphans()
    assert RedisLedger(registry.redis, "decode-3", prefix=registry.prefix).snapshot()[0] == "dirty"


def test_a_request_no_worker_took_ends_queue_timeout(tenant, settings, registry):
    settings.KVSERVE_QUEUE_TIMEOUT_S = 60
    old = chat_request(tenant)
    ChatRequest.objects.filter(id=old.id).update(created_at=timezone.now() - timedelta(seconds=61))
    waiting = chat_request(tenant, status="prefilling", handoff_verdict="OK",
                           prefill_finished_at=timezone.now() - timedelta(seconds=61), prefill_worker="prefill-gone")
    fresh = chat_request(tenant)
    report = requests_reap_orphans()
    assert sorted(report["timed_out_requests"]) == sorted([old.id, waiting.id])
    assert report["failed_requests"] == []  # prefilled: decode's queue holds it, not the prefill worker
    assert ChatRequest.objects.get(id=old.id).error_code == "queue_timeout"
    assert ChatRequest.objects.get(id=fresh.id).status == "queued"


@pytest.fixture
def worker_pair(registry_redis, registry_prefix, tiny_model, monkeypatch):
    """A prefill runtime and a decode runtime whose pool is smaller than the prefill's window, the decode one
    installed as this process's runtime (what a decode worker process has)."""
    from inference.engine import EngineConfig
    from inference.worker import RuntimeOptions, WorkerRuntime
    from kvserve.chat import runtime as runtime_module

    options = RuntimeOptions(prefix=registry_prefix)
    key = b"k" * 32
    prefill = WorkerRuntime("prefill", registry_redis, key, model=tiny_model, options=options,
                            config=EngineConfig(num_pages=64, window=1024))
    decode = WorkerRuntime("decode", registry_redis, key, model=tiny_model, options=options,
                           config=EngineConfig(num_pages=8, window=128))
    monkeypatch.setitem(runtime_module._runtime, "current", decode)
    yield prefill, decode
    prefill.stop()
    decode.stop()


def test_a_decode_that_can_never_fit_ends_its_request_with_an_error_event(tenant, worker_pair, registry_redis,
                                                                           registry_prefix):
    from inference.sequence import SamplingParams
    from kvserve.chat.services import chat_request_decode

    prefill, decode = worker_pair
    prompt = list(range(10, 50))
    req = chat_request(tenant, status="prefilling", handoff_verdict="OK", max_tokens=200, prompt_tokens=40)
    handoff = prefill.prefill(req.id, prompt, SamplingParams(max_tokens=200, temperature=0.0))
    chat_request_decode(req.id, prompt, handoff.to_dict())  # 40 + 200 tokens: this decode pool holds 128
    stored = ChatRequest.objects.get(id=req.id)
    assert (stored.status, stored.error_code) == ("failed", "context_length_exceeded")
    (event,) = OutputStream(registry_redis, registry_prefix).read(req.id, timeout_s=5)
    assert event.code == "context_length_exceeded" and decode.ledger.num_free() == 8


def test_a_request_its_worker_fails_gets_exactly_one_terminal_event(tenant, worker_pair, registry_redis,
                                                                     registry_prefix, monkeypatch):
    """The worker publishes its error event as it gives the request up (WorkerRuntime._fail), then the service
    recording the failure (chat_request_fail) publishes one too: the stream keeps the first, and only it."""
    from inference.sequence import SamplingParams
    from kvserve.chat.services import chat_request_decode

    prefill, decode = worker_pair
    prompt = list(range(10, 50))
    req = chat_request(tenant, status="prefilling", handoff_verdict="OK", max_tokens=20, prompt_tokens=40)
    handoff = prefill.prefill(req.id, prompt, SamplingParams(max_tokens=20, temperature=0.0))
    monkeypatch.setattr(decode.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("injected step failure")))
    chat_request_decode(req.id, prompt, handoff.to_dict())
    stored = ChatRequest.objects.get(id=req.id)
    assert (stored.status, stored.error_code) == ("failed", "engine_error")
    stream = OutputStream(registry_redis, registry_prefix)
    events = [event_decode(fields[b"e"]) for _, fields in registry_redis.xrange(stream.key(req.id))]
    assert [e for e in events if is_final(e)] == [Error("engine_error", "the engine failed: RuntimeError: "
                                                                        "injected step failure")]

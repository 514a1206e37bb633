"""Task messages a gone worker had received go back on their queue, through the reaper, and a quarantined worker
hands a routed prefill back to the shared queue: real kombu over the
test Redis (its own broker key prefix), the real database. A consumer that never acks stands for the worker
SIGKILLed with messages prefetched (a graceful close would restore them itself)."""
import uuid

import pytest
import redis
from kombu import Connection, Exchange, Queue

from kvserve.chat.reaper import requests_reap_orphans
from kvserve.deliveries import deliveries_key, deliveries_restore, delivery_done, delivery_note, worker_node_note
from kvserve.dispatch import prefill_send
from tests.conftest import TEST_REDIS_URL
from tests.incidents.helpers import live_worker

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("registry_settings")]


@pytest.fixture
def broker(settings, registry_redis):
    prefix = f"kvstest-broker-{uuid.uuid4().hex[:8]}:"
    settings.CELERY_BROKER_URL = TEST_REDIS_URL
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600, "global_keyprefix": prefix}
    conns = []

    def connect() -> Connection:
        conns.append(Connection(TEST_REDIS_URL, transport_options=settings.CELERY_BROKER_TRANSPORT_OPTIONS))
        return conns[-1]

    yield connect
    for c in conns:
        c.release()
    keys = list(registry_redis.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        registry_redis.delete(*keys)


def receive_without_ack(connect, queue: Queue, n: int):
    """Takes n messages off the queue the way a worker's consumer does, and never acks them."""
    conn = connect()
    channel = conn.channel()
    got = []
    consumer = conn.Consumer(queue, channel=channel, callbacks=[lambda body, message: got.append(message)],
                             prefetch_count=n)
    consumer.consume()
    while len(got) < n:
        conn.drain_events(timeout=5)
    return got


def publish(connect, queue: Queue, bodies):
    with connect() as conn:
        producer = conn.Producer()
        for body in bodies:
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key, declare=[queue])


def queued(connect, queue: Queue) -> list:
    with connect() as conn:
        q = conn.SimpleQueue(queue)
        out = []
        while True:
            try:
                m = q.get(timeout=0.5)
            except q.Empty:
                return out
            out.append(m.payload)
            m.ack()


def test_the_reaper_puts_back_what_a_gone_worker_received_and_never_acked(broker, registry, make_worker, registry_redis):
    queue = Queue("prefill-test", Exchange("prefill-test"), routing_key="prefill-test")
    publish(broker, queue, [{"request": "r-1"}, {"request": "r-2"}, {"request": "r-3"}])
    held = receive_without_ack(broker, queue, 3)
    live_worker(registry, make_worker, "prefill", worker_id="prefill-1")
    for i, message in enumerate(held):
        delivery_note("prefill-1", f"task-{i}", message.delivery_tag)
    delivery_done("prefill-1", "task-2")  # this one ran: its message is the worker's to ack, not put back
    registry.unregister("prefill-1")  # SIGKILL: no beat from here on

    assert requests_reap_orphans()["restored_tasks"] == {}  # it beat since the last round: not gone yet
    assert queued(broker, queue) == []
    report = requests_reap_orphans()
    assert report["restored_tasks"] == {"prefill-1": ["task-0", "task-1"]}
    assert sorted(b["request"] for b in queued(broker, queue)) == ["r-1", "r-2"]
    assert not registry_redis.exists(deliveries_key("prefill-1"))
    assert requests_reap_orphans()["restored_tasks"] == {}  # once


def test_a_message_already_acked_or_put_back_is_not_restored_again(broker, registry_redis):
    queue = Queue("decode-test", Exchange("decode-test"), routing_key="decode-test")
    publish(broker, queue, [{"request": "r-9"}])
    (message,) = receive_without_ack(broker, queue, 1)
    delivery_note("decode-1", "task-9", message.delivery_tag)
    message.ack()
    assert deliveries_restore("decode-1") == []
    assert queued(broker, queue) == []


def test_the_reaper_sends_a_gone_workers_direct_queue_prefills_to_the_shared_queue(broker, registry, make_worker):
    live_worker(registry, make_worker, "prefill", worker_id="prefill-2", node="prefill2@host")
    worker_node_note("prefill-2", "prefill2@host")
    with broker() as conn:  # routed to it by prefix affinity, never received: it died first
        producer = conn.Producer()
        prefill_send("r-7", [1, 2, 3], queue="prefill2@host.dq2", producer=producer)
        prefill_send("r-8", [4, 5], queue="prefill2@host.dq2", producer=producer)
    registry.unregister("prefill-2")
    requests_reap_orphans()
    assert len(requests_reap_orphans()["restored_tasks"]["prefill-2"]) == 2
    shared = Queue("prefill", Exchange("prefill"), routing_key="prefill")
    with broker() as conn:
        q = conn.SimpleQueue(shared)
        got = []
        for _ in range(2):
            m = q.get(timeout=2)
            got.append((m.headers["task"], m.payload[0]))
            m.ack()
    assert got == [("inference.prefill", ["r-7", [1, 2, 3]]), ("inference.prefill", ["r-8", [4, 5]])]


def test_a_quarantined_prefill_worker_hands_a_routed_task_back_to_the_shared_queue(broker, registry_redis,
                                                                                    registry_prefix, tiny_model,
                                                                                    monkeypatch):
    from inference.engine import EngineConfig
    from inference.worker import RuntimeOptions, WorkerRuntime
    from kvserve.chat import runtime as runtime_module
    from kvserve.chat.models import ChatRequest
    from kvserve.chat.services import chat_request_prefill
    from kvserve.tenants.models import Tenant
    from tests.incidents.helpers import chat_request

    runtime = WorkerRuntime("prefill", registry_redis, b"k" * 32, model=tiny_model,
                            options=RuntimeOptions(prefix=registry_prefix), config=EngineConfig(num_pages=64, window=1024))
    try:
        monkeypatch.setitem(runtime_module._runtime, "current", runtime)
        runtime.registry.quarantine(runtime.worker_id, "test")
        runtime.beat()  # the heartbeat learns it: the worker stops taking requests
        assert not runtime.consuming
        req = chat_request(Tenant.objects.create(name="acme"), status="queued", prompt_tokens=20, max_tokens=4)
        chat_request_prefill(req.id, list(range(20)))  # as if routed to its direct queue before the quarantine
        assert ChatRequest.objects.get(id=req.id).status == "queued"  # not served here
        assert runtime.engine.block_manager.num_free() == 64  # nothing taken
        with broker() as conn:
            m = conn.SimpleQueue(Queue("prefill", Exchange("prefill"), routing_key="prefill")).get(timeout=2)
            assert (m.headers["task"], m.payload[0]) == ("inference.prefill", [req.id, list(range(20))])
            m.ack()
    finally:
        runtime.stop()


def test_a_queued_request_no_worker_ever_claimed_is_sent_once_more(broker, settings):
    """Its message went to a worker's pending BRPOP as the worker died: in no queue, in no `unacked` hash."""
    from datetime import timedelta

    from django.utils import timezone

    from kvserve.chat.models import ChatRequest
    from kvserve.deliveries import queued_note
    from kvserve.tenants.models import Tenant
    from tests.incidents.helpers import chat_request

    settings.KVSERVE_REQUEUE_AFTER_S = 30
    tenant = Tenant.objects.create(name="acme")
    lost, fresh = (chat_request(tenant, status="queued", prompt_tokens=3, max_tokens=4) for _ in range(2))
    for req in (lost, fresh):
        queued_note(req.id, [1, 2, 3])
    ChatRequest.objects.filter(id=lost.id).update(created_at=timezone.now() - timedelta(seconds=45))
    assert requests_reap_orphans()["requeued_requests"] == [lost.id]
    assert requests_reap_orphans()["requeued_requests"] == []  # once
    with broker() as conn:
        q = conn.SimpleQueue(Queue("prefill", Exchange("prefill"), routing_key="prefill"))
        m = q.get(timeout=2)
        assert (m.headers["task"], m.payload[0]) == ("inference.prefill", [lost.id, [1, 2, 3]])
        m.ack()
        with pytest.raises(q.Empty):
            q.get(timeout=0.5)


def test_a_prefilled_request_no_decode_worker_ever_claimed_has_its_decode_sent_once_more(broker, settings):
    """Its decode message was lost (a BRPOP whose reply went with a killed connection): the prefill's note of
    the decode arguments lets the reaper send it once more; a request a decode worker claimed is left alone."""
    from datetime import timedelta

    from django.utils import timezone

    from kvserve.chat.models import ChatRequest
    from kvserve.deliveries import handed_done, handed_note
    from kvserve.tenants.models import Tenant
    from tests.incidents.helpers import chat_request

    settings.KVSERVE_REQUEUE_AFTER_S = 30
    tenant = Tenant.objects.create(name="acme")
    lost, claimed, fresh = (chat_request(tenant, status="prefilling", prompt_tokens=3, max_tokens=4)
                            for _ in range(3))
    long_ago = timezone.now() - timedelta(seconds=45)
    for req, finished in ((lost, long_ago), (claimed, long_ago), (fresh, timezone.now())):
        handed_note(req.id, [1, 2, 3], {"request_id": req.id})
        ChatRequest.objects.filter(id=req.id).update(handoff_verdict="OK", prefill_finished_at=finished)
    handed_done(claimed.id)  # a decode worker claimed it (its row is still prefilling a moment longer)
    assert requests_reap_orphans()["requeued_requests"] == [lost.id]
    assert requests_reap_orphans()["requeued_requests"] == []  # once
    with broker() as conn:
        q = conn.SimpleQueue(Queue("decode", Exchange("decode"), routing_key="decode"))
        m = q.get(timeout=2)
        assert (m.headers["task"], m.payload[0]) == ("inference.decode", [lost.id, [1, 2, 3], {"request_id": lost.id}])
        m.ack()
        with pytest.raises(q.Empty):
            q.get(timeout=0.5)


def test_a_claim_note_redis_cannot_delete_does_not_fail_the_stage(settings, caplog):
    """Deleting a stage's note is repeated across a dropped connection; with Redis unreachable it is left to
    expire (a copy it sends is refused by the claim), and the stage goes on."""
    from kvserve.deliveries import handed_done, queued_done

    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    queued_done("chatcmpl-x")
    handed_done("chatcmpl-x")
    assert sum("could not delete" in r.getMessage() for r in caplog.records) == 2


def test_the_webs_prefill_note_is_written_across_a_killed_connection(tmp_path, settings):
    """queued_note runs as the request is queued: its connection killed while the SET waits (Redis paused for
    writes, its own server) is a repeat, not a failed request (a 503 in tests/e2e/test_redis_kills.py)."""
    from kvserve.deliveries import queued_key, queued_note
    from kvserve.workers import redis_client
    from tests.e2e.stack import OwnRedis
    from tests.inference.test_retry import paused_and_killed

    server = OwnRedis(tmp_path).start()
    try:
        settings.REDIS_URL = server.url
        redis_client(server.url).client_setname("kvstest-web")  # the client's one pooled connection, named
        out = paused_and_killed(server, lambda: queued_note("r1", [1, 2, 3]), "kvstest-web", cmd="set")
        assert out == {"value": None}
        client = redis.Redis.from_url(server.url)
        assert client.get(queued_key("r1")) == b"[1, 2, 3]" and client.ttl(queued_key("r1")) > 0
    finally:
        redis_client.cache_clear()
        server.stop()

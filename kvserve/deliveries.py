"""Which broker deliveries each engine worker holds, so that the reaper can put back on their queues the task
messages a worker received (prefetched or running) when it is gone. Owns the Redis key
`{KVSERVE_LEDGER_PREFIX}:deliveries:{worker_id}` (a hash: task id -> delivery tag) and
`{KVSERVE_LEDGER_PREFIX}:nodes` (worker id -> Celery node name, whose direct and probe queues the reaper empties too) and
`{KVSERVE_LEDGER_PREFIX}:queued:{request_id}` (a queued request's prefill arguments until a worker claims it)
and `{KVSERVE_LEDGER_PREFIX}:handed:{request_id}` (a prefilled request's decode arguments until a decode worker
claims it): a message Redis handed to a worker's pending BRPOP just as the worker died, or whose BRPOP reply
was lost with its connection, is in no queue and no `unacked` hash, so the reaper sends such a request's
stage once more after KVSERVE_REQUEUE_AFTER_S.

Without it, a message a dead worker had received waits in kombu's `unacked` hash for the whole visibility
timeout (an hour: it must outlast the longest decode) and its request for the queue timeout. Putting a
message back is always safe: claims are exclusive and count deliveries (kvserve/chat/services.py), so a copy
whose request another delivery holds, or that already ended, does nothing."""
import base64
import json
import logging

import redis
from celery.utils.nodenames import worker_direct
from django.conf import settings
from kombu import Connection

from inference.retry import repeat
from kvserve.dispatch import PREFILL, decode_send, prefill_task_requeue, probe_queue
from kvserve.workers import redis_client

log = logging.getLogger(__name__)
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)


def deliveries_key(worker_id: str) -> str:
    return f"{settings.KVSERVE_LEDGER_PREFIX}:deliveries:{worker_id}"


def nodes_key() -> str:
    return f"{settings.KVSERVE_LEDGER_PREFIX}:nodes"


def queued_key(request_id: str) -> str:
    return f"{settings.KVSERVE_LEDGER_PREFIX}:queued:{request_id}"


def queued_note(request_id: str, prompt_ids: list[int]) -> None:
    """The web queued this request's prefill (kept until claimed, at most the queue timeout). A keyed write:
    repeated across a dropped connection."""
    repeat(lambda: redis_client(settings.REDIS_URL).set(queued_key(request_id), json.dumps(prompt_ids),
                                                        ex=settings.KVSERVE_QUEUE_TIMEOUT_S),
           f"noting the prefill of {request_id}")


def queued_done(request_id: str) -> None:
    """A worker claimed the request: nothing to send again."""
    _note_drop(queued_key(request_id))


def _note_drop(key: str) -> None:
    """Deletes a stage's note, repeated across a dropped connection; a note Redis never takes expires with the
    queue timeout, and sends a claimed request once more at most (refused by its claim)."""
    try:
        repeat(lambda: redis_client(settings.REDIS_URL).delete(key), f"deleting {key}")
    except UNREACHABLE as exc:
        log.warning("could not delete %s (it expires; a copy it sends is refused): %r", key, exc)


def handed_key(request_id: str) -> str:
    return f"{settings.KVSERVE_LEDGER_PREFIX}:handed:{request_id}"


def handed_note(request_id: str, prompt_ids: list[int], handoff: dict) -> None:
    """Prefill sends this request's decode (kept until a decode worker claims it, at most the queue timeout)."""
    try:
        repeat(lambda: redis_client(settings.REDIS_URL).set(
            handed_key(request_id), json.dumps([prompt_ids, handoff]), ex=settings.KVSERVE_QUEUE_TIMEOUT_S),
            f"noting the decode of {request_id}")
    except UNREACHABLE as exc:  # the decode is sent anyway; only its second chance is lost
        log.warning("could not note the decode of %s for the reaper: %r", request_id, exc)


def handed_done(request_id: str) -> None:
    """A decode worker claimed the request: nothing to send again."""
    _note_drop(handed_key(request_id))


def handed_requeue(request_id: str) -> bool:
    """Sends a prefilled, never-claimed request's decode once more (claims are exclusive: a copy is harmless).
    Once per request: True when it was sent."""
    note = _note_take(handed_key(request_id))
    if note is None:
        return False
    prompt_ids, handoff = note
    decode_send(request_id, prompt_ids, handoff)
    return True


def queued_requeue(request_id: str) -> bool:
    """Sends a still-unclaimed request's prefill once more (claims are exclusive: a copy of a message still
    queued is harmless). Once per request: True when it was sent."""
    prompt_ids = _note_take(queued_key(request_id))
    if prompt_ids is None:
        return False
    prefill_task_requeue(request_id, prompt_ids)
    return True


def _note_take(key: str):
    """A stage's note, taken (GETDEL: the reaper sends a stage once); None when claimed or expired."""
    raw = redis_client(settings.REDIS_URL).getdel(key)
    return None if raw is None else json.loads(raw)


def worker_node_note(worker_id: str, node: str) -> None:
    """An engine worker started as Celery node `node` (its direct queue: prefix-affinity prefills, probes)."""
    redis_client(settings.REDIS_URL).hset(nodes_key(), worker_id, node)


def delivery_note(worker_id: str, task_id: str, tag: str) -> None:
    """The worker received a message (task_received: also for one it only prefetched)."""
    key = deliveries_key(worker_id)
    pipe = redis_client(settings.REDIS_URL).pipeline(transaction=False)
    pipe.hset(key, task_id, tag)
    # a worker nobody reaps (its Redis lost, the reaper not scheduled) leaves nothing behind for long
    pipe.expire(key, settings.CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"])
    pipe.execute()


def delivery_done(worker_id: str, task_id: str) -> None:
    """The task ran (its message is acked next, acks_late): nothing to put back."""
    redis_client(settings.REDIS_URL).hdel(deliveries_key(worker_id), task_id)


def deliveries_restore(worker_id: str) -> list[str]:
    """Puts back, at the front of their queues, the messages gone worker `worker_id` received and never
    acked, and sends the prefill tasks still waiting in its direct queue to the shared prefill queue; forgets
    the rest. Returns the ids of the tasks put back or sent on."""
    client = redis_client(settings.REDIS_URL)
    held = {k.decode(): v.decode() for k, v in client.hgetall(deliveries_key(worker_id)).items()}
    node = client.hget(nodes_key(), worker_id)
    restored = []
    if held or node:
        with Connection(settings.CELERY_BROKER_URL, transport_options=settings.CELERY_BROKER_TRANSPORT_OPTIONS) as conn:
            channel = conn.default_channel
            broker = channel.client  # prefixed like the transport's own keys (global_keyprefix)
            for task_id, tag in held.items():
                if broker.hget(channel.unacked_key, tag) is not None:  # HGET: a command kombu prefixes
                    channel.qos.restore_by_tag(tag)
                    restored.append(task_id)
            if node:
                for queue in (worker_direct(node.decode()), probe_queue(node.decode())):
                    restored += _direct_queue_drain(broker, queue.name, conn.Producer())
    pipe = client.pipeline()
    pipe.delete(deliveries_key(worker_id))
    pipe.hdel(nodes_key(), worker_id)
    pipe.execute()
    if restored:
        log.warning("put back %d task message(s) gone worker %s had received: %s", len(restored), worker_id,
                    ", ".join(restored))
    return restored


def _direct_queue_drain(broker, queue: str, producer) -> list[str]:
    """Empties a gone worker's direct queue: its prefill tasks go to the shared queue, anything else (canary
    probes of that worker) is dropped: its canary check fails as unreachable."""
    moved = []
    while (raw := broker.rpop(queue)) is not None:  # oldest first (kombu publishes with LPUSH)
        message = json.loads(raw)
        headers = message.get("headers") or {}
        if headers.get("task") != PREFILL:
            log.warning("dropped %s[%s] from gone worker's queue %s", headers.get("task"), headers.get("id"), queue)
            continue
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        prefill_task_requeue(*args, producer=producer)
        moved.append(headers.get("id"))
    return moved

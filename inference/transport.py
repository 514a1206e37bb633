"""KV transport between prefill and decode: `send(handoff, blob)` / `take(request_id) -> TransportedKV`.

`RedisTransport` keeps a request's pages as one binary value under its key with a TTL, deleted once taken;
`LocalTransport` keeps them in memory (the sandbox). Both store the blob's shape, dtype and epochs beside it;
what decode accepts is decided by `inference.handoff.handoff_accept`, never here."""
import json

import torch

from inference.handoff import Handoff, TransportedKV
from inference.retry import repeat


def _meta(handoff: Handoff, blob: torch.Tensor) -> dict:
    return {"shape": list(blob.shape), "dtype": str(blob.dtype).removeprefix("torch."),
            "epochs": list(handoff.page_epochs)}


def _raw(blob: torch.Tensor) -> bytes:
    return blob.contiguous().view(torch.uint8).numpy().tobytes()


class RedisTransport:
    def __init__(self, redis, prefix: str = "kvs", ttl_s: int = 300):
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s

    def key(self, request_id: str) -> str:
        return f"{self.prefix}:kv:{request_id}"

    def send(self, handoff: Handoff, blob: torch.Tensor) -> None:
        self.send_raw(handoff.request_id, _meta(handoff, blob), _raw(blob))

    def send_raw(self, request_id: str, meta: dict, raw: bytes) -> None:
        def store():
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(self.key(request_id), mapping={"meta": json.dumps(meta), "blob": raw})
            pipe.expire(self.key(request_id), self.ttl_s)
            pipe.execute()

        repeat(store, f"sending the KV of {request_id}")  # the same value again

    def take(self, request_id: str) -> TransportedKV | None:
        """The stored KV of `request_id`, deleted in the same transaction; None when there is none. Not repeated
        after a dropped connection: a repeat finds it deleted, and the request fails closed."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self.key(request_id))
        pipe.delete(self.key(request_id))
        stored, _ = pipe.execute()
        if not stored or b"meta" not in stored or b"blob" not in stored:
            return None
        try:
            meta = json.loads(stored[b"meta"])
        except ValueError:
            meta = {}
        return TransportedKV(meta if isinstance(meta, dict) else {}, stored[b"blob"])

    def discard(self, request_id: str) -> None:
        self.redis.delete(self.key(request_id))


class LocalTransport:
    """The same contract in memory, for an engine pair in one process (the sandbox)."""

    def __init__(self):
        self._kv: dict[str, TransportedKV] = {}

    def send(self, handoff: Handoff, blob: torch.Tensor) -> None:
        self._kv[handoff.request_id] = TransportedKV(_meta(handoff, blob), _raw(blob))

    def take(self, request_id: str) -> TransportedKV | None:
        return self._kv.pop(request_id, None)

    def discard(self, request_id: str) -> None:
        self._kv.pop(request_id, None)

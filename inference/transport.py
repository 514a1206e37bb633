"""KV transport between prefill and decode: `send(handoff, blob)` / `receive(handoff) -> blob`.

`RedisTransport` keeps a request's pages as one binary value under its key with a TTL, deleted
once pulled. The stored epochs fence the blob: a handoff whose epochs differ is stale.
"""
import json

import numpy as np
import torch

from inference.handoff import Handoff, HandoffRefused
from inference.kv_cache import page_checksums


class RedisTransport:
    def __init__(self, redis, prefix: str = "kvs", ttl_s: int = 300):
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s

    def key(self, request_id: str) -> str:
        return f"{self.prefix}:kv:{request_id}"

    def send(self, handoff: Handoff, blob: torch.Tensor) -> None:
        meta = {"shape": list(blob.shape), "dtype": str(blob.dtype).removeprefix("torch."),
                "epochs": list(handoff.page_epochs)}
        raw = blob.contiguous().view(torch.uint8).numpy().tobytes()
        self.redis.hset(self.key(handoff.request_id), mapping={"meta": json.dumps(meta), "blob": raw})
        self.redis.expire(self.key(handoff.request_id), self.ttl_s)

    def receive(self, handoff: Handoff) -> torch.Tensor:
        """The pages, verified against the handoff's epochs and checksums; the key is gone afterwards."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self.key(handoff.request_id))
        pipe.delete(self.key(handoff.request_id))
        stored, _ = pipe.execute()
        if not stored:
            raise HandoffRefused("kv_missing", f"no KV for {handoff.request_id}: expired, already pulled, or never sent")
        meta = json.loads(stored[b"meta"])
        if tuple(meta["epochs"]) != tuple(handoff.page_epochs):
            raise HandoffRefused("stale_epoch", f"KV epochs {meta['epochs']} do not match the handoff's "
                                                f"{list(handoff.page_epochs)}")
        dtype = getattr(torch, meta["dtype"])
        flat = torch.from_numpy(np.frombuffer(stored[b"blob"], dtype=np.uint8).copy())
        blob = flat.view(dtype).reshape(meta["shape"])
        if page_checksums(blob) != list(handoff.page_checksums):
            raise HandoffRefused("handoff_mismatch", "page checksums do not match the handoff")
        return blob

    def discard(self, request_id: str) -> None:
        self.redis.delete(self.key(request_id))

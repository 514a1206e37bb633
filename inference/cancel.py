"""Per-request cancellation: whoever gives up on a request (the web process when its client leaves or it
stops waiting, the reaper when the request's worker stopped answering) raises its flag; the worker
holding the request polls the flags of its requests and aborts them, freeing their pages at once.

Owns the `{prefix}:cancel:{request_id}` keys. A flag outlives the request by `ttl_s`, so a worker that
was paused or cut off still sees it when it comes back. Raising and reading a flag repeat across a dropped
connection (inference.retry).
"""
import json
from dataclasses import asdict, dataclass

from inference.retry import repeat


@dataclass(frozen=True)
class Cancel:
    request_id: str
    code: str  # the request's failure code: client_disconnected, worker_lost, timeout, ...
    message: str


class Cancellations:
    def __init__(self, redis, prefix: str = "kvs", ttl_s: int = 3600):
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s

    def key(self, request_id: str) -> str:
        return f"{self.prefix}:cancel:{request_id}"

    def request(self, cancel: Cancel) -> None:
        repeat(lambda: self.redis.set(self.key(cancel.request_id), json.dumps(asdict(cancel)), ex=self.ttl_s),
               f"cancelling {cancel.request_id}")

    def pending(self, request_ids) -> list[Cancel]:
        """The cancellations raised for any of `request_ids` (one round trip)."""
        ids = list(request_ids)
        if not ids:
            return []
        raws = repeat(lambda: self.redis.mget([self.key(rid) for rid in ids]), "reading cancellations")
        return [Cancel(**json.loads(raw)) for raw in raws if raw is not None]

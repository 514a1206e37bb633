"""Prefix-affinity routing: which live prefill worker a request's prefix most likely sits on (rendezvous hash of
the request's salt and first full page over the live prefill workers), so that one scope's conversations meet
their own cached pages. Any worker is correct: affinity only decides where the cache is likely to hit.
`prefill_queue_for` (web side) picks the queue a request's prefill task goes to: the chosen worker's direct
queue, or the shared `prefill` queue. What a direct queue holds never strands: a quarantined worker hands it
back to `prefill` (services.chat_request_prefill) and the reaper moves a gone worker's (kvserve/deliveries.py)."""
import hashlib
from array import array

from celery.utils.nodenames import worker_direct

from inference.registry import PREFILL
from kvserve.chat.salt import request_salt
from kvserve.workers import registry_get


def prefix_route_key(salt: str, prompt_ids: list[int], page_size: int) -> bytes | None:
    """The routing key of a prompt: its scope and its first full page; None for a prompt shorter than one page
    (nothing of it can be cached)."""
    if len(prompt_ids) < page_size:
        return None
    return hashlib.sha256(salt.encode() + b"\0" + array("q", prompt_ids[:page_size]).tobytes()).digest()


def prefill_worker_for(key: bytes | None, worker_ids: list[str]) -> str | None:
    """Rendezvous (highest random weight) choice among `worker_ids`: stable while the set is, and a worker
    joining or leaving moves only the keys it wins or held. None when there is no key or no worker."""
    if key is None or not worker_ids:
        return None
    return max(sorted(worker_ids), key=lambda w: hashlib.sha256(key + w.encode()).digest())


def prefill_queue_for(tenant, user: str | None, prompt_ids: list[int]) -> str | None:
    """The direct queue of the live, unquarantined prefill worker most likely to hold this prompt's prefix, or
    None (the shared queue) when no worker qualifies or the prompt is shorter than a page."""
    registry = registry_get()
    workers = {w.worker_id: w for w in registry.live_workers(PREFILL)
               if w.node and not registry.is_quarantined(w.worker_id)}
    if len(workers) < 2:
        return None  # one worker (or none): the shared queue reaches it as well
    page_size = min(w.page_size for w in workers.values())
    chosen = prefill_worker_for(prefix_route_key(request_salt(tenant, user), prompt_ids, page_size), list(workers))
    return worker_direct(workers[chosen].node).name if chosen else None

"""Prefix-affinity routing: which live prefill worker a request's prefix most likely sits on (rendezvous hash of
the request's salt and first full page over the live prefill workers), so that one scope's conversations meet
their own cached pages. Any worker is correct: affinity only decides where the cache is likely to hit."""
import hashlib
from array import array


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

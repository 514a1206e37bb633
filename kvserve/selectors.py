"""Read-only project-level queries: service health derived from live worker registrations."""
import redis

from kvserve.workers import registry_get


def health_get() -> dict:
    """Live workers, the window they serve, and the admission limit (None unless prefill and decode can serve).

    The body has an "error" exactly when the service cannot serve.
    """
    body = {"workers": [], "window": None, "effective_context_limit": None}
    try:
        registry = registry_get()
        workers = registry.live_workers()
        limit = registry.effective_limit()
    except redis.RedisError as exc:
        return {**body, "error": f"worker registry unreachable: {exc.__class__.__name__}"}
    body.update(workers=[w.to_dict() for w in workers], effective_context_limit=limit,
                window=registry.served_window())
    if limit is None:
        serving = {w.role for w in workers if not w.quarantined}
        missing = [role for role in ("prefill", "decode") if role not in serving]
        body["error"] = f"no live, unquarantined worker for: {', '.join(missing)}"
    return body

"""The one admission rule (invariant 2): the most tokens (prompt + max_tokens) one request may use on a pool,
the deployment's limit over its pools, and why a request can never run. Used by the engine, the worker's
registration, the registry and the sandbox replay alike. Nothing is reserved either way."""
from typing import Iterable


def serving_limit(window: int, capacity_tokens: int, max_position: int | None = None) -> int:
    """min(window served, pool capacity, the model's context length) for one pool."""
    limits = [window, capacity_tokens] + ([max_position] if max_position else [])
    return min(limits)


def deployment_limit(limits: Iterable[int]) -> int | None:
    """The smallest of the pools' serving limits (a request must fit every pool it passes); None without pools."""
    limits = list(limits)
    return min(limits) if limits else None


def admission_error(prompt_tokens: int, max_tokens: int, limit: int, detail: str = "") -> str | None:
    """Why a request of `prompt_tokens` + `max_tokens` can never run under `limit`, or None when it fits."""
    total = prompt_tokens + max_tokens
    if total <= limit:
        return None
    return (f"prompt_tokens {prompt_tokens} + max_tokens {max_tokens} = {total} exceeds this engine's limit of "
            f"{limit} tokens{f' ({detail})' if detail else ''}")

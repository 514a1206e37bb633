"""Schemathesis hooks for the fuzz run against a live stack (loaded via SCHEMATHESIS_HOOKS): generated
requests keep their shape, but a valid one asks for at most 4 tokens of the served model, so hundreds of
cases finish in bounded time on a CPU."""
import os

import schemathesis

MAX_TOKENS = 4


@schemathesis.hook
def before_call(context, case, kwargs):
    body = case.body
    if not isinstance(body, dict):
        return
    if case.meta is not None and not case.meta.generation.mode.is_positive:
        return  # a schema-violating case is sent as generated: a rewrite (model, max_tokens) could make it valid
    if isinstance(body.get("model"), str):
        body["model"] = os.environ.get("KVSERVE_FUZZ_MODEL", body["model"])
    sizes = [body.get(k) for k in ("max_tokens", "max_completion_tokens")]
    if all(v is None for v in sizes):
        body["max_tokens"] = MAX_TOKENS
    for k, v in zip(("max_tokens", "max_completion_tokens"), sizes):
        if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS:
            body[k] = MAX_TOKENS

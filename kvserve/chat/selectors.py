"""Read-only chat queries: the served model, and a tenant's own requests (another tenant's id is a 404)."""
from functools import lru_cache

import redis

from inference.loader import resolve_model_path
from kvserve.chat.models import ChatRequest
from kvserve.chat.tokenizer import tokenizer_get
from kvserve.errors import ApiError
from kvserve.tenants.models import Tenant
from kvserve.workers import registry_get


@lru_cache(maxsize=1)
def model_get() -> dict:
    """The one served model: id (its name), fingerprint and file time; the weights are not loaded."""
    _, fingerprint, name = tokenizer_get()
    return {"id": name, "object": "model", "created": int(resolve_model_path().stat().st_mtime),
            "owned_by": "kvserve", "fingerprint": fingerprint}


def model_get_by_id(model_id: str | None) -> dict:
    """The served model when `model_id` names it (or is empty); 404 model_not_found otherwise."""
    model = model_get()
    if model_id and model_id != model["id"]:
        raise ApiError(f"The model '{model_id}' does not exist; this server serves '{model['id']}'.",
                       status_code=404, param="model", code="model_not_found")
    return model


def chat_request_get_for_tenant(*, tenant: Tenant, request_id: str) -> ChatRequest:
    """The tenant's own request; a missing id and another tenant's id are the same 404."""
    request = ChatRequest.objects.filter(tenant=tenant, id=request_id).first()
    if request is None:
        raise ApiError(f"No request with id '{request_id}'.", status_code=404, param="id", code="not_found")
    return request


MAX_TOKENS_CAP = 1_048_576  # a sanity bound for validation while no worker is registered


def served_window_get() -> int:
    """The window live workers serve (the upper bound for max_tokens); the cap when none is known."""
    try:
        return registry_get().served_window() or MAX_TOKENS_CAP
    except redis.RedisError:
        return MAX_TOKENS_CAP

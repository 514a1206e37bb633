"""Builders for dashboard/metrics tests: tenants, ChatRequest rows, ledger pools for registered workers."""
import uuid

from inference.ledger import RedisLedger
from kvserve.chat.models import ChatRequest
from kvserve.tenants.models import Tenant


def chat_request(tenant: Tenant, **fields) -> ChatRequest:
    fields = {"id": f"chatcmpl-{uuid.uuid4().hex}", "model": "test", "prompt_hash": "0" * 64, **fields}
    return ChatRequest.objects.create(tenant=tenant, **fields)


def live_worker(registry, make_worker, role: str, **overrides) -> RedisLedger:
    """Registers a worker and its ledger pool (pool id == worker id, as the real runtime does)."""
    info = registry.register(make_worker(role, **overrides))
    return RedisLedger.register(registry.redis, info.worker_id, role, info.num_pages, info.page_size,
                                prefix=registry.prefix)

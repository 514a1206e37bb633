"""Fair share at admission (web side): while other tenants have requests in flight, a tenant over its in-flight
or KV share is refused with 429 and Retry-After at once, never queued, so the prefill queue never holds one
tenant's unbounded backlog ahead of another's; a tenant alone is never refused. The rule is
inference.tenant_budget's; this module gathers what it judges (unfinished rows, the ledger's holdings)."""
from django.conf import settings

from inference.ledger import owners_held_tokens
from inference.registry import SERVING_ROLES
from inference.tenant_budget import TenantLimits, TenantUsage, tenant_admission_check
from kvserve.chat.metrics import admission_rejection_count_incr
from kvserve.chat.models import ChatRequest
from kvserve.errors import too_many_requests
from kvserve.workers import redis_get, registry_get


def tenant_limits_get(tenant) -> TenantLimits:
    """The deployment's limits, with the tenant's own where it has set them."""
    own_flight, own_share = tenant.max_in_flight, tenant.kv_share
    return TenantLimits(
        max_in_flight=settings.KVSERVE_TENANT_MAX_IN_FLIGHT if own_flight is None else own_flight,
        kv_share=settings.KVSERVE_TENANT_KV_SHARE if own_share is None else own_share,
        max_in_flight_from="KVSERVE_TENANT_MAX_IN_FLIGHT" if own_flight is None else "the tenant's max_in_flight",
        kv_share_from="KVSERVE_TENANT_KV_SHARE" if own_share is None else "the tenant's kv_share")


def tenant_usage_get(tenant) -> TenantUsage:
    """The tenant's unfinished requests, what they hold in the ledger, the prompts of those holding nothing yet,
    and how many unfinished requests the other tenants have (0: it is alone)."""
    unfinished = ChatRequest.objects.exclude(status__in=ChatRequest.FINAL)
    rows = list(unfinished.filter(tenant=tenant).values_list("id", "prompt_tokens"))
    others = unfinished.exclude(tenant=tenant).count()
    held = owners_held_tokens(redis_get(), [rid for rid, _ in rows], settings.KVSERVE_LEDGER_PREFIX)
    return TenantUsage(in_flight=len(rows), held_tokens=sum(held.values()),
                       owed_tokens=sum(p for rid, p in rows if not held[rid]), others_in_flight=others)


def smallest_pool_tokens() -> int:
    return min((w.capacity_tokens for w in registry_get().live_workers() if w.role in SERVING_ROLES), default=0)


def tenant_admission_enforce(tenant, need_tokens: int) -> None:
    """Raises the 429 (and counts it per limit for /metrics) when the tenant may not add a request whose prompt
    is `need_tokens` now. Call with the tenant's row locked, so two admissions do not both pass."""
    refusal = tenant_admission_check(tenant.name, tenant_usage_get(tenant), tenant_limits_get(tenant), need_tokens,
                                     smallest_pool_tokens())
    if refusal is not None:
        admission_rejection_count_incr(refusal.limit)
        raise too_many_requests(refusal.message, code=refusal.limit,
                                retry_after_s=settings.KVSERVE_TENANT_RETRY_AFTER_S)

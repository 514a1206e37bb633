"""The per-tenant fair-share rule at admission: how many requests a tenant may have in flight and how much KV
it may hold, while other tenants have requests in flight. Pure: the web side gathers the usage
(kvserve.chat.tenant_limits) and acts on the verdict.

Work-conserving: a tenant alone (no other tenant has an unfinished request) is never refused, whatever its
numbers; it may use every slot and the whole pool, and the engine preempts its newest sequences when the
pool runs short. The shares bite only under contention, and there the engines' fair waiting queue and their
preemption of the tenant most over its share act first (inference.scheduler); a 429 is for a tenant over its
share while others wait.

Counting rule: a tenant's KV is what its unfinished requests really hold in the ledger (pages x page size,
every pool) plus, for each unfinished request that holds no page anywhere yet (queued, or between prefill and
decode), its prompt: the pages it is admitted with. max_tokens is not a reservation (pages are on demand), so
it is never counted: a client that sets a large max_tokens holds no more than one that does not.
"""
import math
from dataclasses import dataclass

IN_FLIGHT = "tenant_in_flight_limit"
KV = "tenant_kv_limit"
LIMITS = (IN_FLIGHT, KV)


@dataclass(frozen=True)
class TenantLimits:
    max_in_flight: int  # unfinished requests while others wait; 0 = no limit
    kv_share: float  # fraction of the smallest live pool's tokens while others wait; 0 = no limit
    max_in_flight_from: str = "KVSERVE_TENANT_MAX_IN_FLIGHT"  # where each number comes from, for the message
    kv_share_from: str = "KVSERVE_TENANT_KV_SHARE"


@dataclass(frozen=True)
class TenantUsage:
    in_flight: int  # unfinished requests
    held_tokens: int  # pages its unfinished requests hold in the ledger, times the page size
    owed_tokens: int  # prompt tokens of its unfinished requests that hold no page yet
    others_in_flight: int = 0  # unfinished requests of every other tenant: 0 means the tenant is alone

    @property
    def kv_tokens(self) -> int:
        return self.held_tokens + self.owed_tokens


@dataclass(frozen=True)
class Refusal:
    limit: str  # IN_FLIGHT or KV
    message: str


def kv_budget_tokens(limits: TenantLimits, smallest_pool_tokens: int) -> int | None:
    """The tenant's KV budget in tokens under contention, or None when there is no KV limit."""
    if limits.kv_share <= 0:
        return None
    return math.floor(limits.kv_share * smallest_pool_tokens)


def tenant_admission_check(tenant: str, usage: TenantUsage, limits: TenantLimits, need_tokens: int,
                           smallest_pool_tokens: int) -> Refusal | None:
    """None when a new request whose prompt is `need_tokens` may be admitted now, else the limit it is over.
    A tenant alone is always admitted (work-conserving). A tenant that holds and is owed nothing is always
    admitted (the request already fits the window), so a request that fits the window is served eventually,
    however small the tenant's share."""
    if usage.others_in_flight == 0:
        return None
    if limits.max_in_flight > 0 and usage.in_flight >= limits.max_in_flight:
        return Refusal(IN_FLIGHT, f"Tenant {tenant!r} already has {usage.in_flight} requests in flight while "
                                  f"other tenants have {usage.others_in_flight}; its share is "
                                  f"{limits.max_in_flight} ({limits.max_in_flight_from}). Retry when one "
                                  f"has finished.")
    budget = kv_budget_tokens(limits, smallest_pool_tokens)
    if budget is not None and usage.kv_tokens > 0 and usage.kv_tokens + need_tokens > budget:
        return Refusal(KV, f"Tenant {tenant!r} holds or awaits {usage.kv_tokens} tokens of KV cache and this "
                           f"request's prompt needs {need_tokens} more, while other tenants have "
                           f"{usage.others_in_flight} requests in flight; its share is {budget} tokens, "
                           f"{limits.kv_share:.0%} of the smallest live pool ({smallest_pool_tokens} tokens; "
                           f"{limits.kv_share_from}). Retry when a request has finished.")
    return None

"""The per-tenant fair-share rule at admission: how many requests a tenant may have in flight and how much KV
it may hold or be owed. Pure: the web side gathers the usage (kvserve.chat.tenant_limits) and acts on the verdict.

Counting rule: a tenant's KV is what its unfinished requests really hold in the ledger (pages x page size,
every pool) plus, for each unfinished request that holds no page anywhere yet (queued, or between prefill and
decode), the most it will need (prompt + max_tokens). So it stays right when pages are allocated on demand:
a running request counts what it has, not what it reserved.
"""
import math
from dataclasses import dataclass

IN_FLIGHT = "tenant_in_flight_limit"
KV = "tenant_kv_limit"
LIMITS = (IN_FLIGHT, KV)


@dataclass(frozen=True)
class TenantLimits:
    max_in_flight: int  # unfinished requests; 0 = no limit
    kv_share: float  # fraction of the smallest live pool's tokens; 0 = no limit
    max_in_flight_from: str = "KVSERVE_TENANT_MAX_IN_FLIGHT"  # where each number comes from, for the message
    kv_share_from: str = "KVSERVE_TENANT_KV_SHARE"


@dataclass(frozen=True)
class TenantUsage:
    in_flight: int  # unfinished requests
    held_tokens: int  # pages its unfinished requests hold in the ledger, times the page size
    owed_tokens: int  # prompt + max_tokens of its unfinished requests that hold no page yet

    @property
    def kv_tokens(self) -> int:
        return self.held_tokens + self.owed_tokens


@dataclass(frozen=True)
class Refusal:
    limit: str  # IN_FLIGHT or KV
    message: str


def kv_budget_tokens(limits: TenantLimits, smallest_pool_tokens: int) -> int | None:
    """The tenant's KV budget in tokens, or None when there is no KV limit."""
    if limits.kv_share <= 0:
        return None
    return math.floor(limits.kv_share * smallest_pool_tokens)


def tenant_admission_check(tenant: str, usage: TenantUsage, limits: TenantLimits, need_tokens: int,
                           smallest_pool_tokens: int) -> Refusal | None:
    """None when a new request needing at most `need_tokens` may be admitted now, else the limit it is over.
    A tenant that holds and is owed nothing is always admitted (the request already fits the window), so a
    request that fits the window is served eventually, however small the tenant's share."""
    if limits.max_in_flight > 0 and usage.in_flight >= limits.max_in_flight:
        return Refusal(IN_FLIGHT, f"Tenant {tenant!r} already has {usage.in_flight} requests in flight; its limit "
                                  f"is {limits.max_in_flight} ({limits.max_in_flight_from}). Retry when one "
                                  f"has finished.")
    budget = kv_budget_tokens(limits, smallest_pool_tokens)
    if budget is not None and usage.kv_tokens > 0 and usage.kv_tokens + need_tokens > budget:
        return Refusal(KV, f"Tenant {tenant!r} holds or awaits {usage.kv_tokens} tokens of KV cache and this "
                           f"request may need {need_tokens} more; its limit is {budget} tokens, "
                           f"{limits.kv_share:.0%} of the smallest live pool ({smallest_pool_tokens} tokens; "
                           f"{limits.kv_share_from}). Retry when a request has finished.")
    return None


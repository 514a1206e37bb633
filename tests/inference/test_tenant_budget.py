"""The fair-share rule at admission: in-flight and KV shares bite only while another tenant has requests in
flight (a tenant alone is never refused), KV counts prompts, not max_tokens, and the tenant that holds nothing
always gets in."""
from inference.tenant_budget import IN_FLIGHT, KV, TenantLimits, TenantUsage, kv_budget_tokens, tenant_admission_check

LIMITS = TenantLimits(max_in_flight=4, kv_share=0.5)
POOL = 4096  # smallest live pool: budget 2048 tokens


def check(usage, need=100, limits=LIMITS):
    return tenant_admission_check("acme", usage, limits, need, POOL)


def contended(in_flight, held, owed):
    return TenantUsage(in_flight=in_flight, held_tokens=held, owed_tokens=owed, others_in_flight=1)


def test_under_both_limits_is_admitted():
    assert check(contended(3, 1000, 900), need=148) is None  # 2048 exactly


def test_at_the_in_flight_share_while_others_wait_is_refused_naming_it():
    refusal = check(contended(4, 0, 0))
    assert refusal.limit == IN_FLIGHT
    assert "4 requests in flight" in refusal.message and "KVSERVE_TENANT_MAX_IN_FLIGHT" in refusal.message
    assert "other tenants have 1" in refusal.message


def test_over_the_kv_share_while_others_wait_is_refused_with_the_numbers():
    refusal = check(contended(1, 1000, 900), need=149)  # 2049 > 2048
    assert refusal.limit == KV
    for part in ("1900 tokens", "149 more", "2048 tokens", "50%", "4096 tokens", "KVSERVE_TENANT_KV_SHARE"):
        assert part in refusal.message, part


def test_a_tenant_alone_is_never_refused_however_far_over_its_shares():
    # work-conserving: with nobody else waiting, the whole stack is this tenant's
    assert check(TenantUsage(in_flight=500, held_tokens=4096, owed_tokens=10**6, others_in_flight=0),
                 need=4000) is None


def test_owed_tokens_count_like_held_ones():
    assert check(contended(2, 0, 2000), need=100).limit == KV


def test_a_tenant_holding_nothing_is_admitted_even_above_its_share():
    # the request fits the window (checked before): refusing it would starve it forever
    assert check(contended(0, 0, 0), need=4000) is None


def test_zero_switches_a_limit_off_and_tenant_overrides_are_named():
    off = TenantLimits(max_in_flight=0, kv_share=0)
    assert kv_budget_tokens(off, POOL) is None
    assert check(contended(999, 10**9, 0), limits=off) is None
    own = TenantLimits(max_in_flight=1, kv_share=0.25, max_in_flight_from="the tenant's max_in_flight",
                       kv_share_from="the tenant's kv_share")
    assert "the tenant's max_in_flight" in check(contended(1, 0, 0), limits=own).message
    refusal = check(contended(0, 1000, 0), need=100, limits=own)
    assert refusal.limit == KV and "1024 tokens" in refusal.message and "the tenant's kv_share" in refusal.message

"""Canary tenants are exempt from fair share: the marker canary's probes go to the edge of the window at once,
which a tenant's KV share (by default half the smallest pool) would refuse with 429."""
import pytest

from incidents.canary.prompts import TENANT_A, TENANT_B, canary_key
from inference.tenant_budget import TenantUsage, tenant_admission_check
from kvserve.chat.tenant_limits import tenant_limits_get
from kvserve.tenants.models import Tenant

pytestmark = pytest.mark.django_db


def test_canary_tenants_have_no_fair_share_limits_new_or_existing(settings):
    settings.KVSERVE_TENANT_MAX_IN_FLIGHT, settings.KVSERVE_TENANT_KV_SHARE = 16, 0.5
    Tenant.objects.create(name=TENANT_B)  # created before the exemption existed: deployment limits
    for name in (TENANT_A, TENANT_B):
        tenant = Tenant.objects.get(pk=canary_key(name).tenant_id)
        assert (tenant.max_in_flight, tenant.kv_share) == (0, 0)
        limits = tenant_limits_get(tenant)
        # the marker canary's probe at the limit while the tenant's other probes are owed: admitted
        assert tenant_admission_check(name, TenantUsage(in_flight=20, held_tokens=0, owed_tokens=500), limits,
                                      need_tokens=8192, smallest_pool_tokens=8192) is None

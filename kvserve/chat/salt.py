"""The prefix-cache salt of a request, derived by the server: HMAC(deployment key, tenant scope [, user]).

A tenant's scope is its own id unless the operator put it in a share group (KVSERVE_PREFIX_SHARE_GROUPS).
The request's `user` field can only narrow a scope (a second HMAC input), never name or widen one.
"""
import hashlib
import hmac
import json


def share_groups_parse(text: str) -> dict[str, str]:
    """`"group=tenant1,tenant2;other=t3"` -> {tenant name: group}; ValueError when malformed or when a
    tenant is listed in two groups."""
    groups: dict[str, str] = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        name, eq, members = part.partition("=")
        name = name.strip()
        tenants = [t.strip() for t in members.split(",") if t.strip()]
        if not eq or not name or not tenants:
            raise ValueError(f"KVSERVE_PREFIX_SHARE_GROUPS part {part!r}: write group=tenant1,tenant2")
        for tenant in tenants:
            if groups.get(tenant, name) != name:
                raise ValueError(f"KVSERVE_PREFIX_SHARE_GROUPS lists tenant {tenant!r} in groups "
                                 f"{groups[tenant]!r} and {name!r}; a tenant shares one scope at most")
            groups[tenant] = name
    return groups


def prefix_scope(tenant_id: int, tenant_name: str, groups: dict[str, str]) -> str:
    """The cache scope a tenant reads and writes: its own, or its share group's."""
    group = groups.get(tenant_name)
    return f"group:{group}" if group else f"tenant:{int(tenant_id)}"


def prefix_salt(key: bytes, scope: str, user: str | None = None) -> str:
    """64 hex characters. Equal only for the same scope and the same (or no) user."""
    message = json.dumps([scope, user or None]).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def request_salt(tenant, user: str | None, faults=()) -> str:
    """The salt of a request by `tenant` (a Tenant row, from its API key) with the request's `user` field.
    Under the `no_prefix_scope` fault (tests, canary proofs only) every tenant gets one scope."""
    from django.conf import settings

    if "no_prefix_scope" in faults:
        return prefix_salt(settings.KVSERVE_PREFIX_SALT_KEY.encode(), "fault:no_prefix_scope")
    scope = prefix_scope(tenant.id, tenant.name, share_groups_parse(settings.KVSERVE_PREFIX_SHARE_GROUPS))
    return prefix_salt(settings.KVSERVE_PREFIX_SALT_KEY.encode(), scope, user)


def scope_owners() -> dict[str, tuple[int | None, str]]:
    """salt -> (tenant id, tenant name) of every tenant's own scope, and (None, "share group g") of each share
    group's, for the dashboard's page map. A scope narrowed by `user` is in neither (it cannot be named)."""
    from django.conf import settings

    from kvserve.tenants.models import Tenant

    key, groups = settings.KVSERVE_PREFIX_SALT_KEY.encode(), share_groups_parse(settings.KVSERVE_PREFIX_SHARE_GROUPS)
    out: dict[str, tuple[int | None, str]] = {prefix_salt(key, f"group:{g}"): (None, f"share group {g}")
                                              for g in set(groups.values())}
    for tenant_id, name in Tenant.objects.values_list("id", "name"):
        if name not in groups:
            out[prefix_salt(key, prefix_scope(tenant_id, name, groups))] = (tenant_id, name)
    return out

"""API key lifecycle: create (raw key returned once), authenticate a raw key, revoke."""
import hashlib
import secrets

from django.db import transaction
from django.utils import timezone

from kvserve.tenants.models import ApiKey, Tenant

KEY_PREFIX = "kvs-"
DISPLAY_CHARS = len(KEY_PREFIX) + 8


def _hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


@transaction.atomic
def api_key_create(tenant_name: str) -> tuple[ApiKey, str]:
    """A new key for `tenant_name` (tenant created if new). The raw key exists only in the return value."""
    tenant, _ = Tenant.objects.get_or_create(name=tenant_name)
    raw = KEY_PREFIX + secrets.token_urlsafe(32)
    api_key = ApiKey.objects.create(tenant=tenant, prefix=raw[:DISPLAY_CHARS], key_hash=_hash(raw))
    return api_key, raw


def api_key_authenticate(raw: str) -> ApiKey | None:
    """The active key matching `raw`, or None (unknown, malformed or revoked)."""
    if not raw or not raw.startswith(KEY_PREFIX) or len(raw) > 200:
        return None
    return (
        ApiKey.objects.select_related("tenant")
        .filter(key_hash=_hash(raw), revoked_at__isnull=True)
        .first()
    )


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revokes the key (idempotent: the first revocation time is kept)."""
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key

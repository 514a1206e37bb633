"""DRF authentication by `Authorization: Bearer kvs-...`; the request's principal is the key's tenant."""
from dataclasses import dataclass

from rest_framework import authentication, exceptions

from kvserve.tenants.models import ApiKey, Tenant
from kvserve.tenants.services import api_key_authenticate


@dataclass(frozen=True)
class TenantPrincipal:
    """request.user for API calls: the tenant behind a valid key."""

    tenant: Tenant
    api_key: ApiKey
    is_authenticated: bool = True
    is_anonymous: bool = False

    @property
    def pk(self):
        return self.tenant.pk


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1").split()
        if not header:
            return None  # -> NotAuthenticated (401) unless the view allows anonymous access
        if header[0].lower() != self.keyword.lower() or len(header) != 2:
            raise exceptions.AuthenticationFailed("Malformed Authorization header; use 'Bearer <key>'.")
        api_key = api_key_authenticate(header[1])
        if api_key is None:
            raise exceptions.AuthenticationFailed("Incorrect API key provided.")
        return TenantPrincipal(tenant=api_key.tenant, api_key=api_key), api_key

    def authenticate_header(self, request):
        return f'{self.keyword} realm="kvserve"'  # makes DRF answer 401, not 403

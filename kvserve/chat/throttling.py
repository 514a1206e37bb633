"""Per-API-key request throttling (KVSERVE_THROTTLE_RATE, read per request), counted in the shared cache
so every web process sees the same history. A throttled call gets 429 with Retry-After, and is counted: for
/metrics (admission_rejections, reason rate_limited) and in its tenant's usage."""
from django.conf import settings
from rest_framework.throttling import SimpleRateThrottle

from kvserve.chat.metrics import admission_rejection_count_incr
from kvserve.tenants.usage import usage_refused

RATE_LIMITED = "rate_limited"


class ApiKeyRateThrottle(SimpleRateThrottle):
    scope = "api_key"

    def get_rate(self):
        rate = (settings.KVSERVE_THROTTLE_RATE or "").strip()
        return None if rate.lower() in ("", "off", "none") else rate

    def get_cache_key(self, request, view):
        api_key = getattr(request, "auth", None)
        if api_key is None:
            return None  # unauthenticated: refused by authentication, not counted here
        return self.cache_format % {"scope": self.scope, "ident": api_key.pk}

    def allow_request(self, request, view) -> bool:
        allowed = super().allow_request(request, view)
        if not allowed:
            admission_rejection_count_incr(RATE_LIMITED)
            usage_refused(request.auth.tenant_id)
        return allowed

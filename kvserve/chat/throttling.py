"""Per-API-key request throttling (KVSERVE_THROTTLE_RATE, read per request), counted in the shared cache
so every web process sees the same history. A throttled call gets 429 with Retry-After."""
from django.conf import settings
from rest_framework.throttling import SimpleRateThrottle


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

"""The dashboard's data as JSON, for staff users logged in to the admin (session cookie): GET /api/pools/ (live state)
and GET /api/history/?window=<s> (the recorded series, incidents/history.py)."""
from drf_spectacular.utils import extend_schema
from django.conf import settings
from rest_framework import exceptions
from rest_framework.authentication import SessionAuthentication
from rest_framework.permissions import IsAdminUser
from rest_framework.response import Response
from rest_framework.views import APIView

from incidents.history import history_get
from incidents.selectors import dashboard_get
from kvserve.errors import ApiError


class StaffApi(APIView):
    authentication_classes = [SessionAuthentication]
    permission_classes = [IsAdminUser]

    def permission_denied(self, request, message=None, code=None):
        raise exceptions.PermissionDenied("staff only: log in at /admin/ and send the session cookie")


def window_param(raw: str | None, default: int, *, low: int, high: float, param: str = "window") -> int:
    """Seconds from a query parameter; ApiError 400 naming `param` unless an integer in [low, high]."""
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ApiError(f"'{param}' must be whole seconds from {low} to {int(high)}", param=param,
                       code="invalid_window")
    return value


class PoolsApi(StaffApi):

    @extend_schema(exclude=True)  # an operator endpoint, not part of the tenant API
    def get(self, request):
        response = Response(dashboard_get(user=request.user))
        response["Cache-Control"] = "no-store"
        return response


class HistoryApi(StaffApi):
    @extend_schema(exclude=True)
    def get(self, request):
        window = window_param(request.query_params.get("window"), 3600, low=60,
                              high=settings.KVSERVE_HISTORY_RETENTION_S)
        response = Response(history_get(window_s=window))
        response["Cache-Control"] = "no-store"
        return response

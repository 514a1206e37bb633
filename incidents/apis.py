"""The dashboard's data as JSON, for staff users logged in to the admin (session cookie): GET /api/pools/ (live state)
GET /api/history/?window=<s> (the recorded series, incidents/history.py) and GET /api/usage/?from=&to= (per-tenant
usage, kvserve/tenants/usage.py; names for superusers only)."""
import datetime as dt

from drf_spectacular.utils import extend_schema
from django.conf import settings
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from rest_framework import exceptions
from rest_framework.authentication import SessionAuthentication
from rest_framework.permissions import IsAdminUser
from rest_framework.response import Response
from rest_framework.views import APIView

from incidents.history import history_get
from incidents.selectors import dashboard_get
from kvserve.errors import ApiError
from kvserve.tenants.usage import hour_of, usage_by_tenant


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


def _instant(raw: str, param: str) -> dt.datetime:
    try:  # both return None for what is not shaped like a date, and raise ValueError for 2026-13-45
        when = parse_datetime(raw)
        if when is None and (day := parse_date(raw)) is not None:
            when = dt.datetime.combine(day, dt.time())
    except ValueError:
        when = None
    if when is None:
        raise ApiError(f"'{param}' must be an ISO date or date-time (2026-12-01 or 2026-12-01T13:00Z)", param=param,
                       code="invalid_period")
    return when if timezone.is_aware(when) else when.replace(tzinfo=dt.timezone.utc)


def period_params(params, *, default_s: int) -> tuple[dt.datetime, dt.datetime]:
    """[from, to) from ISO `from` and `to` (UTC when no offset); by default the last default_s seconds up to the end
    of the current hour. 400 naming the parameter when unreadable or from >= to."""
    end = _instant(params["to"], "to") if params.get("to") else hour_of() + dt.timedelta(hours=1)
    start = _instant(params["from"], "from") if params.get("from") else end - dt.timedelta(seconds=default_s)
    if start >= end:
        raise ApiError("'from' must be before 'to'", param="from", code="invalid_period")
    return start, end


def usage_rows_for(user, rows: list[dict]) -> list[dict]:
    """Tenant names for superusers; others see "tenant #n", as on the page maps."""
    return [{**r, "tenant_name": r["tenant_name"] if user.is_superuser else None,
             "label": r["tenant_name"] if user.is_superuser else f"tenant #{r['tenant_id']}"} for r in rows]


class UsageApi(StaffApi):
    @extend_schema(exclude=True)
    def get(self, request):
        start, end = period_params(request.query_params, default_s=86400)
        rows = usage_rows_for(request.user, usage_by_tenant(start, end))
        response = Response({"from": start.isoformat(), "to": end.isoformat(), "tenants": rows})
        response["Cache-Control"] = "no-store"
        return response

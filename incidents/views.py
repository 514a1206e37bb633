"""Operator pages: /dashboard/, the billing CSV /dashboard/usage.csv, a canary run's page, /metrics, and the Workers
admin page (release a quarantined worker)."""
import hmac

import redis
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_http_methods
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from incidents.admin import RELEASE_PERMISSION, admin_worker_release
from incidents.apis import period_params
from incidents.canary.report import canary_run_report
from incidents.models import CanaryRun
from incidents.metrics import metrics_render
from incidents.pools import worker_admin_list
from incidents.selectors import dashboard_get
from kvserve.errors import ApiError, error_body
from kvserve.tenants.usage import usage_csv


@staff_member_required
@require_GET
def dashboard_view(request):
    context = {**admin.site.each_context(request), "title": "kvserve dashboard",
               "initial": dashboard_get(user=request.user)}
    response = render(request, "dashboard/index.html", context)
    response["Cache-Control"] = "no-store"
    return response


@staff_member_required
@require_GET
def canary_run_view(request, run_id: int):
    report = canary_run_report(get_object_or_404(CanaryRun, pk=run_id))
    context = {**admin.site.each_context(request), "title": f"Canary run #{run_id}", "report": report}
    return render(request, "dashboard/canary_run.html", context)


@staff_member_required
@require_GET
def usage_csv_view(request):
    """Per tenant per hour in [from, to) (ISO; by default the last 30 days), for billing; names for superusers."""
    try:
        start, end = period_params(request.GET, default_s=30 * 86400)
    except ApiError as exc:
        return JsonResponse(error_body(exc.detail, param=exc.param, code=exc.error_code), status=400)
    response = HttpResponse(usage_csv(start, end, names=request.user.is_superuser), content_type="text/csv")
    response["Content-Disposition"] = (f'attachment; filename="kvserve-usage-{start:%Y%m%dT%H%M}-'
                                       f'{end:%Y%m%dT%H%M}.csv"')
    response["Cache-Control"] = "no-store"
    return response


def metrics_access_error(request) -> JsonResponse | None:
    """None when the scrape may read /metrics: the request carries `Authorization: Bearer
    <KVSERVE_METRICS_TOKEN>` (constant-time compare), or it comes from a logged-in staff user."""
    token = settings.KVSERVE_METRICS_TOKEN
    if request.user.is_active and request.user.is_staff:
        return None
    scheme, _, sent = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), token.encode()):
        return None
    code = "invalid_metrics_token" if sent else "missing_metrics_token"
    response = JsonResponse(error_body("/metrics needs 'Authorization: Bearer <KVSERVE_METRICS_TOKEN>' (in "
                                       "Prometheus: the scrape config's `authorization` block).", code=code),
                            status=401)
    response["WWW-Authenticate"] = 'Bearer realm="kvserve metrics"'
    return response


@require_GET
def metrics_view(request):
    if (refused := metrics_access_error(request)) is not None:
        return refused
    # text format 0.0.4: what prometheus_client itself serves by default; every Prometheus parses it
    response = HttpResponse(metrics_render(), content_type=CONTENT_TYPE_PLAIN_0_0_4)
    response["Cache-Control"] = "no-store"
    return response


@require_http_methods(["GET", "POST"])
def workers_admin_view(request):
    """Wrapped in admin.site.admin_view (staff login, CSRF) by the URLconf."""
    can_release = request.user.has_perm(RELEASE_PERMISSION)
    if request.method == "POST":
        worker_id = request.POST.get("worker_id", "").strip()
        if not can_release:
            messages.error(request, "You need the 'Can add worker release' permission to release workers.")
        elif not worker_id or len(worker_id) > 200:
            messages.error(request, "No worker given.")
        else:
            release = admin_worker_release(request, worker_id, notes=request.POST.get("notes", "")[:2000]
                                           or "released from the Workers admin page")
            if release.was_quarantined:
                messages.success(request, f"Released {worker_id} (was: {release.quarantine_reason}).")
            else:
                messages.warning(request, f"{worker_id} was not quarantined; the release was logged anyway.")
        return redirect("admin-workers")
    try:
        workers, error = worker_admin_list(), ""
    except redis.RedisError as exc:
        workers, error = [], f"Redis unreachable ({exc.__class__.__name__}): the worker registry cannot be read"
    context = {**admin.site.each_context(request), "title": "Workers", "workers": workers, "error": error,
               "can_release": can_release}
    return render(request, "admin/workers.html", context)

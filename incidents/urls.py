"""Routes for the operator pages; kvserve/urls.py includes these before the admin site."""
from django.contrib import admin
from django.urls import path

from incidents.apis import HistoryApi, PoolsApi, UsageApi
from incidents.views import canary_run_view, dashboard_view, metrics_view, usage_csv_view, workers_admin_view

urlpatterns = [
    path("dashboard/", dashboard_view, name="dashboard"),
    path("api/pools/", PoolsApi.as_view(), name="api-pools"),
    path("dashboard/usage.csv", usage_csv_view, name="usage-csv"),
    path("dashboard/canary/<int:run_id>/", canary_run_view, name="canary-run"),
    path("api/history/", HistoryApi.as_view(), name="api-history"),
    path("api/usage/", UsageApi.as_view(), name="api-usage"),
    path("metrics", metrics_view, name="metrics"),
    path("admin/workers/", admin.site.admin_view(workers_admin_view), name="admin-workers"),
]

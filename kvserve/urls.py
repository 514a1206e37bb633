"""URL routes: admin, /healthz, OpenAPI schema and offline Swagger UI, operator pages (dashboard, /metrics)."""
from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from kvserve.apis import HealthzApi

urlpatterns = [
    path("", include("incidents.urls")),  # /dashboard/, /api/pools/, /metrics, /admin/workers/ (before admin/)
    path("admin/", admin.site.urls),
    path("healthz", HealthzApi.as_view(), name="healthz"),
    path("", include("kvserve.chat.urls")),  # /v1/chat/completions, /v1/models, /api/requests/<id>[/stream]
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
]

handler404 = "kvserve.errors.json_not_found"
handler500 = "kvserve.errors.json_server_error"

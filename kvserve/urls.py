"""URL routes: admin, /healthz, OpenAPI schema and offline Swagger UI."""
from django.contrib import admin
from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from kvserve.apis import HealthzApi

urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", HealthzApi.as_view(), name="healthz"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
]

handler404 = "kvserve.errors.json_not_found"
handler500 = "kvserve.errors.json_server_error"

"""OpenAPI schema and Swagger UI are served offline (assets from drf-spectacular-sidecar)."""
import re

import pytest

pytestmark = pytest.mark.django_db


def test_schema_lists_healthz(client):
    response = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    assert "/healthz" in response.json()["paths"]


def test_swagger_ui_uses_local_assets_only(client):
    page = client.get("/api/docs/").content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert assets and not [a for a in assets if a.startswith(("http:", "https:", "//"))]
    css = next(a for a in assets if a.endswith("swagger-ui.css"))
    response = client.get(css)
    assert response.status_code == 200
    assert b"swagger" in b"".join(response.streaming_content)

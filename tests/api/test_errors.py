"""Every error, not only auth, comes back as {"error": {"message", "type", "param", "code"}}."""
import pytest

from kvserve.tenants.services import api_key_create

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.api.urls_probe")]


@pytest.fixture
def auth():
    return {"HTTP_AUTHORIZATION": f"Bearer {api_key_create('acme')[1]}"}


def post(client, auth, body):
    return client.post("/probe/validate", body, content_type="application/json", **auth)


def test_validation_error_names_the_param(client, auth):
    response = post(client, auth, {"model": "m", "max_tokens": 0})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    assert error["code"] == "min_value"


def test_api_error_is_rendered_as_given(client, auth):
    response = post(client, auth, {"model": "m", "max_tokens": 5})
    assert response.status_code == 400
    assert response.json() == {"error": {
        "message": "This model's maximum context length is 10 tokens.",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}


def test_malformed_json(client, auth):
    response = client.post("/probe/validate", "{nope", content_type="application/json", **auth)
    assert response.status_code == 400 and response.json()["error"]["code"] == "parse_error"


def test_wrong_method(client, auth):
    response = client.delete("/probe/whoami", **auth)
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"


def test_unhandled_exception_is_500_without_internals(client, auth):
    client.raise_request_exception = False
    response = client.get("/probe/boom", **auth)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert b"secret internal detail" not in response.content


def test_unknown_url_is_json_404(client):
    response = client.get("/v1/nope")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"

"""OpenAPI pieces shared by the chat endpoints: the Bearer security scheme, the error body, and the request bodies
marked closed (`additionalProperties: false`: a field they do not list is a 400, kvserve/chat/surface.py)."""
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import serializers


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "kvserve.tenants.authentication.ApiKeyAuthentication"
    name = "ApiKeyAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "An API key: `Authorization: Bearer kvs-...`"}


class ErrorSerializer(serializers.Serializer):
    class ErrorDetailSerializer(serializers.Serializer):
        message = serializers.CharField()
        type = serializers.CharField()
        param = serializers.CharField(allow_null=True)
        code = serializers.CharField(allow_null=True)

    error = ErrorDetailSerializer()


def error_responses(*statuses: int) -> dict:
    return {status: ErrorSerializer for status in statuses}


# One server-sent event, as schemathesis and SSE clients see it: `data` is a chat.completion.chunk JSON object,
# an {"error": {...}} object, or the literal [DONE]. Keep-alives are SSE comments, not events.
SSE_EVENT_SCHEMA = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "A chat.completion.chunk JSON object, an OpenAI error object "
                                                  "({\"error\": {...}}), or `[DONE]` (always the last event)."},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


# Request bodies whose every key is checked: the registry's (surface_check) or a StrictSerializer's.
CLOSED_REQUEST_BODIES = ("ChatCompletionRequest", "CompletionRequest", "StreamOptions", "TokenizeRequest",
                         "DetokenizeRequest")


def closed_request_bodies(result, generator, request, public):
    """drf-spectacular postprocessing hook: the closed request bodies say so in the schema."""
    schemas = result.get("components", {}).get("schemas", {})
    for name in CLOSED_REQUEST_BODIES:
        if name in schemas:
            schemas[name]["additionalProperties"] = False
    return result

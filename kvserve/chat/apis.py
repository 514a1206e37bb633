"""The OpenAI-compatible chat API: POST /v1/chat/completions (JSON or SSE), GET /v1/models, and a
tenant's own requests at /api/requests/<id> (status, usage, timings, verdicts) and .../stream (SSE replay)."""
import jinja2
import redis
from django.conf import settings
from django.db import connection
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_field, extend_schema_serializer
from kombu.exceptions import OperationalError as BrokerError
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from kvserve.chat.fields import (MessageContentField, StopField, StrictBooleanField, StrictFloatField,
                                 StrictIntegerField, TextField)
from kvserve.chat.models import ChatRequest
from kvserve.chat.outputs import completion_chunks, completion_wait, output_stream_exists, sse_response
from kvserve.chat.parsers import LimitedJSONParser
from kvserve.chat.schema import SSE_EVENT_SCHEMA, error_responses
from kvserve.chat.selectors import chat_request_get_for_tenant, model_get, model_get_by_id, served_window_get
from kvserve.chat.services import chat_request_create
from kvserve.chat.throttling import ApiKeyRateThrottle
from kvserve.errors import ApiError

SSE = "text/event-stream"
SEED_RANGE = (-(2**63), 2**63 - 1)
GREEDY_BELOW = 1e-8  # float32 logits: any temperature below this samples the argmax anyway
MIN_TOP_P = 1e-6  # keeps exactly the top token (its probability is >= 1/vocab > 1e-6), as any smaller top_p


def sampling_params_normalize(data: dict) -> dict:
    """The request's sampling parameters as stored and sent to the workers. A temperature or top_p so small
    that float32 arithmetic would underflow (and the engine fail) is replaced by the value with the same
    outcome: greedy, or top-1."""
    params = {k: data[k] for k in ("temperature", "top_p", "seed", "stop") if data.get(k) is not None}
    if params.get("temperature") is not None and params["temperature"] < GREEDY_BELOW:
        params["temperature"] = 0.0
    if params.get("top_p") is not None and params["top_p"] < MIN_TOP_P:
        params["top_p"] = MIN_TOP_P
    return params


def db_connection_release() -> None:
    """From here on the answer waits on Redis, for seconds or minutes: hand this thread's database connection
    back now (to the pool, or closed) rather than hold one per waiting client (PostgreSQL's max_connections)."""
    if not connection.in_atomic_block:  # a caller's transaction (tests) keeps its connection
        connection.close()


class ChatApiBase(APIView):
    """Bearer auth (project default), per-key throttling, the size-capped strict JSON parser; an
    unreachable Redis or broker is a 503, never a 500."""

    parser_classes = [LimitedJSONParser]
    throttle_classes = [ApiKeyRateThrottle]

    def handle_exception(self, exc):
        if isinstance(exc, (redis.RedisError, BrokerError)):
            exc = ApiError(f"A backend service is unreachable ({exc.__class__.__name__}); try again shortly.",
                           status_code=503, type="server_error", code="backend_unavailable")
        return super().handle_exception(exc)


class UsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()


@extend_schema_field({"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1, "nullable": True})
class TopPField(StrictFloatField):
    pass


class MessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=["system", "user", "assistant"])
    content = MessageContentField()
    name = TextField(required=False, max_length=256, help_text="Accepted and ignored.")


class StreamOptionsSerializer(serializers.Serializer):
    include_usage = StrictBooleanField(required=False, default=False)


@extend_schema_field({"type": "integer", "minimum": 1, "maximum": 1, "nullable": True,
                      "description": "Choices to generate: only 1 is supported (n > 1 is a 400 naming `n`)."})
class ChoiceCountField(StrictIntegerField):
    pass


class ChatCompletionsApi(ChatApiBase):
    @extend_schema_serializer(component_name="ChatCompletionRequest")
    class InputSerializer(serializers.Serializer):
        """OpenAI's request body; fields not listed here are ignored."""

        model = TextField(required=False, allow_null=True, max_length=256,
                          help_text="The served model's id (GET /v1/models); omitted means that model.")
        messages = serializers.ListField(child=MessageSerializer(), allow_empty=False, min_length=1, max_length=4096)
        max_tokens = StrictIntegerField(required=False, allow_null=True, min_value=1)
        max_completion_tokens = StrictIntegerField(required=False, allow_null=True, min_value=1)
        temperature = StrictFloatField(required=False, allow_null=True, min_value=0, max_value=2,
                                       help_text="0 (the default) is greedy decoding.")
        top_p = TopPField(required=False, allow_null=True, max_value=1)
        seed = StrictIntegerField(required=False, allow_null=True, min_value=SEED_RANGE[0], max_value=SEED_RANGE[1])
        stop = StopField(required=False, allow_null=True)
        stream = StrictBooleanField(required=False, allow_null=True, default=False)
        stream_options = StreamOptionsSerializer(required=False, allow_null=True)
        n = ChoiceCountField(required=False, allow_null=True, min_value=1)
        user = TextField(required=False, allow_null=True, max_length=256, help_text="Accepted and ignored.")

        def get_fields(self):
            fields = super().get_fields()
            window = served_window_get()  # per request, from live registrations: never a second config
            for name in ("max_tokens", "max_completion_tokens"):
                fields[name] = StrictIntegerField(
                    required=False, allow_null=True, min_value=1, max_value=window,
                    help_text=f"Tokens to generate, 1..{window} (default {settings.KVSERVE_DEFAULT_MAX_TOKENS}); "
                              "prompt + max tokens must fit the live workers' limit.")
            return fields

        def validate_top_p(self, value):
            if value is not None and value <= 0:
                raise serializers.ValidationError("Ensure this value is greater than 0.", code="min_value")
            return value

        def validate_n(self, value):
            if value not in (None, 1):
                raise serializers.ValidationError("n > 1 is not supported: this server returns one choice.",
                                                  code="unsupported_value")
            return value

    @extend_schema_serializer(component_name="ChatCompletion")
    class OutputSerializer(serializers.Serializer):
        @extend_schema_serializer(component_name="ChatCompletionChoice")
        class ChoiceSerializer(serializers.Serializer):
            @extend_schema_serializer(component_name="AssistantMessage")
            class MessageOutSerializer(serializers.Serializer):
                role = serializers.CharField()
                content = serializers.CharField(trim_whitespace=False)

            index = serializers.IntegerField()
            message = MessageOutSerializer()
            finish_reason = serializers.ChoiceField(choices=["stop", "length"])
            logprobs = serializers.JSONField(allow_null=True)

        id = serializers.CharField()
        object = serializers.CharField()
        created = serializers.IntegerField()
        model = serializers.CharField()
        system_fingerprint = serializers.CharField()
        choices = ChoiceSerializer(many=True)
        usage = UsageSerializer()

    @extend_schema(
        operation_id="chat_completions_create",
        request=InputSerializer,
        responses={
            (200, "application/json"): OutputSerializer,
            (200, SSE): OpenApiResponse(SSE_EVENT_SCHEMA, description="With `stream: true`: chat.completion.chunk "
                                        "events (`data: {...}`), a failure as `data: {\"error\": {...}}`, "
                                        "then `data: [DONE]`."),
            **error_responses(400, 401, 404, 413, 415, 429, 503),
        },
        description="Create a chat completion. Admission happens before anything is reserved: a prompt plus "
                    "max tokens over the live limit is a 400 `context_length_exceeded`; no live workers is a 503. "
                    "A failure on the workers is a 503 `server_error` with the failure's code (never a 200).",
    )
    def post(self, request):
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        model = model_get_by_id(data.get("model"))
        max_tokens = data.get("max_completion_tokens") or data.get("max_tokens") or settings.KVSERVE_DEFAULT_MAX_TOKENS
        params = sampling_params_normalize(data)
        messages = [{"role": m["role"], "content": m["content"]} for m in data["messages"]]
        stream = bool(data.get("stream"))
        try:
            req, _ = chat_request_create(api_key=request.auth, messages=messages, max_tokens=max_tokens,
                                         params=params, stream=stream)
        except jinja2.TemplateError as exc:
            raise ApiError(f"The model's chat template refused these messages: {exc}", param="messages",
                           code="invalid_messages")
        db_connection_release()
        if stream:
            include_usage = bool((data.get("stream_options") or {}).get("include_usage"))
            return sse_response(completion_chunks(req, include_usage=include_usage, fingerprint=model["fingerprint"]))
        return Response(self.OutputSerializer(completion_wait(req, fingerprint=model["fingerprint"])).data)


@extend_schema_serializer(component_name="Model")
class ModelOutputSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField()
    created = serializers.IntegerField()
    owned_by = serializers.CharField()


class ModelListApi(ChatApiBase):
    @extend_schema_serializer(component_name="ModelList")
    class OutputSerializer(serializers.Serializer):
        object = serializers.CharField()
        data = ModelOutputSerializer(many=True)

    @extend_schema(operation_id="models_list", responses={200: OutputSerializer, **error_responses(401, 429)})
    def get(self, request):
        return Response(self.OutputSerializer({"object": "list", "data": [model_get()]}).data)


class ModelDetailApi(ChatApiBase):
    @extend_schema(operation_id="models_retrieve", responses={200: ModelOutputSerializer, **error_responses(401, 404, 429)})
    def get(self, request, model_id):
        return Response(ModelOutputSerializer(model_get_by_id(model_id) if model_id else None).data)


class ChatRequestDetailApi(ChatApiBase):
    @extend_schema_serializer(component_name="ChatRequest")
    class OutputSerializer(serializers.Serializer):
        @extend_schema_serializer(component_name="ChatRequestTimings")
        class TimingsSerializer(serializers.Serializer):
            queued_ms = serializers.FloatField(allow_null=True)
            prefill_ms = serializers.FloatField(allow_null=True)
            transfer_ms = serializers.FloatField(allow_null=True)
            decode_ms = serializers.FloatField(allow_null=True)
            total_ms = serializers.FloatField(allow_null=True)

        @extend_schema_serializer(component_name="ChatRequestVerdicts")
        class VerdictsSerializer(serializers.Serializer):
            handoff = serializers.CharField(allow_null=True)
            decode = serializers.CharField(allow_null=True)

        @extend_schema_serializer(component_name="ChatRequestWorkers")
        class WorkersSerializer(serializers.Serializer):
            prefill = serializers.CharField(allow_null=True)
            decode = serializers.CharField(allow_null=True)

        @extend_schema_serializer(component_name="ChatRequestError")
        class RequestErrorSerializer(serializers.Serializer):
            code = serializers.CharField()
            message = serializers.CharField()

        id = serializers.CharField()
        object = serializers.CharField()
        status = serializers.ChoiceField(choices=ChatRequest.Status.values)
        model = serializers.CharField()
        stream = serializers.BooleanField()
        created = serializers.IntegerField()
        max_tokens = serializers.IntegerField()
        params = serializers.DictField()
        finish_reason = serializers.CharField(allow_null=True)
        usage = UsageSerializer()
        timings = TimingsSerializer()
        verdicts = VerdictsSerializer()
        workers = WorkersSerializer()
        error = RequestErrorSerializer(allow_null=True)

    @staticmethod
    def represent(req) -> dict:
        return {
            "id": req.id, "object": "chat.request", "status": req.status, "model": req.model, "stream": req.stream,
            "created": int(req.created_at.timestamp()), "max_tokens": req.max_tokens, "params": req.params,
            "finish_reason": req.finish_reason or None,
            "usage": {"prompt_tokens": req.prompt_tokens, "completion_tokens": req.completion_tokens,
                      "total_tokens": req.prompt_tokens + req.completion_tokens},
            "timings": req.timings(),
            "verdicts": {"handoff": req.handoff_verdict or None, "decode": req.decode_verdict or None},
            "workers": {"prefill": req.prefill_worker or None, "decode": req.decode_worker or None},
            "error": {"code": req.error_code, "message": req.error_message} if req.error_code else None,
        }

    @extend_schema(operation_id="requests_retrieve", responses={200: OutputSerializer, **error_responses(401, 404, 429)})
    def get(self, request, request_id):
        req = chat_request_get_for_tenant(tenant=request.auth.tenant, request_id=request_id)
        return Response(self.OutputSerializer(self.represent(req)).data)


class ChatRequestStreamApi(ChatApiBase):
    @extend_schema(
        operation_id="requests_stream",
        responses={(200, SSE): OpenApiResponse(SSE_EVENT_SCHEMA, description="The request's output replayed as "
                                               "chat.completion.chunk events with a usage chunk, then `[DONE]`."),
                   **error_responses(401, 404, 410, 429)},
        description="Replays a request's output from its first event (live if it is still running). 410 once "
                    "a finished request's events have expired.",
    )
    def get(self, request, request_id):
        req = chat_request_get_for_tenant(tenant=request.auth.tenant, request_id=request_id)
        if req.is_final and not output_stream_exists(req):
            raise ApiError(f"The events of request '{req.id}' have expired.", status_code=410, code="stream_expired")
        db_connection_release()
        return sse_response(completion_chunks(req, include_usage=True, fingerprint=model_get()["fingerprint"]))

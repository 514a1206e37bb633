"""The OpenAI-compatible API: POST /v1/chat/completions and /v1/completions (JSON or SSE), GET /v1/models, and a
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

from kvserve.chat.fields import (LogitBiasField, MessageContentField, PromptField, StopField, StrictBooleanField,
                                 StrictFloatField, StrictIntegerField, StrictSerializer, TextField, TokenIdListField)
from kvserve.chat.disconnect import client_gone
from kvserve.chat.models import ChatRequest
from kvserve.chat.outputs import completion_chunks, completion_wait, output_stream_exists, sse_response
from kvserve.chat.parsers import LimitedJSONParser
from kvserve.chat.shapes import shape_for
from kvserve.chat.surface import CHAT, COMPLETIONS, surface_check, surface_fields
from kvserve.chat.structured import structured_compile_check, structured_validate
from kvserve.chat.schema import SSE_EVENT_SCHEMA, error_responses
from kvserve.chat.selectors import chat_request_get_for_tenant, model_get, model_get_by_id, served_window_get
from kvserve.chat.services import chat_request_create
from kvserve.chat.throttling import ApiKeyRateThrottle
from kvserve.chat.tokenizer import tokenizer_get
from kvserve.errors import ApiError
from inference.choices import MAX_CHOICES
from inference.params import RequestParams, Sampling
from inference.sampling import MAX_TOP_LOGPROBS

SSE = "text/event-stream"
SEED_RANGE = (-(2**63), 2**63 - 1)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's is KVSERVE_DEFAULT_MAX_TOKENS)
GREEDY_BELOW = 1e-8  # float32 logits: any temperature below this samples the argmax anyway
MIN_TOP_P = 1e-6  # keeps exactly the top token (its probability is >= 1/vocab > 1e-6), as any smaller top_p


def request_sampling(data: dict, logprobs: int | None) -> Sampling:
    """The request's sampling choices as stored and sent to the workers. A temperature or top_p so small
    that float32 arithmetic would underflow (and the engine fail) is replaced by the value with the same
    outcome: greedy, or top-1."""
    temperature, top_p = data.get("temperature"), data.get("top_p")
    if temperature is not None and temperature < GREEDY_BELOW:
        temperature = 0.0
    if top_p is not None and top_p < MIN_TOP_P:
        top_p = MIN_TOP_P
    top_k = data.get("top_k")
    return Sampling(temperature=temperature, top_p=top_p, seed=data.get("seed"), stop=data.get("stop"),
                    logprobs=logprobs, top_k=top_k if top_k not in (-1, 0) else None,  # -1 and 0: off (vLLM)
                    structured=data.get("structured"),
                    **{name: data.get(name) for name in SAMPLING_KNOBS if name != "top_k"})


# vLLM's and OpenAI's sampling fields beyond temperature, top_p, seed and stop: the same on both endpoints
SAMPLING_KNOBS = ("top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
                  "min_tokens", "stop_token_ids", "include_stop_str_in_output", "ignore_eos")


def sampling_knob_fields(vocab_size: int) -> dict:
    """The serializer fields of SAMPLING_KNOBS, strict and ranged as vLLM and OpenAI define them."""
    return {
        "top_k": StrictIntegerField(required=False, allow_null=True, min_value=-1,
                                    help_text="Keep the k most likely tokens; -1 or 0 (the default) is off."),
        "min_p": StrictFloatField(required=False, allow_null=True, min_value=0, max_value=1,
                                  help_text="Keep tokens at least min_p times as likely as the most likely; 0 is off."),
        "frequency_penalty": StrictFloatField(required=False, allow_null=True, min_value=-2, max_value=2,
                                              help_text="Subtracted from a token's logit per time it was output."),
        "presence_penalty": StrictFloatField(required=False, allow_null=True, min_value=-2, max_value=2,
                                             help_text="Subtracted from a token's logit once it was output."),
        "repetition_penalty": RepetitionPenaltyField(required=False, allow_null=True, max_value=2,
                                                     help_text="vLLM's: a prompt or output token's positive logit "
                                                               "is divided by it, a negative one multiplied; 0 < x "
                                                               "<= 2, 1 (the default) is off."),
        "logit_bias": LogitBiasField(vocab_size=vocab_size, required=False, allow_null=True),
        "min_tokens": StrictIntegerField(required=False, allow_null=True, min_value=0,
                                         help_text="Tokens generated before EOS, stop_token_ids or a stop string "
                                                   "may end the answer (<= the max tokens)."),
        "stop_token_ids": TokenIdListField(vocab_size=vocab_size, required=False, allow_null=True,
                                           help_text="Token ids that end the answer (finish_reason stop; their "
                                                     "text is not included)."),
        "include_stop_str_in_output": StrictBooleanField(required=False, allow_null=True,
                                                         help_text="Keep the stop string that ended the answer."),
        "ignore_eos": StrictBooleanField(required=False, allow_null=True,
                                         help_text="Generate past the end-of-sequence token, up to the max tokens."),
    }


def validate_min_tokens(data: dict, max_tokens: int) -> None:
    if (data.get("min_tokens") or 0) > max_tokens:
        raise serializers.ValidationError({"min_tokens": serializers.ErrorDetail(
            f"min_tokens {data['min_tokens']} is more than the max tokens ({max_tokens}).", code="max_value")})


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


class PromptTokensDetailsSerializer(serializers.Serializer):
    cached_tokens = serializers.IntegerField(help_text="Prompt tokens whose KV came from the prefix cache of the "
                                                       "request's own tenant (and user, when given).")


class UsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    prompt_tokens_details = PromptTokensDetailsSerializer(required=False)


@extend_schema_field({"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1, "nullable": True})
class TopPField(StrictFloatField):
    pass


@extend_schema_field({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES, "nullable": True,
                      "description": f"Choices: 1..{MAX_CHOICES} (more is a 400 naming the field). The prompt is "
                                     "prefilled once and its pages shared by every choice."})
class ChoiceCountField(StrictIntegerField):
    pass


def validate_choices(data: dict) -> dict:
    """n <= best_of, and best_of > n (the best n of best_of, known only at the end) is never streamed."""
    n, best_of = data.get("n") or 1, data.get("best_of")
    if max(n, best_of or 1) > 1 and data.get("tools") and data.get("tool_choice") != "none":
        param = "n" if n > 1 else "best_of"
        raise serializers.ValidationError({param: serializers.ErrorDetail(
            f"{param} > 1 with tools is not supported: send one request per choice.", code="unsupported_value")})
    if best_of is not None and best_of < n:
        raise serializers.ValidationError({"best_of": serializers.ErrorDetail(
            f"best_of ({best_of}) must be at least n ({n}).", code="invalid")})
    if best_of is not None and best_of > n and data.get("stream"):
        raise serializers.ValidationError({"best_of": serializers.ErrorDetail(
            "best_of > n cannot be streamed: which choices are the best is known only when all have ended.",
            code="unsupported_value")})
    return data


def choice_counts(data: dict) -> dict:
    """RequestParams' n and best_of of a validated body (None: not set)."""
    return {"n": data.get("n"), "best_of": data.get("best_of")}


@extend_schema_field({"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 2, "nullable": True})
class RepetitionPenaltyField(StrictFloatField):
    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        if value <= 0:
            raise serializers.ValidationError("Ensure this value is greater than 0.", code="min_value")
        return value


class ToolCallFunctionSerializer(serializers.Serializer):
    name = TextField(max_length=64)
    arguments = TextField(help_text="The arguments object as a JSON string.")


class ToolCallSerializer(serializers.Serializer):
    id = TextField(required=False, max_length=256)
    type = serializers.ChoiceField(choices=["function"], required=False, default="function")
    function = ToolCallFunctionSerializer()


class MessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=["system", "user", "assistant", "tool"])
    content = MessageContentField(required=False, allow_null=True)
    name = TextField(required=False, max_length=256, help_text="The participant's name; the served model's chat "
                                                               "template has no place for it (not in the prompt).")
    tool_calls = ToolCallSerializer(many=True, required=False, allow_null=True,
                                    help_text="An assistant turn's calls, shown to the model as <tool_call> blocks.")
    tool_call_id = TextField(required=False, allow_null=True, max_length=256,
                             help_text="A tool turn's call id (its content is shown as a <tool_response>).")

    def validate(self, data):
        if data.get("content") is None and not (data["role"] == "assistant" and data.get("tool_calls")):
            code = "null" if "content" in data else "required"
            raise serializers.ValidationError({"content": serializers.ErrorDetail(
                "content is required (it may be null only in an assistant turn with tool_calls).", code=code)})
        if data.get("tool_calls") and data["role"] != "assistant":
            raise serializers.ValidationError({"tool_calls": serializers.ErrorDetail(
                "Only an assistant turn has tool_calls.", code="invalid")})
        return data


class StreamOptionsSerializer(StrictSerializer):
    include_usage = StrictBooleanField(required=False, default=False,
                                       help_text="A last chunk with the request's usage (and no choices).")
    continuous_usage_stats = StrictBooleanField(required=False, default=False,
                                                help_text="vLLM's: every chunk carries `usage` so far.")


def constraint_field(description: str, schema: dict | None = None) -> serializers.JSONField:
    """A structured-output field, read by kvserve/chat/structured.py (which names the field in every 400)."""
    field = extend_schema_field({**(schema or {}), "nullable": True, "description": description})(serializers.JSONField)
    return field(required=False, allow_null=True)


def response_format_field():
    return constraint_field("`{\"type\": \"text\"}` (the default), `{\"type\": \"json_object\"}` or `{\"type\": "
                            "\"json_schema\", \"json_schema\": {\"name\", \"schema\", \"strict\"}}`: the output is "
                            "constrained to parse (and validate against the schema).",
                            {"type": "object", "required": ["type"],
                             "properties": {"type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                                            "json_schema": {"type": "object"}}})


def guided_fields() -> dict:
    """vLLM's structured-output fields, on chat and completions alike."""
    return {
        "response_format": response_format_field(),
        "structured_outputs": constraint_field("vLLM's: exactly one of json (schema), regex, choice, grammar (EBNF), "
                                               "json_object.", {"type": "object"}),
        "guided_json": constraint_field("vLLM's: the output validates against this JSON schema."),
        "guided_regex": constraint_field("vLLM's: the output matches this regex.", {"type": "string"}),
        "guided_choice": constraint_field("vLLM's: the output is one of these strings.",
                                          {"type": "array", "items": {"type": "string"}}),
        "guided_grammar": constraint_field("vLLM's: the output follows this EBNF grammar (root rule `root`).",
                                           {"type": "string"}),
    }


class TopLogprobSerializer(serializers.Serializer):
    token = serializers.CharField(trim_whitespace=False)
    logprob = serializers.FloatField()
    bytes = serializers.ListField(child=serializers.IntegerField(min_value=0, max_value=255))


@extend_schema_serializer(component_name="ChatTokenLogprob")
class TokenLogprobSerializer(TopLogprobSerializer):
    top_logprobs = TopLogprobSerializer(many=True)


@extend_schema_serializer(component_name="ChatLogprobs")
class ChatLogprobsSerializer(serializers.Serializer):
    content = TokenLogprobSerializer(many=True)
    refusal = serializers.JSONField(allow_null=True, required=False)


def chat_max_tokens(data: dict) -> int:
    return data.get("max_completion_tokens") or data.get("max_tokens") or settings.KVSERVE_DEFAULT_MAX_TOKENS


def validate_stream_options(data: dict) -> dict:
    """stream_options without stream: true would do nothing, so it is a 400 (as OpenAI's and vLLM's)."""
    if data.get("stream_options") is not None and not data.get("stream"):
        raise serializers.ValidationError({"stream_options": serializers.ErrorDetail(
            "stream_options is only allowed with stream: true.", code="invalid")})
    return data


class ChatCompletionsApi(ChatApiBase):
    @extend_schema_serializer(component_name="ChatCompletionRequest")
    class InputSerializer(serializers.Serializer):
        """OpenAI's request body. Fields at their default only are listed with the values they take; any other
        field (or value) is a 400 naming it (kvserve/chat/surface.py)."""

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
        n = ChoiceCountField(required=False, allow_null=True, min_value=1, max_value=MAX_CHOICES)
        best_of = ChoiceCountField(required=False, allow_null=True, min_value=1, max_value=MAX_CHOICES,
                                   help_text="Generate this many choices and return the n with the highest "
                                             "cumulative logprob (not with stream).")
        user = TextField(required=False, allow_null=True, max_length=256,
                         help_text="Narrows prefix-cache sharing: cached prompt pages are reused only within "
                                   "the same tenant and user.")
        logprobs = StrictBooleanField(required=False, allow_null=True, default=False,
                                      help_text="Return each output token's log-probability (choices[].logprobs).")
        top_logprobs = StrictIntegerField(required=False, allow_null=True, min_value=0, max_value=MAX_TOP_LOGPROBS,
                                          help_text="With logprobs: the most likely alternatives per token, 0..20.")
        tools = constraint_field("Function tools: `{\"type\": \"function\", \"function\": {\"name\", "
                                 "\"description\", \"parameters\"}}`; calls come back as message.tool_calls.",
                                 {"type": "array", "items": {"type": "object"}})
        tool_choice = constraint_field("none, auto (the default with tools), required, or `{\"type\": \"function\", "
                                       "\"function\": {\"name\"}}`.")
        parallel_tool_calls = StrictBooleanField(required=False, allow_null=True,
                                                 help_text="With tool_choice required/auto: more than one call may "
                                                           "be made (default true).")

        def get_fields(self):
            fields = {**super().get_fields(), **surface_fields(CHAT), **guided_fields()}
            window = served_window_get()  # per request, from live registrations: never a second config
            for name in ("max_tokens", "max_completion_tokens"):
                fields[name] = StrictIntegerField(
                    required=False, allow_null=True, min_value=1, max_value=window,
                    help_text=f"Tokens to generate, 1..{window} (default {settings.KVSERVE_DEFAULT_MAX_TOKENS}); "
                              "prompt + max tokens must fit the live workers' limit.")
            fields.update(sampling_knob_fields(tokenizer_get()[0].vocab_size))
            return fields

        def validate_top_p(self, value):
            if value is not None and value <= 0:
                raise serializers.ValidationError("Ensure this value is greater than 0.", code="min_value")
            return value

        def validate(self, data):
            if data.get("top_logprobs") is not None and not data.get("logprobs"):
                raise serializers.ValidationError({"top_logprobs": serializers.ErrorDetail(
                    "top_logprobs needs logprobs: true.", code="invalid")})
            validate_min_tokens(data, chat_max_tokens(data))
            return validate_choices(validate_stream_options(structured_validate(data, tools_allowed=True)))

    @extend_schema_serializer(component_name="ChatCompletion")
    class OutputSerializer(serializers.Serializer):
        @extend_schema_serializer(component_name="ChatCompletionChoice")
        class ChoiceSerializer(serializers.Serializer):
            @extend_schema_serializer(component_name="AssistantMessage")
            class MessageOutSerializer(serializers.Serializer):
                role = serializers.CharField()
                content = serializers.CharField(trim_whitespace=False, allow_null=True, allow_blank=True)
                tool_calls = ToolCallSerializer(many=True, required=False)

            index = serializers.IntegerField()
            message = MessageOutSerializer()
            finish_reason = serializers.ChoiceField(choices=["stop", "length", "tool_calls"])
            logprobs = ChatLogprobsSerializer(allow_null=True)

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
        surface_check(CHAT, request.data)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        model = model_get_by_id(data.get("model"))
        max_tokens = chat_max_tokens(data)
        logprobs = (data.get("top_logprobs") or 0) if data.get("logprobs") else None
        # `user` narrows the request's prefix-cache scope (kvserve/chat/salt.py)
        structured_compile_check(data["structured"], data["structured_param"])
        calls = data["tool_choice"] != "none" and bool(data["tools"])  # the answer's <tool_call>s are tool_calls
        params = RequestParams(request_sampling(data, logprobs), user=data.get("user") or None, tool_calls=calls,
                               **choice_counts(data))
        messages = [{k: m[k] for k in ("role", "content", "tool_calls", "tool_call_id") if m.get(k) is not None}
                    for m in data["messages"]]
        stream = bool(data.get("stream"))
        try:
            req, _ = chat_request_create(api_key=request.auth, messages=messages, max_tokens=max_tokens,
                                         params=params, stream=stream, tools=data["tools"] if calls else None)
        except jinja2.TemplateError as exc:
            raise ApiError(f"The model's chat template refused these messages: {exc}", param="messages",
                           code="invalid_messages")
        db_connection_release()
        if stream:
            options = data.get("stream_options") or {}
            return sse_response(completion_chunks(req, include_usage=bool(options.get("include_usage")),
                                                  continuous_usage=bool(options.get("continuous_usage_stats")),
                                                  fingerprint=model["fingerprint"], ends_request=True,
                                                  shape=shape_for(params)))
        answer = completion_wait(req, fingerprint=model["fingerprint"], gone=client_gone(request),
                                 shape=shape_for(params))
        return Response(self.OutputSerializer(answer).data)


@extend_schema_serializer(component_name="CompletionLogprobs")
class CompletionLogprobsSerializer(serializers.Serializer):
    tokens = serializers.ListField(child=serializers.CharField(trim_whitespace=False, allow_blank=True))
    token_logprobs = serializers.ListField(child=serializers.FloatField())
    top_logprobs = serializers.ListField(child=serializers.DictField(child=serializers.FloatField()))
    text_offset = serializers.ListField(child=serializers.IntegerField())


class CompletionsApi(ChatApiBase):
    """The legacy completions endpoint: one prompt, used as given (no chat template). Admission, errors,
    throttling and tenancy are the chat endpoint's: the same service admits both."""

    @extend_schema_serializer(component_name="CompletionRequest")
    class InputSerializer(serializers.Serializer):
        """OpenAI's request body. Fields at their default only are listed with the values they take; any other
        field (or value) is a 400 naming it (kvserve/chat/surface.py)."""

        model = TextField(required=False, allow_null=True, max_length=256,
                          help_text="The served model's id (GET /v1/models); omitted means that model.")
        max_tokens = StrictIntegerField(required=False, allow_null=True, min_value=1)
        temperature = StrictFloatField(required=False, allow_null=True, min_value=0, max_value=2,
                                       help_text="0 (the default) is greedy decoding.")
        top_p = TopPField(required=False, allow_null=True, max_value=1)
        seed = StrictIntegerField(required=False, allow_null=True, min_value=SEED_RANGE[0], max_value=SEED_RANGE[1])
        stop = StopField(required=False, allow_null=True)
        stream = StrictBooleanField(required=False, allow_null=True, default=False)
        stream_options = StreamOptionsSerializer(required=False, allow_null=True)
        n = ChoiceCountField(required=False, allow_null=True, min_value=1, max_value=MAX_CHOICES)
        best_of = ChoiceCountField(required=False, allow_null=True, min_value=1, max_value=MAX_CHOICES,
                                   help_text="Generate this many choices and return the n with the highest "
                                             "cumulative logprob (not with stream).")
        logprobs = StrictIntegerField(required=False, allow_null=True, min_value=0, max_value=5,
                                      help_text="Return each token's log-probability and this many alternatives.")
        user = TextField(required=False, allow_null=True, max_length=256,
                         help_text="Narrows prefix-cache sharing: cached prompt pages are reused only within "
                                   "the same tenant and user.")

        def get_fields(self):
            fields = {**super().get_fields(), **surface_fields(COMPLETIONS), **guided_fields()}
            window = served_window_get()
            fields["prompt"] = PromptField(vocab_size=tokenizer_get()[0].vocab_size)
            fields["max_tokens"] = StrictIntegerField(
                required=False, allow_null=True, min_value=1, max_value=window,
                help_text=f"Tokens to generate, 1..{window} (default {COMPLETIONS_DEFAULT_MAX_TOKENS}, as "
                          "OpenAI's); prompt + max tokens must fit the live workers' limit.")
            fields.update(sampling_knob_fields(tokenizer_get()[0].vocab_size))
            return fields

        def validate(self, data):
            validate_min_tokens(data, data.get("max_tokens") or COMPLETIONS_DEFAULT_MAX_TOKENS)
            return validate_choices(validate_stream_options(structured_validate(data, tools_allowed=False)))

        validate_top_p = ChatCompletionsApi.InputSerializer.validate_top_p

    @extend_schema_serializer(component_name="TextCompletion")
    class OutputSerializer(serializers.Serializer):
        @extend_schema_serializer(component_name="TextCompletionChoice")
        class ChoiceSerializer(serializers.Serializer):
            index = serializers.IntegerField()
            text = serializers.CharField(trim_whitespace=False, allow_blank=True)
            finish_reason = serializers.ChoiceField(choices=["stop", "length"])
            logprobs = CompletionLogprobsSerializer(allow_null=True)

        id = serializers.CharField()
        object = serializers.CharField()
        created = serializers.IntegerField()
        model = serializers.CharField()
        system_fingerprint = serializers.CharField()
        choices = ChoiceSerializer(many=True)
        usage = UsageSerializer()

    @extend_schema(
        operation_id="completions_create",
        request=InputSerializer,
        responses={
            (200, "application/json"): OutputSerializer,
            (200, SSE): OpenApiResponse(SSE_EVENT_SCHEMA, description="With `stream: true`: text_completion "
                                        "events (`data: {...}`), a failure as `data: {\"error\": {...}}`, then "
                                        "`data: [DONE]`."),
            **error_responses(400, 401, 404, 413, 415, 429, 503),
        },
        description="Create a completion of a raw prompt (a string or token ids; no chat template). Admission, "
                    "errors, throttling and tenancy are those of chat completions.",
    )
    def post(self, request):
        surface_check(COMPLETIONS, request.data)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        model = model_get_by_id(data.get("model"))
        structured_compile_check(data["structured"], data["structured_param"])
        params = RequestParams(request_sampling(data, data.get("logprobs")), user=data.get("user") or None,
                               endpoint="completions", **choice_counts(data))
        stream = bool(data.get("stream"))
        req, _ = chat_request_create(api_key=request.auth, prompt=data["prompt"], params=params, stream=stream,
                                     max_tokens=data.get("max_tokens") or COMPLETIONS_DEFAULT_MAX_TOKENS)
        db_connection_release()
        shape = shape_for(params)
        if stream:
            options = data.get("stream_options") or {}
            return sse_response(completion_chunks(req, include_usage=bool(options.get("include_usage")),
                                                  continuous_usage=bool(options.get("continuous_usage_stats")),
                                                  fingerprint=model["fingerprint"], ends_request=True, shape=shape))
        answer = completion_wait(req, fingerprint=model["fingerprint"], gone=client_gone(request), shape=shape)
        return Response(self.OutputSerializer(answer).data)


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
            "created": int(req.created_at.timestamp()), "max_tokens": req.max_tokens,
            "params": req.request_params.flat(),
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
        return sse_response(completion_chunks(req, include_usage=True, fingerprint=model_get()["fingerprint"],
                                              shape=shape_for(req.request_params)))

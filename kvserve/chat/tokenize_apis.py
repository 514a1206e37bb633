"""vLLM's utility endpoints, tenant-authenticated like the chat API: POST /tokenize (a prompt or messages to the
token ids admission would use), POST /detokenize (token ids to text) and GET /version."""
import jinja2
from django.conf import settings
from drf_spectacular.utils import extend_schema, extend_schema_field, extend_schema_serializer
from rest_framework import serializers
from rest_framework.response import Response

from kvserve.chat.apis import ChatApiBase, MessageSerializer
from kvserve.chat.fields import StrictBooleanField, StrictSerializer, TextField
from kvserve.chat.schema import error_responses
from kvserve.chat.selectors import model_get_by_id
from kvserve.chat.services import prompt_tokenize
from kvserve.chat.tokenizer import tokenizer_get
from kvserve.errors import ApiError
from kvserve.workers import registry_get


@extend_schema_field({"type": "array", "items": {"type": "integer", "minimum": 0}})
class TokenIdsField(serializers.Field):
    """A list of ids of the served vocabulary (possibly empty)."""

    default_error_messages = {
        "invalid": "Expected a list of token ids.",
        "token": "Token id {value!r} at index {index} is not an id of this model's vocabulary (0..{top}).",
    }

    def to_internal_value(self, data):
        if not isinstance(data, list):
            self.fail("invalid")
        vocab_size = tokenizer_get()[0].vocab_size
        for index, value in enumerate(data):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
                self.fail("token", value=value, index=index, top=vocab_size - 1)
        return list(data)

    def to_representation(self, value):
        return value


def _default_only(data: dict, name: str, default: bool, why: str) -> None:
    if data.get(name) is not None and data[name] is not default:
        raise ApiError(f"'{name}' is accepted only as {str(default).lower()} here: {why}", param=name,
                       code="unsupported_value")


class TokenizeApi(ChatApiBase):
    @extend_schema_serializer(component_name="TokenizeRequest")
    class InputSerializer(StrictSerializer):
        """vLLM's two forms: `prompt` (tokenized as /v1/completions does) or `messages` (rendered with the chat
        template as /v1/chat/completions does); any other field is a 400 naming it."""

        model = TextField(required=False, allow_null=True, max_length=256)
        prompt = TextField(required=False, help_text="A raw prompt (no chat template); give it or `messages`.")
        messages = serializers.ListField(child=MessageSerializer(), required=False, allow_empty=False, max_length=4096,
                                         help_text="A conversation, rendered as chat completions renders it.")
        add_generation_prompt = StrictBooleanField(required=False, allow_null=True, default=True,
                                                   help_text="With messages: end with the assistant's prompt.")
        continue_final_message = StrictBooleanField(required=False, allow_null=True,
                                                    help_text="Only false (a new assistant message starts).")
        add_special_tokens = StrictBooleanField(required=False, allow_null=True,
                                                help_text="Only the endpoint's default: true with prompt, false "
                                                          "with messages (the template places them).")
        return_token_strs = StrictBooleanField(required=False, allow_null=True, default=False,
                                               help_text="Also return each token's vocabulary string.")

        def validate(self, data):
            if ("prompt" in data) == ("messages" in data):
                raise serializers.ValidationError({"prompt": serializers.ErrorDetail(
                    "Give exactly one of `prompt` and `messages`.", code="invalid")})
            return data

    @extend_schema_serializer(component_name="TokenizeResponse")
    class OutputSerializer(serializers.Serializer):
        count = serializers.IntegerField()
        max_model_len = serializers.IntegerField(allow_null=True, help_text="The live workers' window; null "
                                                                            "while none is registered.")
        tokens = serializers.ListField(child=serializers.IntegerField())
        token_strs = serializers.ListField(child=serializers.CharField(trim_whitespace=False, allow_blank=True),
                                           allow_null=True)

    @extend_schema(operation_id="tokenize_create", request=InputSerializer,
                   responses={200: OutputSerializer, **error_responses(400, 401, 404, 413, 415, 429, 503)},
                   description="The token ids of a prompt or of messages, exactly those admission would count: "
                               "`count` equals the request's usage.prompt_tokens.")
    def post(self, request):
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        model_get_by_id(data.get("model"))
        chat = "messages" in data
        _default_only(data, "continue_final_message", False, "a new assistant message always starts.")
        _default_only(data, "add_special_tokens", not chat, "the tokenization is the one the completion "
                      "endpoints use.")
        messages = [{"role": m["role"], "content": m["content"]} for m in data["messages"]] if chat else None
        try:
            tokens = prompt_tokenize(messages=messages, prompt=data.get("prompt"),
                                     add_generation_prompt=data.get("add_generation_prompt") is not False)
        except jinja2.TemplateError as exc:
            raise ApiError(f"The model's chat template refused these messages: {exc}", param="messages",
                           code="invalid_messages")
        tokenizer = tokenizer_get()[0].tokenizer
        strs = [tokenizer.id_to_token(t) or "" for t in tokens] if data.get("return_token_strs") else None
        return Response(self.OutputSerializer({"count": len(tokens), "max_model_len": registry_get().served_window(),
                                               "tokens": tokens, "token_strs": strs}).data)


class DetokenizeApi(ChatApiBase):
    @extend_schema_serializer(component_name="DetokenizeRequest")
    class InputSerializer(StrictSerializer):
        model = TextField(required=False, allow_null=True, max_length=256)
        tokens = TokenIdsField()

    @extend_schema_serializer(component_name="DetokenizeResponse")
    class OutputSerializer(serializers.Serializer):
        prompt = serializers.CharField(trim_whitespace=False, allow_blank=True)

    @extend_schema(operation_id="detokenize_create", request=InputSerializer,
                   responses={200: OutputSerializer, **error_responses(400, 401, 404, 413, 415, 429)},
                   description="The text of token ids, special tokens included; an id outside the vocabulary is "
                               "a 400 naming `tokens`.")
    def post(self, request):
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        model_get_by_id(data.get("model"))
        text = tokenizer_get()[0].tokenizer.decode(data["tokens"], skip_special_tokens=False)
        return Response(self.OutputSerializer({"prompt": text}).data)


class VersionApi(ChatApiBase):
    @extend_schema_serializer(component_name="Version")
    class OutputSerializer(serializers.Serializer):
        version = serializers.CharField()

    @extend_schema(operation_id="version_retrieve", responses={200: OutputSerializer, **error_responses(401, 429)})
    def get(self, request):
        return Response(self.OutputSerializer({"version": settings.KVSERVE_VERSION}).data)

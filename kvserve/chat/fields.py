"""Strictly typed DRF fields for OpenAI-style JSON bodies: a number is never a string, a bool never an
integer, text never holds unpaired surrogates; message content and `stop` are normalized here."""
import math

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers


class StrictSerializer(serializers.Serializer):
    """A JSON object whose keys are all fields of the serializer: any other key is a 400 naming it
    (`unknown_parameter`), never silently dropped."""

    def to_internal_value(self, data):
        unknown = [key for key in data if key not in self.fields] if isinstance(data, dict) else []
        if unknown:
            raise serializers.ValidationError({unknown[0]: [serializers.ErrorDetail(
                f"Unknown parameter '{unknown[0]}' (known here: {', '.join(self.fields)}).",
                code="unknown_parameter")]})
        return super().to_internal_value(data)


def _check_text(field: serializers.Field, value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        field.fail("surrogates")
    return value


class TextField(serializers.CharField):
    """A JSON string, kept exactly as sent (no trimming, no coercion of numbers); blank is allowed."""

    default_error_messages = {"invalid": "Expected a string.",
                              "surrogates": "Text contains unpaired UTF-16 surrogates."}

    def __init__(self, **kwargs):
        kwargs.setdefault("trim_whitespace", False)
        kwargs.setdefault("allow_blank", True)
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return _check_text(self, data)


class StrictIntegerField(serializers.IntegerField):
    default_error_messages = {"invalid": "Expected an integer."}

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return data


class StrictFloatField(serializers.FloatField):
    default_error_messages = {"invalid": "Expected a number."}

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, (int, float)) or not math.isfinite(data):
            self.fail("invalid")
        return float(data)


class StrictBooleanField(serializers.BooleanField):
    default_error_messages = {"invalid": "Expected true or false."}

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _TEXT_PART}]})
class MessageContentField(serializers.Field):
    """A string, or OpenAI's list of content parts of which only `{"type": "text", "text": ...}` is
    supported; a list becomes its texts joined by newlines."""

    default_error_messages = {
        "invalid": "Expected a string or a list of content parts.",
        "empty": "A content part list needs at least one part.",
        "part": 'Content part {index} is not supported: only {{"type": "text", "text": "..."}} parts are.',
        "surrogates": "Text contains unpaired UTF-16 surrogates.",
    }

    def to_internal_value(self, data):
        if isinstance(data, str):
            return _check_text(self, data)
        if not isinstance(data, list):
            self.fail("invalid")
        if not data:
            self.fail("empty")
        texts = []
        for index, part in enumerate(data):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                self.fail("part", index=index)
            texts.append(_check_text(self, part["text"]))
        return "\n".join(texts)

    def to_representation(self, value):
        return value


MAX_STOP = 4


@extend_schema_field({"oneOf": [{"type": "string", "minLength": 1, "maxLength": 256},
                                {"type": "array", "maxItems": MAX_STOP,
                                 "items": {"type": "string", "minLength": 1, "maxLength": 256}}]})
class StopField(serializers.Field):
    """`stop`: one string or a list of at most four, each non-empty; always returned as a list."""

    default_error_messages = {
        "invalid": "Expected a string or a list of strings.",
        "too_many": f"At most {MAX_STOP} stop sequences are supported.",
        "blank": "Stop sequences must not be empty.",
        "too_long": "A stop sequence may be at most 256 characters.",
        "surrogates": "Text contains unpaired UTF-16 surrogates.",
    }

    def to_internal_value(self, data):
        items = [data] if isinstance(data, str) else data
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            self.fail("invalid")
        if len(items) > MAX_STOP:
            self.fail("too_many")
        for s in items:
            if not s:
                self.fail("blank")
            if len(s) > 256:
                self.fail("too_long")
            _check_text(self, s)
        return items

    def to_representation(self, value):
        return value


_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}


@extend_schema_field({"oneOf": [{"type": "string"}, _TOKEN_IDS,
                                {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}},
                                {"type": "array", "minItems": 1, "maxItems": 1, "items": _TOKEN_IDS}],
                      "description": "A string, token ids, or a list of one of them (one prompt per request)."})
class PromptField(serializers.Field):
    """/v1/completions' `prompt`: a string or a list of token ids, or a list holding exactly one of those; never
    chat-templated. Token ids must be ids of the served vocabulary (`vocab_size`)."""

    default_error_messages = {
        "invalid": "Expected a string, a list of token ids, or a list of one of those.",
        "many": "One prompt per request: a list of {count} prompts is not supported.",
        "empty": "A token id list needs at least one id.",
        "token": "Token id {value!r} at index {index} is not an id of this model's vocabulary (0..{top}).",
        "surrogates": "Text contains unpaired UTF-16 surrogates.",
    }

    def __init__(self, *, vocab_size: int, **kwargs):
        self.vocab_size = vocab_size
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if isinstance(data, list) and data and all(isinstance(x, (str, list)) for x in data):
            if len(data) != 1:
                self.fail("many", count=len(data))
            data = data[0]
        if isinstance(data, str):
            return _check_text(self, data)
        if not isinstance(data, list):
            self.fail("invalid")
        if not data:
            self.fail("empty")
        for index, value in enumerate(data):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
                self.fail("token", value=value, index=index, top=self.vocab_size - 1)
        return list(data)

    def to_representation(self, value):
        return value


MAX_LOGIT_BIAS = 1024  # entries


@extend_schema_field({"type": "object", "nullable": True, "maxProperties": MAX_LOGIT_BIAS,
                      "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                      "description": "Token id (as a string) -> bias added to its logit, -100..100."})
class LogitBiasField(serializers.Field):
    """OpenAI's `logit_bias`: {"token id": bias}; each id one of the served vocabulary's, each bias a number in
    -100..100; returned as ((id, bias), ...) sorted by id."""

    default_error_messages = {
        "invalid": "Expected an object mapping token ids (strings) to numbers.",
        "too_many": f"At most {MAX_LOGIT_BIAS} logit_bias entries are supported.",
        "token": "logit_bias key {token!r} is not a token id of this model's vocabulary (0..{top}).",
        "bias": "logit_bias value {value!r} for token {token!r} is not a number in -100..100.",
    }

    def __init__(self, *, vocab_size: int, **kwargs):
        self.vocab_size = vocab_size
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            self.fail("invalid")
        if len(data) > MAX_LOGIT_BIAS:
            self.fail("too_many")
        out = []
        for key, value in data.items():
            if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < self.vocab_size:
                self.fail("token", token=key, top=self.vocab_size - 1)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                self.fail("bias", token=key, value=value)
            out.append((int(key), float(value)))
        return tuple(sorted(out))

    def to_representation(self, value):
        return {str(t): b for t, b in value}


MAX_STOP_TOKEN_IDS = 64


@extend_schema_field({"type": "array", "nullable": True, "maxItems": MAX_STOP_TOKEN_IDS,
                      "items": {"type": "integer", "minimum": 0}})
class TokenIdListField(serializers.Field):
    """A list of token ids of the served vocabulary (vLLM's `stop_token_ids`), at most 64."""

    default_error_messages = {
        "invalid": "Expected a list of token ids.",
        "too_many": f"At most {MAX_STOP_TOKEN_IDS} token ids are supported.",
        "token": "Token id {value!r} at index {index} is not an id of this model's vocabulary (0..{top}).",
    }

    def __init__(self, *, vocab_size: int, **kwargs):
        self.vocab_size = vocab_size
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, list):
            self.fail("invalid")
        if len(data) > MAX_STOP_TOKEN_IDS:
            self.fail("too_many")
        for index, value in enumerate(data):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
                self.fail("token", value=value, index=index, top=self.vocab_size - 1)
        return tuple(data)

    def to_representation(self, value):
        return list(value)

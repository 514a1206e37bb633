"""The request surface walked line by line (kvserve/chat/surface.py) against a fake worker on the real Redis stream:
every refused field is a 400 naming it; every default_only field is served at its default and a 400 naming it
otherwise; every honoured field's proof is an existing test; unknown fields are 400s; the serializers hold exactly
the registry's fields; the README's table is the registry's; continuous_usage_stats puts usage on every chunk."""
import ast
import json
from pathlib import Path

import pytest

from inference.events import Delta, Done, Usage
from kvserve.chat.apis import ChatCompletionsApi, CompletionsApi
from kvserve.chat.models import ChatRequest
from kvserve.chat.surface import (CHAT, COMPLETIONS, DEFAULT_ONLY, HONOURED, REFUSED, REGISTRY, URLS, surface_get,
                                  surface_params, surface_table)
from tests.api.chat_helpers import sse_events, streaming_body
from tests.api.test_chat_api import assert_error, auth, chat_env, key  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.django_db]
ROOT = Path(__file__).resolve().parents[2]
BASE = {CHAT: {"messages": [{"role": "user", "content": "Hi"}]}, COMPLETIONS: {"prompt": "Hi"}}
SERIALIZERS = {CHAT: ChatCompletionsApi.InputSerializer, COMPLETIONS: CompletionsApi.InputSerializer}


def post(client, raw, endpoint, extra: dict):
    body = {**BASE[endpoint], **extra}
    return client.post(URLS[endpoint], json.dumps(body), content_type="application/json", **auth(raw))


def cases(status):
    return [(e, p) for p in REGISTRY if p.status == status for e in p.endpoints]


def case_ids(status) -> list[str]:
    return [f"{e}-{p.name}" for e, p in cases(status)]


@pytest.mark.parametrize("endpoint, param", cases(REFUSED), ids=case_ids(REFUSED))
def test_a_refused_field_is_a_400_naming_it_with_advice(client, chat_env, key, endpoint, param):
    assert param.example is not None and param.note
    error = assert_error(post(client, key, endpoint, {param.name: param.example}), 400, code="unsupported_parameter",
                         param=param.name)
    assert param.note in error["message"]
    assert not ChatRequest.objects.exists() and chat_env.calls == []


@pytest.mark.parametrize("endpoint, param", cases(DEFAULT_ONLY), ids=case_ids(DEFAULT_ONLY))
def test_a_default_only_field_is_served_at_its_default_and_refused_otherwise(client, chat_env, key, endpoint, param):
    assert param.accepts and not any(param.example == a and type(param.example) is type(a) for a in param.accepts)
    for value in (*param.accepts, None):
        response = post(client, key, endpoint, {param.name: value})
        assert response.status_code == 200, (value, response.content)
    served = ChatRequest.objects.count()
    error = assert_error(post(client, key, endpoint, {param.name: param.example}), 400, code="unsupported_value",
                         param=param.name)
    assert param.note in error["message"]
    assert ChatRequest.objects.count() == served == len(param.accepts) + 1


def _test_functions(path: Path) -> set[str]:
    """`name` and `Class::name` of every test function defined in a test file."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{f.name}" for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


@pytest.mark.parametrize("param", [p for p in REGISTRY if p.status == HONOURED], ids=lambda p: f"{p.name}")
def test_an_honoured_fields_proof_is_an_existing_test(param):
    path, _, name = param.proof.partition("::")
    name = name.split("[")[0]
    assert path.startswith("tests/") and (ROOT / path).is_file(), param.proof
    assert name.split("::")[-1].startswith("test_") and name in _test_functions(ROOT / path), param.proof


def test_every_line_is_complete_and_no_field_is_listed_twice_for_an_endpoint():
    seen = set()
    for p in REGISTRY:
        assert p.status in (HONOURED, DEFAULT_ONLY, REFUSED) and p.note and p.endpoints, p
        assert (p.status == HONOURED) == bool(p.proof), p
        for endpoint in p.endpoints:
            assert (endpoint, p.name) not in seen, p
            seen.add((endpoint, p.name))


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_the_serializer_holds_exactly_the_honoured_and_default_only_fields(endpoint):
    fields = set(SERIALIZERS[endpoint]().fields)
    listed = {p.name for p in surface_params(endpoint) if p.status in (HONOURED, DEFAULT_ONLY)}
    assert fields == listed  # a serializer field outside the registry would be accepted unlisted


@pytest.mark.parametrize("endpoint, field, fragment", [
    (CHAT, "max_token", "Unknown parameter: 'max_token'"),  # a typo: a 200 with 256 tokens were it ignored
    (CHAT, "frobnicate", "Unknown parameter"),
    (CHAT, "prompt", "parameter of /v1/completions"),
    (CHAT, "suffix", "parameter of /v1/completions"),
    (COMPLETIONS, "messages", "parameter of /v1/chat/completions"),
    (COMPLETIONS, "max_completion_tokens", "parameter of /v1/chat/completions"),
    (COMPLETIONS, "tools", "parameter of /v1/chat/completions"),
])
def test_an_unknown_field_is_a_400_naming_it(client, chat_env, key, endpoint, field, fragment):
    assert surface_get(endpoint, field) is None
    error = assert_error(post(client, key, endpoint, {field: 5}), 400, code="unknown_parameter", param=field)
    assert fragment in error["message"]
    assert not ChatRequest.objects.exists()


def test_null_is_the_same_as_leaving_a_refused_field_out(client, chat_env, key):
    refused = [p.name for p in surface_params(CHAT) if p.status == REFUSED]
    assert post(client, key, CHAT, dict.fromkeys(refused)).status_code == 200


def test_an_unknown_stream_option_is_a_400_naming_it(client, chat_env, key):
    assert_error(post(client, key, CHAT, {"stream": True, "stream_options": {"include_usage": True, "extra": 1}}),
                 400, code="unknown_parameter", param="stream_options.extra")


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_stream_options_without_stream_is_a_400(client, chat_env, key, endpoint):
    assert_error(post(client, key, endpoint, {"stream_options": {"include_usage": True}}), 400, code="invalid",
                 param="stream_options")
    assert post(client, key, endpoint, {"stream": False, "stream_options": None}).status_code == 200


def test_the_schema_lists_default_only_fields_with_their_values_and_no_refused_field(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert props["store"]["allOf"] == [{"enum": [False, None]}] and props["priority"]["allOf"] == [{"enum": [0, None]}]
    assert "audio" not in props and "structural_tag" not in props  # refused: not in the schema
    assert "ignored" not in json.dumps(schema["components"]["schemas"]["ChatCompletionRequest"])
    for name in ("ChatCompletionRequest", "CompletionRequest", "StreamOptions", "TokenizeRequest", "DetokenizeRequest"):
        assert schema["components"]["schemas"][name]["additionalProperties"] is False, name  # unknown: a 400


def test_the_readme_table_is_the_registry():
    readme = (ROOT / "README.md").read_text()
    assert surface_table() in readme, "regenerate the README's table: surface_table() (README, 'Every parameter')"
    assert "Fields not listed are ignored" not in readme


# ---- stream_options.continuous_usage_stats -------------------------------------------------------------

def _counted(chat_env):
    chat_env.events = [Delta("The capital ", tokens=2), Delta("", tokens=3), Delta("is Paris.", tokens=5),
                       Done("stop", Usage(7, 6, 4))]


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_continuous_usage_stats_puts_usage_on_every_chunk(client, chat_env, key, endpoint):
    _counted(chat_env)
    options = {"continuous_usage_stats": True, "include_usage": True}
    response = post(client, key, endpoint, {"stream": True, "stream_options": options})
    events = sse_events(streaming_body(response))
    assert events[-1] == "[DONE]"
    chunks, last = events[:-2], events[-2]
    prompt = ChatRequest.objects.get().prompt_tokens
    assert all(set(c["usage"]) >= {"prompt_tokens", "completion_tokens", "total_tokens"} for c in chunks)
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks[:-1])
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    # the role chunk (chat) says 0; each content chunk the tokens so far; the finish chunk the final usage
    assert counts == ([0] if endpoint == CHAT else []) + [2, 5, 6]
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    assert chunks[-1]["usage"] == last["usage"] == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13,
                                                    "prompt_tokens_details": {"cached_tokens": 4}}
    assert last["choices"] == []


def test_without_continuous_usage_stats_only_the_last_chunk_has_usage(client, chat_env, key):
    _counted(chat_env)
    response = post(client, key, CHAT, {"stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(streaming_body(response))
    assert [("usage" in e) for e in events[:-1]] == [False] * (len(events) - 2) + [True]
    response = post(client, key, CHAT, {"stream": True, "stream_options": {"continuous_usage_stats": True}})
    events = sse_events(streaming_body(response))
    assert all("usage" in e for e in events[:-1]) and events[-2]["choices"][0]["finish_reason"] == "stop"

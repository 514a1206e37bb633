"""Structured outputs and tools through the real stack (prefill and decode workers with the real model, uvicorn,
the official `openai` client): a json_schema reply parses and validates; a named tool gives tool_calls with
finish_reason "tool_calls", whole and streamed as deltas; a schema that does not compile is a 400."""
import json

import openai
import pytest

from tests.inference.test_grammar import validate

pytestmark = pytest.mark.timeout(900)  # the session stack starts real workers on busy cores

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
          "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "additionalProperties": False,
                                                           "properties": {"city": {"type": "string",
                                                                                   "maxLength": 24}}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.api_key, max_retries=0, timeout=240)


def test_json_schema_reply_parses_and_validates(client):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=64, temperature=1.0, seed=3,
                                       messages=[{"role": "user", "content": "Where is the Eiffel tower?"}],
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "place", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop"
    validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_a_named_tool_gives_tool_calls_whole_and_streamed(client):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=64, messages=ASK, tools=[WEATHER],
                                       tool_choice=NAMED)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=64, messages=ASK,
                                                 tools=[WEATHER], tool_choice=NAMED, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == \
        [(0, "get_weather", call.function.arguments)]  # greedy: the same call as the whole answer
    assert not "".join(d.content or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_schema_that_does_not_compile_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, messages=ASK,
                                       extra_body={"guided_regex": "(unclosed"})
    assert err.value.body["param"] == "guided_regex" and err.value.body["code"] == "invalid_grammar"

"""Structured outputs and tools at the API (a fake worker): every constraint field reaches the request as its spec,
the 400s (a spec that does not compile, two constraints, an unknown tool), tools and tool turns rendered into the
prompt, and the worker's <tool_call> output returned as OpenAI tool_calls (whole and streamed)."""
import json

import pytest

from inference.events import Delta, Done, Usage
from kvserve.chat.models import ChatRequest
from kvserve.chat.tokenizer import tokenizer_get
from tests.api.chat_helpers import sse_events, streaming_body
from tests.api.test_chat_api import assert_error, chat_env, key, post  # noqa: F401 (fixtures)
from tests.api.test_completions_api import post as post_completion

pytestmark = [pytest.mark.django_db]

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def structured_of(response) -> dict | None:
    assert response.status_code == 200, response.content
    return ChatRequest.objects.get().request_params.sampling.structured


@pytest.mark.parametrize("fields, spec", [
    ({"response_format": {"type": "json_object"}}, {"type": "json_object"}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}},
     {"type": "json_schema", "schema": SCHEMA, "strict": True}),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "[0-9]+"}}, {"type": "regex", "pattern": "[0-9]+"}),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"type": "json_schema", "schema": SCHEMA}),
    ({"structured_outputs": {"choice": ["a", "b"]}}, {"type": "choice", "choices": ["a", "b"]}),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, {"type": "grammar", "ebnf": 'root ::= "x"'}),
    ({"structured_outputs": {"json_object": True}}, {"type": "json_object"}),
    ({"guided_json": SCHEMA}, {"type": "json_schema", "schema": SCHEMA}),
    ({"guided_regex": "(yes|no)"}, {"type": "regex", "pattern": "(yes|no)"}),
    ({"guided_choice": ["yes", "no"]}, {"type": "choice", "choices": ["yes", "no"]}),
    ({"guided_grammar": 'root ::= "a" | "b"'}, {"type": "grammar", "ebnf": 'root ::= "a" | "b"'}),
])
def test_each_constraint_field_reaches_the_request_as_its_spec(client, chat_env, key, fields, spec):
    assert structured_of(post(client, key, {"messages": MESSAGES, **fields})) == spec


def test_completions_take_the_same_constraints(client, chat_env, key):
    assert structured_of(post_completion(client, key, {"prompt": "Answer:", "guided_choice": ["yes", "no"]})) == \
        {"type": "choice", "choices": ["yes", "no"]}


@pytest.mark.parametrize("fields, param, code", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strung"}}}},
     "response_format", "invalid_grammar"),
    ({"guided_regex": "(ab"}, "guided_regex", "invalid_grammar"),
    ({"guided_grammar": "root ::= nowhere"}, "guided_grammar", "invalid_grammar"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": 7}}}}}, "structured_outputs",
     "invalid_grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strung"}}}],
      "tool_choice": "required"}, "tool_choice", "invalid_grammar"),
    ({"guided_json": SCHEMA, "guided_regex": "x"}, "guided_regex", "conflicting_constraints"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "x"}}, "structured_outputs",
     "conflicting_constraints"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools", "conflicting_constraints"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "invalid"),
    ({"tool_choice": "required"}, "tool_choice", "invalid"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "invalid"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0", "unsupported_value"),
    ({"structured_outputs": {"regex": "x", "choice": ["a"]}}, "structured_outputs", "invalid"),
    ({"structured_outputs": {"whitespace_pattern": "x"}}, "structured_outputs.whitespace_pattern",
     "unsupported_value"),
    ({"guided_choice": []}, "guided_choice", "invalid"),
    ({"guided_json": "{not json"}, "guided_json", "invalid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "required"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid"),
])
def test_a_bad_constraint_is_400_naming_the_field_and_nothing_is_queued(client, chat_env, key, fields, param, code):
    assert_error(post(client, key, {"messages": MESSAGES, **fields}), 400, code=code, param=param)
    assert not ChatRequest.objects.exists() and not chat_env.calls


def test_a_bad_schema_on_completions_is_400_too(client, chat_env, key):
    assert_error(post_completion(client, key, {"prompt": "x", "guided_regex": "[z-a]"}), 400, code="invalid_grammar",
                 param="guided_regex")


def prompt_of(chat_env) -> str:
    return tokenizer_get()[0].tokenizer.decode(chat_env.calls[-1][1], skip_special_tokens=False)


def test_tools_and_tool_turns_are_rendered_in_the_prompt(client, chat_env, key):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    response = post(client, key, {"messages": messages, "tools": [WEATHER, TIME]})
    assert response.status_code == 200, response.content
    prompt = prompt_of(chat_env)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>') in prompt
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in prompt
    req = ChatRequest.objects.get()
    assert req.request_params.tool_calls and req.request_params.sampling.structured["type"] == "structural_tag"


def test_tool_choice_none_renders_no_tools_and_constrains_nothing(client, chat_env, key):
    response = post(client, key, {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "none"})
    req = ChatRequest.objects.get()
    assert response.status_code == 200 and "<tools>" not in prompt_of(chat_env)
    assert req.request_params.sampling.structured is None and not req.request_params.tool_calls


def test_tool_choice_and_parallel_tool_calls_choose_the_constraint(client, chat_env, key):
    def fmt(**fields):
        ChatRequest.objects.all().delete()
        spec = structured_of(post(client, key, {"messages": MESSAGES, "tools": [WEATHER, TIME], **fields}))
        return spec["structural_tag"]["format"]

    auto = fmt()
    assert auto["type"] == "triggered_tags" and auto["triggers"] == ["<tool_call>"] and not auto["stop_after_first"]
    required = fmt(tool_choice="required", parallel_tool_calls=False)
    assert required["type"] == "tags_with_separator" and required["at_least_one"] and required["stop_after_first"]
    assert fmt(tool_choice="required")["stop_after_first"] is False
    named = fmt(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named["type"] == "tag" and '"name": "get_time"' in named["begin"]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_call_output_is_returned_as_tool_calls(client, chat_env, key):
    chat_env.events = [Delta(CALL[:20]), Delta(CALL[20:]), Done("stop", Usage(7, 20))]
    response = post(client, key, {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"})
    assert response.status_code == 200, response.content
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_auto_text_without_calls_stays_content_with_finish_reason_stop(client, chat_env, key):
    chat_env.events = [Delta("It is sunny."), Done("stop", Usage(7, 4))]
    choice = post(client, key, {"messages": MESSAGES, "tools": [WEATHER]}).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny."} and choice["finish_reason"] == "stop"


def test_tool_calls_stream_as_one_delta_each_with_an_index(client, chat_env, key):
    second = CALL.replace("Paris", "Rome")
    pieces = ["Let me check. <tool", "_call>\n" + CALL[len("<tool_call>\n"):40], CALL[40:] + "\n" + second[:30],
              second[30:]]
    chat_env.events = [*map(Delta, pieces), Done("stop", Usage(7, 40))]
    events = sse_events(streaming_body(post(client, key, {"messages": MESSAGES, "tools": [WEATHER],
                                                          "stream": True})))
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check. "
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1] and all(c["id"].startswith("call_") for c in calls)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls" and events[-1] == "[DONE]"


def test_a_call_cut_by_max_tokens_is_content_and_finish_reason_length(client, chat_env, key):
    chat_env.events = [Delta(CALL[:30]), Done("length", Usage(7, 10))]
    choice = post(client, key, {"messages": MESSAGES, "tools": [WEATHER]}).json()["choices"][0]
    assert choice["message"]["content"] == CALL[:30] and choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"]
    ChatRequest.objects.all().delete()
    events = sse_events(streaming_body(post(client, key, {"messages": MESSAGES, "tools": [WEATHER], "stream": True})))
    final = events[-2]["choices"][0]
    assert final["finish_reason"] == "length" and final["delta"] == {"content": CALL[:30]}

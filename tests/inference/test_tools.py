"""inference/tools.py: the tool format rendered for the chat template, calls parsed whole and as they stream, and on
the real model tool_choice required / named always produce parseable calls whose arguments validate."""
import json

import pytest

from inference.sequence import SamplingParams
from inference.tools import ToolCall, ToolCallStream, parse_tool_calls, tool_messages, tool_spec
from tests.inference.helpers import make_engine, run_until_done
from tests.inference.test_grammar import validate

WEATHER_ARGS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24},
                               "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD_ARGS = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
            "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                           "b": {"type": "integer", "minimum": -1000, "maximum": 1000}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "add", "description": "Adds two integers", "parameters": ADD_ARGS}}]
SCHEMAS = {"get_weather": WEATHER_ARGS, "add": ADD_ARGS}


def test_tool_turns_become_plain_messages_in_the_tool_format():
    out = tool_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Checking.", "tool_calls": [
                             {"function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                         {"role": "tool", "content": "3"}, {"role": "tool", "content": "again 3"}], TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(TOOLS[1]) in out[0]["content"]
    assert out[2]["content"] == 'Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n3\n</tool_response>\n<tool_response>\nagain 3\n</tool_response>"
    assert tool_messages([{"role": "user", "content": "Hi"}], None) == [{"role": "user", "content": "Hi"}]


def test_calls_are_parsed_whole_and_as_they_stream():
    text = 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>bad</tool_call>'
    content, calls = parse_tool_calls(text)
    assert calls == [ToolCall("add", '{"a": 1, "b": 2}')] and content == "Sure. <tool_call>bad</tool_call>"
    stream, got, released = ToolCallStream(), [], []
    for ch in text:
        piece, done = stream.push(ch)
        released.append(piece)
        got += done
    assert got == calls and "".join(released) + stream.flush() == content
    assert parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n') == \
        (None, [ToolCall("add", "{}")])


def test_tool_choice_none_is_no_constraint():
    assert tool_spec(TOOLS, "none", True) is None and tool_spec([], "auto", True) is None


PROMPTS = ["What's the weather in Paris, in celsius?", "What is 12 plus 30?"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                    {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named-weather", "named-add"])
def test_required_and_named_tool_choice_always_give_calls_that_validate(real_model, choice):
    spec = tool_spec(TOOLS, choice, parallel=False)
    engine = make_engine(real_model, num_pages=512, max_num_seqs=16)
    seqs = [engine.add_request(f"t{seed}-{i}", real_model.tokenizer.encode_chat(tool_messages(
                [{"role": "user", "content": p}], TOOLS)),
                SamplingParams(max_tokens=96, temperature=1.0, seed=seed, structured=spec))
            for seed in range(6) for i, p in enumerate(PROMPTS)]
    run_until_done(engine, seqs)
    for seq in seqs:
        assert seq.finish_reason == "stop", seq.text
        content, calls = parse_tool_calls(seq.text)
        assert content is None and len(calls) == 1, seq.text
        if isinstance(choice, dict):
            assert calls[0].name == choice["function"]["name"]
        validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])

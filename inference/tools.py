"""Tool calling in kvserve's Hermes/Qwen-style ChatML format (SmolLM2's own template has no tool section): the tool
definitions are listed in the system turn inside <tools></tools>; the model calls one as
`<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`; a tool's result comes back in a user turn inside
<tool_response></tool_response>. This module renders an OpenAI conversation with tools into plain messages (for
any chat template), builds the structured-output spec a tool_choice constrains the output with
(inference/grammar.py) and parses calls out of the output, whole or as it streams."""
import json
from dataclasses import dataclass

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BEGIN = CALL_OPEN + '\n{"name": "'
_ARGUMENTS = '", "arguments": '
_CALL_END = "}\n" + CALL_CLOSE

_TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                   "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
_TOOLS_FORMAT = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                 "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                 '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def tool_call_text(name: str, arguments) -> str:
    """One call as the model writes it (`arguments`: an object, or the JSON string the API carries)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # kept as the string it is: the history says what it says
    return f"{_CALL_BEGIN}{name}{_ARGUMENTS}{_dumps(arguments)}{_CALL_END}"


def tool_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` (OpenAI's: system/user/assistant with tool_calls/tool) as plain {role, content} messages: the tools
    block joins the system turn (one is added when there is none), an assistant's calls follow its content, and
    each tool result becomes a user turn of <tool_response> blocks (consecutive results share one turn)."""
    out: list[dict] = []
    if tools:
        block = _TOOLS_PREAMBLE + "\n".join(_dumps(t) for t in tools) + _TOOLS_FORMAT
        if messages and messages[0]["role"] == "system":
            first, messages = messages[0], messages[1:]
            out.append({"role": "system", "content": f"{first['content']}\n\n{block}" if first["content"] else block})
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [tool_call_text(c["function"]["name"], c["function"].get("arguments", "{}"))
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_turn"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_turn": True})
        else:
            out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _call_tag(function: dict) -> dict:
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "tag", "begin": f"{_CALL_BEGIN}{function['name']}{_ARGUMENTS}",
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
            "end": _CALL_END}


def tool_spec(tools: list[dict], choice, parallel: bool) -> dict | None:
    """The structured-output spec (an xgrammar structural tag) for `choice`: "none" -> None (no constraint);
    "auto" -> free text in which each <tool_call> must be a valid call of one of the tools; "required" -> one call
    (one or more, separated by a newline, with `parallel`) and nothing else; {"type": "function", "function":
    {"name"}} -> exactly one call of that function."""
    if choice == "none" or not tools:
        return None
    tags = [_call_tag(t["function"]) for t in tools]
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        fmt = next(tag for tag, t in zip(tags, tools) if t["function"]["name"] == name)
    elif choice == "required":
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": not parallel}
    elif choice == "auto":
        fmt = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": tags, "stop_after_first": not parallel}
    else:
        raise ValueError(f"tool_choice {choice!r}")
    return {"type": "structural_tag", "structural_tag": {"type": "structural_tag", "format": fmt}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as a JSON string (OpenAI's `function.arguments`)


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else _dumps(arguments))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output: each well-formed <tool_call> block becomes a call; the text outside
    them is the content (None when only calls and whitespace); a block that does not parse stays in the content."""
    stream = ToolCallStream()
    content, calls = stream.push(text)
    content += stream.flush()
    if calls and not content.strip():
        return None, calls
    return content, calls


class ToolCallStream:
    """Splits an output arriving in pieces into content and calls: text that may still open a <tool_call> is held
    back until it is known, a call is released when its closing tag arrives."""

    def __init__(self):
        self._held = ""
        self._after_call = False
        self.num_calls = 0

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content released, calls completed) by this piece."""
        self._held += text
        if self._after_call:  # the newline that separates calls (or ends the last) is not content
            self._held = self._held.lstrip("\n")
            self._after_call = not self._held
        content, calls = [], []
        while True:
            start = self._held.find(CALL_OPEN)
            if start < 0:
                keep = _partial_suffix(self._held, CALL_OPEN)
                content.append(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            end = self._held.find(CALL_CLOSE, start)
            if end < 0:
                content.append(self._held[:start])
                self._held = self._held[start:]
                break
            call = _parse_call(self._held[start + len(CALL_OPEN):end])
            if call is None:
                content.append(self._held[:end + len(CALL_CLOSE)])
            else:
                content.append(self._held[:start])
                calls.append(call)
            self._held = self._held[end + len(CALL_CLOSE):]
            if call is not None:
                self._held = self._held.lstrip("\n")
                self._after_call = not self._held
        self.num_calls += len(calls)
        return "".join(content), calls

    def flush(self) -> str:
        """What is still held (an unfinished call or tag) when the output ends: it is content."""
        held, self._held = self._held, ""
        return held


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0

"""The request fields that constrain an output: OpenAI's `response_format` (text, json_object, json_schema) and
`tools` / `tool_choice` / `parallel_tool_calls`, vLLM's `structured_outputs` and `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`. At most one constraint per request. Each becomes one structured-output spec
(inference/grammar.py), compiled here once (cached by spec) so that one that does not compile is a 400 naming its
field, never a worker failure."""
import json
import re

from rest_framework import serializers

from inference.grammar import GrammarError, compiler_for
from inference.tools import tool_spec
from kvserve.chat.tokenizer import tokenizer_get
from kvserve.errors import ApiError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _invalid(param: str, message: str, code: str = "invalid") -> serializers.ValidationError:
    path = param.split(".")
    detail: object = serializers.ErrorDetail(message, code=code)
    for key in reversed(path):
        detail = {key: detail}
    return serializers.ValidationError(detail)


def _schema(value, param: str) -> dict | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise _invalid(param, f"Not valid JSON: {exc}.")
    if not isinstance(value, (dict, bool)):
        raise _invalid(param, "A JSON schema is an object.")
    return value


def _text(value, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise _invalid(param, "Expected a non-empty string.")
    return value


def _choices(value, param: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise _invalid(param, "Expected a non-empty list of non-empty strings.")
    return value


def _kind_spec(kind: str, value, param: str) -> dict:
    if kind == "json":
        return {"type": "json_schema", "schema": _schema(value, param)}
    if kind == "regex":
        return {"type": "regex", "pattern": _text(value, param)}
    if kind == "choice":
        return {"type": "choice", "choices": _choices(value, param)}
    if kind == "grammar":
        return {"type": "grammar", "ebnf": _text(value, param)}
    if value is not True:  # json_object
        raise _invalid(param, "Expected true.")
    return {"type": "json_object"}


def response_format_spec(value) -> dict | None:
    """`response_format`: {"type": "text"} (no constraint), {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema"?, "strict"?, "description"?}}."""
    if not isinstance(value, dict):
        raise _invalid("response_format", "Expected an object with a `type`.")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise _invalid("response_format.type", f"response_format type {kind!r} is not one of text, json_object, "
                                               "json_schema.", code="unsupported_value")
    body = value.get("json_schema")
    if not isinstance(body, dict):
        raise _invalid("response_format.json_schema", "Expected an object with `name` and `schema`.",
                       code="required" if body is None else "invalid")
    name = body.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise _invalid("response_format.json_schema.name", "A name of 1..64 letters, digits, _ or - is required.",
                       code="required" if name is None else "invalid")
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _invalid("response_format.json_schema.strict", "Expected true or false.")
    spec = {"type": "json_schema", "schema": _schema(body.get("schema", {"type": "object"}),
                                                     "response_format.json_schema.schema")}
    if strict is not None:
        spec["strict"] = strict
    return spec


def structured_outputs_spec(value) -> dict:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""
    if not isinstance(value, dict):
        raise _invalid("structured_outputs", "Expected an object.")
    unknown = sorted(set(value) - set(STRUCTURED_KEYS))
    if unknown:
        raise _invalid(f"structured_outputs.{unknown[0]}", f"Not supported: structured_outputs takes one of "
                                                           f"{', '.join(STRUCTURED_KEYS)}.", code="unsupported_value")
    given = [k for k in STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise _invalid("structured_outputs", f"Exactly one of {', '.join(STRUCTURED_KEYS)} is required "
                                             f"({len(given)} given).")
    return _kind_spec(given[0], value[given[0]], f"structured_outputs.{given[0]}")


def tools_validate(tools) -> list[dict]:
    """`tools`: function tools, each {"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}} with a unique name; returned as the model is shown them."""
    if not isinstance(tools, list):
        raise _invalid("tools", "Expected a list of function tools.")
    if not tools:
        return []  # what clients send for "no tools": the same as leaving it out
    out, names = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise _invalid(f"tools.{i}", 'Only {"type": "function", "function": {...}} tools are supported.',
                           code="unsupported_value")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise _invalid(f"tools.{i}.function.name", "A name of 1..64 letters, digits, _ or - is required.")
        if name in names:
            raise _invalid(f"tools.{i}.function.name", f"Tool name {name!r} is given twice.")
        names.add(name)
        function = {"name": name}
        if fn.get("description") is not None:
            if not isinstance(fn["description"], str):
                raise _invalid(f"tools.{i}.function.description", "Expected a string.")
            function["description"] = fn["description"]
        if fn.get("parameters") is not None:
            function["parameters"] = _schema(fn["parameters"], f"tools.{i}.function.parameters")
        out.append({"type": "function", "function": function})
    return out


def tool_choice_validate(choice, tools: list[dict] | None):
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise _invalid("tool_choice", "tool_choice 'required' needs `tools`.")
        return choice
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        raise _invalid("tool_choice", 'Expected "none", "auto", "required" or {"type": "function", "function": '
                                      '{"name": ...}}.')
    name = choice["function"]["name"]
    if name not in {t["function"]["name"] for t in tools or ()}:
        raise _invalid("tool_choice.function.name", f"No tool named {name!r} is in `tools`.")
    return {"type": "function", "function": {"name": name}}


def structured_validate(data: dict, *, tools_allowed: bool) -> dict:
    """Adds to the validated body `structured` (the spec, or None), `structured_param` (the field it came from),
    and for chat `tools` (validated), `tool_choice` (resolved: "auto" when tools are given, else "none") and
    `parallel_tool_calls`. Two constraints are a 400 naming the second."""
    specs: list[tuple[str, dict]] = []
    if data.get("response_format") is not None:
        spec = response_format_spec(data["response_format"])
        if spec is not None:
            specs.append(("response_format", spec))
    if data.get("structured_outputs") is not None:
        specs.append(("structured_outputs", structured_outputs_spec(data["structured_outputs"])))
    for field, kind in GUIDED.items():
        if data.get(field) is not None:
            specs.append((field, _kind_spec(kind, data[field], field)))
    if tools_allowed:
        tools = tools_validate(data["tools"]) if data.get("tools") is not None else None
        given = data.get("tool_choice")
        choice = tool_choice_validate(given, tools) if given is not None else ("auto" if tools else "none")
        parallel = data.get("parallel_tool_calls")
        data.update(tools=tools, tool_choice=choice, parallel_tool_calls=True if parallel is None else parallel)
        spec = tool_spec(tools or [], choice, data["parallel_tool_calls"])
        if spec is not None:
            specs.append(("tool_choice" if given is not None else "tools", spec))
    if len(specs) > 1:
        first, second = specs[0][0], specs[1][0]
        raise _invalid(second, f"At most one output constraint per request: {first} and {second} are both given.",
                       code="conflicting_constraints")
    data["structured"], data["structured_param"] = specs[0][1] if specs else None, specs[0][0] if specs else None
    return data


def structured_compile_check(spec: dict | None, param: str | None) -> None:
    """Compiles `spec` with the served tokenizer (cached by spec, as the workers' compilers are): one that does not
    compile is a 400 naming `param`."""
    if spec is None:
        return
    try:
        compiler_for(tokenizer_get()[0]).compile(spec)
    except GrammarError as exc:
        raise ApiError(f"The {param} constraint does not compile: {exc}", param=param, code="invalid_grammar")

"""The request surface of /v1/chat/completions and /v1/completions: every top-level field of OpenAI's two APIs and
of vLLM's extra parameters, one line each, honoured, accepted at its default only, or refused, and the one check
that applies it (`surface_check`, run by both APIs before their serializers). A field in no line is a 400."""
import json
import math
from dataclasses import dataclass

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from kvserve.errors import ApiError

CHAT, COMPLETIONS = "chat", "completions"
BOTH = (CHAT, COMPLETIONS)
HONOURED, DEFAULT_ONLY, REFUSED = "honoured", "default_only", "refused"
URLS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}


@dataclass(frozen=True)
class Param:
    """One request field. `note`: what an honoured field does, else the 400's advice. `proof`: the node id of a
    test proving an honoured field. `accepts`: the values a default_only field takes (the server's behaviour;
    null always is). `example`: a value the meta-test sends expecting a 400 naming the field."""

    name: str
    endpoints: tuple[str, ...]
    status: str
    note: str
    proof: str = ""
    accepts: tuple = ()
    example: object = None


def P(name, endpoints, status, note, **kw) -> Param:
    return Param(name, endpoints if isinstance(endpoints, tuple) else (endpoints,), status, note, **kw)


H, D, R = HONOURED, DEFAULT_ONLY, REFUSED
CHAT_API, COMPLETIONS_API, SURFACE = "tests/api/test_chat_api.py", "tests/api/test_completions_api.py", \
    "tests/api/test_surface.py"
NO_TOOLS = "use tools and tool_choice"
NO_GRAMMAR = "use response_format, structured_outputs or guided_json / guided_regex / guided_choice / guided_grammar"

REGISTRY: tuple[Param, ...] = (
    # ---- OpenAI chat completions
    P("messages", CHAT, H, "The conversation (system, user, assistant), rendered with the model's chat template.", proof=f"{CHAT_API}::test_non_stream_completion_is_openai_shaped"),
    P("model", BOTH, H, "The served model's id (GET /v1/models); optional; any other is a 404 model_not_found.", proof=f"{CHAT_API}::test_unknown_model_is_404"),
    P("audio", CHAT, R, "Audio output is not supported: this server returns text.", example={"voice": "alloy", "format": "wav"}),
    P("frequency_penalty", BOTH, H, "-2..2: each output token's logit lowered by this times its count so far (OpenAI's).", proof="tests/inference/test_sampling_model.py::test_each_penalty_changes_a_repetitive_reply"),
    P("function_call", CHAT, R, "Deprecated function calling is not supported: leave it out.", example="auto"),
    P("functions", CHAT, R, "Deprecated function calling is not supported: leave it out.", example=[{"name": "f"}]),
    P("logit_bias", BOTH, H, "Token id -> -100..100 added to its logit before sampling (-100 bans, +100 forces).", proof="tests/inference/test_sampling_model.py::test_logit_bias_minus_100_on_the_greedy_first_token_changes_it"),
    P("logprobs", CHAT, H, "true: each output token's log-probability (choices[].logprobs.content).", proof=f"{COMPLETIONS_API}::test_chat_logprobs_in_openai_shape"),
    P("logprobs", COMPLETIONS, H, "0..5: the legacy logprobs shape with this many alternatives per token.", proof=f"{COMPLETIONS_API}::test_completion_logprobs_in_the_legacy_shape"),
    P("max_completion_tokens", CHAT, H, "Tokens to generate (wins over max_tokens).", proof=f"{CHAT_API}::test_max_completion_tokens_wins_over_max_tokens"),
    P("max_tokens", BOTH, H, "Tokens to generate (chat default 256, completions 16).", proof=f"{CHAT_API}::test_non_stream_completion_is_openai_shaped"),
    P("metadata", CHAT, R, "Completions are not stored, so there is nothing to tag: leave it out.", example={"k": "v"}),
    P("modalities", CHAT, D, "Only text output is supported.", accepts=(["text"],), example=["text", "audio"]),
    P("n", BOTH, H, "1..8 choices; the prompt is prefilled once and its pages shared read-only by the choices; usage counts it once.", proof="tests/api/test_choices_api.py::test_chat_n_returns_every_choice_by_index_with_the_prompt_counted_once"),
    P("parallel_tool_calls", CHAT, H, "With tools: false allows at most one call; true (the default) one or more.", proof="tests/api/test_structured_api.py::test_tool_choice_and_parallel_tool_calls_choose_the_constraint"),
    P("prediction", CHAT, R, "Predicted outputs are not supported: leave it out.", example={"type": "content", "content": "x"}),
    P("presence_penalty", BOTH, H, "-2..2: each token already in the output lowered by this (OpenAI's).", proof="tests/inference/test_sampling_model.py::test_each_penalty_changes_a_repetitive_reply"),
    P("prompt_cache_key", CHAT, R, "The prefix cache is per tenant already; send `user` to narrow it further.", example="k"),
    P("reasoning_effort", CHAT, R, "The served model does not reason: leave it out.", example="low"),
    P("response_format", BOTH, H, "text, json_object or json_schema (strict): the output is constrained by xgrammar to parse (and validate).", proof="tests/inference/test_grammar.py::test_json_schema_output_always_parses_and_validates_over_20_seeds"),
    P("safety_identifier", CHAT, R, "This server runs no abuse monitoring to attribute: leave it out.", example="u"),
    P("seed", BOTH, H, "Sampling seed (int64); one is fixed at entry when absent.", proof=f"{CHAT_API}::test_sampling_parameters_reach_the_request"),
    P("service_tier", CHAT, D, "There is one tier.", accepts=("auto", "default"), example="flex"),
    P("stop", BOTH, H, "Up to 4 stop strings.", proof="tests/inference/test_engine.py::test_finish_reasons_eos_stop_string_and_length"),
    P("store", CHAT, D, "Completions are not stored for distillation or evals.", accepts=(False,), example=True),
    P("stream", BOTH, H, "Server-sent events.", proof=f"{CHAT_API}::test_stream_is_openai_chunks_with_usage_and_done"),
    P("stream_options", BOTH, H, "include_usage: a final usage chunk; continuous_usage_stats: usage on every chunk.", proof=f"{SURFACE}::test_continuous_usage_stats_puts_usage_on_every_chunk"),
    P("temperature", BOTH, H, "0..2, default 0 (greedy).", proof="tests/inference/test_engine.py::test_sampling_is_reproducible_by_seed_and_top_k_1_is_greedy"),
    P("tool_choice", CHAT, H, "none, auto, required or a named function: what the output grammar allows (text, calls, one named call).", proof="tests/inference/test_tools.py::test_required_and_named_tool_choice_always_give_calls_that_validate"),
    P("tools", CHAT, H, "Function tools (JSON-schema parameters), rendered in the prompt; calls come back as message.tool_calls.", proof="tests/inference/test_tools.py::test_required_and_named_tool_choice_always_give_calls_that_validate"),
    P("top_logprobs", CHAT, H, "With logprobs: 0..20 alternatives per token.", proof=f"{COMPLETIONS_API}::test_chat_logprobs_in_openai_shape"),
    P("top_p", BOTH, H, "Nucleus sampling, 0 < p <= 1.", proof=f"{CHAT_API}::test_sampling_parameters_reach_the_request"),
    P("user", BOTH, H, "Narrows prefix-cache sharing to this tenant's requests with the same user.", proof="tests/api/test_prefix_salt.py::test_user_narrows_and_no_user_value_reaches_another_tenant"),
    P("verbosity", CHAT, D, "Reasoning models only.", accepts=("medium",), example="low"),
    P("web_search_options", CHAT, R, "Web search is not supported: put what the model needs in the messages.", example={}),
    # ---- OpenAI completions
    P("prompt", COMPLETIONS, H, "A string (no chat template), token ids, or a list of one of those.", proof=f"{COMPLETIONS_API}::test_token_ids_and_a_list_of_one_prompt"),
    P("best_of", BOTH, H, "n..8: generate this many choices, return the n with the highest cumulative logprob (not with stream).", proof="tests/inference/test_worker_choices.py::test_best_of_returns_the_highest_cumulative_logprobs_and_counts_them"),
    P("echo", BOTH, D, "Echoing the prompt is not supported: the answer holds the completion only.", accepts=(False,), example=True),
    P("suffix", COMPLETIONS, D, "Insertion (a suffix) is not supported: only an empty suffix.", accepts=("",), example="the end"),
    # ---- vLLM's extra parameters
    P("use_beam_search", BOTH, D, "Beam search is not supported: sample, or send n requests.", accepts=(False,), example=True),
    P("top_k", BOTH, H, "Sample among the k most likely tokens (0 or -1: all); 1 is greedy.", proof="tests/inference/test_sampling_model.py::test_top_k_1_at_temperature_1_5_is_greedy"),
    P("min_p", BOTH, H, "0..1: keep tokens at least this times the most likely one's probability.", proof="tests/inference/test_sampling_model.py::test_min_p_near_1_at_high_temperature_is_greedy"),
    P("repetition_penalty", BOTH, H, "> 0 (1: off): logits of prompt and output tokens divided (positive) or multiplied (negative) by it (vLLM's).", proof="tests/inference/test_sampling_model.py::test_each_penalty_changes_a_repetitive_reply"),
    P("length_penalty", BOTH, D, "Applies to beam search only, which is not supported.", accepts=(1,), example=0.5),
    P("stop_token_ids", BOTH, H, "Token ids that end the answer (finish_reason stop), their text left out.", proof="tests/inference/test_sampling_model.py::test_stop_token_ids_end_the_answer_without_their_text"),
    P("include_stop_str_in_output", BOTH, H, "Keep the stop string that ended the answer in its text.", proof="tests/inference/test_sampling_model.py::test_include_stop_str_in_output_keeps_the_stop_string"),
    P("ignore_eos", BOTH, H, "Generate past the end-of-sequence token, to max_tokens.", proof="tests/inference/test_sampling_model.py::test_ignore_eos_runs_to_max_tokens"),
    P("min_tokens", BOTH, H, "At least this many tokens before end-of-sequence or stop_token_ids may end the answer (<= max tokens).", proof="tests/inference/test_sampling_model.py::test_min_tokens_holds_the_end_back"),
    P("skip_special_tokens", BOTH, D, "Special tokens are always left out of the text.", accepts=(True,), example=False),
    P("spaces_between_special_tokens", BOTH, D, "Special tokens are never in the text.", accepts=(True,), example=False),
    P("truncate_prompt_tokens", BOTH, R, "Prompts are never truncated: shorten it (an overlong one is a 400 context_length_exceeded).", example=100),
    P("prompt_logprobs", BOTH, R, "Prompt log-probabilities are not supported: only output tokens' (logprobs).", example=1),
    P("allowed_token_ids", BOTH, R, "Restricting the vocabulary is not supported: leave it out.", example=[1, 2]),
    P("bad_words", BOTH, D, "Banned words are not supported: only an empty list.", accepts=([],), example=["bad"]),
    P("add_generation_prompt", CHAT, D, "The assistant's generation prompt is always added.", accepts=(True,), example=False),
    P("continue_final_message", CHAT, D, "A new assistant message always starts.", accepts=(False,), example=True),
    P("add_special_tokens", CHAT, D, "The chat template places the special tokens; none are added on top.", accepts=(False,), example=True),
    P("add_special_tokens", COMPLETIONS, D, "A prompt is tokenized with the model's own special tokens.", accepts=(True,), example=False),
    P("documents", CHAT, R, "RAG documents are not supported: put them in the messages.", example=[{"title": "t", "text": "x"}]),
    P("chat_template", CHAT, R, "The served model's own chat template is always used; render it yourself and use /v1/completions.", example="{{ messages }}"),
    P("chat_template_kwargs", CHAT, R, "The chat template takes no extra arguments here: leave it out.", example={"x": 1}),
    P("mm_processor_kwargs", BOTH, R, "The served model is text only.", example={"x": 1}),
    P("structured_outputs", BOTH, H, "vLLM's: one of json, regex, choice, grammar, json_object; the output obeys it.", proof="tests/api/test_structured_api.py::test_each_constraint_field_reaches_the_request_as_its_spec"),
    P("guided_json", BOTH, H, "vLLM's: the output validates against this JSON schema.", proof="tests/inference/test_grammar.py::test_json_schema_output_always_parses_and_validates_over_20_seeds"),
    P("guided_regex", BOTH, H, "vLLM's: the output matches this regex.", proof="tests/inference/test_grammar.py::test_regex_output_always_matches_over_20_seeds"),
    P("guided_choice", BOTH, H, "vLLM's: the output is one of these strings.", proof="tests/inference/test_grammar.py::test_choice_output_is_always_one_of_the_choices_over_20_seeds"),
    P("guided_grammar", BOTH, H, "vLLM's: the output follows this EBNF grammar (root rule `root`).", proof="tests/api/test_structured_api.py::test_each_constraint_field_reaches_the_request_as_its_spec"),
    P("structural_tag", BOTH, R, f"{NO_GRAMMAR}.", example="{}"),
    P("guided_decoding_backend", BOTH, D, "xgrammar is the one structured-output backend.", accepts=("xgrammar", "auto"), example="outlines"),
    P("guided_whitespace_pattern", BOTH, R, f"{NO_GRAMMAR}.", example=" "),
    P("priority", BOTH, D, "Scheduling is fair across tenants, not by priority.", accepts=(0,), example=1),
    P("request_id", BOTH, R, "The server names each request (the response's id, for /api/requests/<id>): leave it out.", example="mine-1"),
    P("return_tokens_as_token_ids", BOTH, D, "Logprob tokens are always their text.", accepts=(False,), example=True),
    P("return_token_ids", BOTH, D, "Token ids are not returned: use POST /tokenize on the text.", accepts=(False,), example=True),
    P("cache_salt", BOTH, R, "The prefix cache is salted per tenant already; send `user` to narrow it further.", example="salt"),
    P("kv_transfer_params", BOTH, R, "KV transfer is the server's own (prefill to decode): leave it out.", example={}),
    P("vllm_xargs", BOTH, R, "There are no custom extensions to pass arguments to: leave it out.", example={"x": 1}),
    P("logits_processors", BOTH, R, "Custom logits processors are not supported: leave it out.", example=["my.Processor"]),
    P("include_reasoning", CHAT, D, "The served model does not reason.", accepts=(True,), example=False),
    P("prompt_embeds", COMPLETIONS, R, "Prompt embeddings are not supported: send text or token ids.", example="AAAA"),
)

_BY_KEY = {(endpoint, p.name): p for p in REGISTRY for endpoint in p.endpoints}


def surface_get(endpoint: str, name: str) -> Param | None:
    return _BY_KEY.get((endpoint, name))


def surface_params(endpoint: str) -> list[Param]:
    return [p for p in REGISTRY if endpoint in p.endpoints]


def _same(value, accepted) -> bool:
    """JSON equality: a bool is never a number; 0 and 0.0 are the same number."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    if isinstance(value, (int, float)) and isinstance(accepted, (int, float)):
        return math.isfinite(value) and value == accepted
    if isinstance(value, list) and isinstance(accepted, list):
        return len(value) == len(accepted) and all(_same(v, a) for v, a in zip(value, accepted))
    if isinstance(value, dict) and isinstance(accepted, dict):
        return value.keys() == accepted.keys() and all(_same(value[k], accepted[k]) for k in value)
    return type(value) is type(accepted) and value == accepted


def _shown(values: tuple) -> str:
    return " or ".join(json.dumps(v) for v in values)


def surface_check(endpoint: str, body) -> None:
    """Every top-level field of `body` is honoured here (left to the serializer), at its default, or a 400 naming
    it: `unknown_parameter` for a field in no line (or another endpoint's), `unsupported_parameter` for a refused
    one, `unsupported_value` for a default_only one at another value. null is the same as leaving a field out."""
    if not isinstance(body, dict):
        return  # the serializer says what a body must be
    for name, value in body.items():
        param = surface_get(endpoint, name)
        if param is None:
            other = next((e for e in BOTH if e != endpoint and surface_get(e, name)), None)
            where = f"; it is a parameter of {URLS[other]}" if other else ""
            raise ApiError(f"Unknown parameter: '{name}'{where}. This server refuses fields it does not know rather "
                           f"than ignore them (see the README's parameter table).", param=name, code="unknown_parameter")
        if param.status == HONOURED or value is None:
            continue
        if param.status == REFUSED:
            raise ApiError(f"'{name}' is not supported: {param.note}", param=name, code="unsupported_parameter")
        if not any(_same(value, accepted) for accepted in param.accepts):
            raise ApiError(f"'{name}' is accepted only as {_shown(param.accepts)} (or null): {param.note}",
                           param=name, code="unsupported_value")


class DefaultOnlyField(serializers.Field):
    """A default_only field in the OpenAPI schema; surface_check has already refused any other value."""

    def to_internal_value(self, data):
        return data

    def to_representation(self, value):
        return value


def _field_class(p: Param) -> type[DefaultOnlyField]:
    # the enum inside allOf: drf-spectacular would otherwise turn each into a shared enum component
    schema = {"allOf": [{"enum": [*p.accepts, None]}], "nullable": True,
              "description": f"Accepted only at its default. {p.note}"}
    return extend_schema_field(schema)(type(f"DefaultOnly_{p.name}", (DefaultOnlyField,), {}))


_FIELD_CLASSES = {(e, p.name): _field_class(p) for p in REGISTRY if p.status == DEFAULT_ONLY for e in p.endpoints}


def surface_fields(endpoint: str) -> dict[str, serializers.Field]:
    """Serializer fields documenting the endpoint's default_only parameters (their accepted values)."""
    return {name: cls(required=False, allow_null=True) for (e, name), cls in _FIELD_CLASSES.items() if e == endpoint}


STATUS_SHOWN = {HONOURED: "honoured", DEFAULT_ONLY: "default only", REFUSED: "refused"}


def surface_table() -> str:
    """The README's parameter table, one row per registry line (printed by `python manage.py shell -c "from
    kvserve.chat.surface import surface_table; print(surface_table())"`)."""
    rows = ["| field | endpoints | status | what it does, or what to do instead (the 400's advice) |",
            "| --- | --- | --- | --- |"]
    for p in REGISTRY:
        status = STATUS_SHOWN[p.status]
        if p.status == DEFAULT_ONLY:
            status += ": " + ", ".join(f"`{json.dumps(v)}`" for v in p.accepts)
        endpoints = ", ".join("chat" if e == CHAT else "completions" for e in p.endpoints)
        rows.append(f"| `{p.name}` | {endpoints} | {status} | {p.note.replace('|', '/')} |")
    return "\n".join(rows)

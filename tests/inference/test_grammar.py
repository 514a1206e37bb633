"""inference/grammar.py on the served model's real tokenizer: the mask allows exactly the valid continuations, the
decode side's replay, the compile cache, compile errors; and the engine hook on the real model (every output over
many seeds obeys its spec)."""
import json
import re

import pytest
import torch

from inference.grammar import GrammarCompiler, GrammarError, grammar_accept, grammar_attach, grammar_mask, spec_key
from inference.sequence import SamplingParams, Sequence, SeqStatus
from tests.inference.helpers import make_engine, run_until_done

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color", "tags", "member"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                         "member": {"type": "boolean"}}}


def validate(value, schema) -> None:
    """The JSON-schema subset PERSON uses (type, required, additionalProperties, properties, enum, bounds)."""
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict), value
        assert set(schema["required"]) <= set(value), value
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), value
        for key, sub in schema["properties"].items():
            if key in value:
                validate(value[key], sub)
    elif kind == "string":
        assert isinstance(value, str) and schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1e9)
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", -1e18) <= value <= schema.get("maximum", 1e18), value
    elif kind == "boolean":
        assert isinstance(value, bool), value
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", 1e9), value
        for item in value:
            validate(item, schema["items"])
    else:
        raise AssertionError(f"schema type {kind} is outside the validated subset")


@pytest.fixture(scope="module")
def tokenizer():
    from inference.loader import load_tokenizer

    return load_tokenizer()[0]


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, tokenizer.vocab_size + 64)  # logits wider than the vocabulary


def seq_with(spec, request_id="r") -> Sequence:
    return Sequence(request_id, [1, 2, 3], SamplingParams(max_tokens=64, structured=spec))


def allowed(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(logits > float("-inf")).flatten().tolist())


def test_the_mask_allows_exactly_the_tokens_whose_bytes_continue_the_regex(tokenizer, compiler):
    seq = seq_with({"type": "regex", "pattern": "ab[0-9]{2}"})
    grammar_attach(seq, tokenizer, compiler.vocab_width)
    logits = torch.zeros(2, compiler.vocab_width)  # row 1: a sequence without a grammar, left alone
    plain = Sequence("p", [1], SamplingParams(max_tokens=4))
    grammar_mask(logits, [seq, plain], tokenizer)
    want = {i for i in range(tokenizer.vocab_size)
            if (b := tokenizer.token_bytes(i)) and re.fullmatch(rb"a|ab|ab[0-9]{1,2}", b)}
    assert allowed(logits[0]) == want and want
    assert allowed(logits[1]) == set(range(compiler.vocab_width))
    assert not allowed(logits[0]) & set(range(tokenizer.vocab_size, compiler.vocab_width))  # padding never


def test_eos_is_allowed_only_where_the_grammar_may_end_and_ending_finishes_the_sequence(tokenizer, compiler):
    seq = seq_with({"type": "choice", "choices": ["yes", "no"]})
    grammar_attach(seq, tokenizer, compiler.vocab_width)
    eos = tokenizer.eos_ids[0]
    logits = torch.zeros(1, compiler.vocab_width)
    grammar_mask(logits, [seq], tokenizer)
    assert eos not in allowed(logits[0])
    for token in tokenizer.encode("yes"):
        grammar_accept([seq], [token])
        seq.output_ids.append(token)
    logits = torch.zeros(1, compiler.vocab_width)
    grammar_mask(logits, [seq], tokenizer)
    assert allowed(logits[0]) == {eos}
    grammar_accept([seq], [eos])
    assert seq.status is SeqStatus.FINISHED and seq.finish_reason == "stop"


def test_a_token_the_grammar_refuses_fails_the_sequence(tokenizer, compiler):
    seq = seq_with({"type": "choice", "choices": ["yes", "no"]})
    grammar_attach(seq, tokenizer, compiler.vocab_width)
    grammar_accept([seq], tokenizer.encode("maybe")[:1])
    assert seq.status is SeqStatus.FAILED and "outside the request's grammar" in seq.error


def test_the_decode_side_replay_rebuilds_the_state_prefill_left(tokenizer, compiler):
    spec = {"type": "json_schema", "schema": PERSON}
    produced = tokenizer.encode('{"name": "Ada", "age": 3')
    live = seq_with(spec)
    grammar_attach(live, tokenizer, compiler.vocab_width)
    for token in produced:
        grammar_accept([live], [token])
    replayed = seq_with(spec, "d")
    grammar_attach(replayed, tokenizer, compiler.vocab_width, replay=produced)
    a, b = torch.zeros(1, compiler.vocab_width), torch.zeros(1, compiler.vocab_width)
    grammar_mask(a, [live], tokenizer)
    grammar_mask(b, [replayed], tokenizer)
    assert allowed(a[0]) == allowed(b[0]) and tokenizer.encode("}")[0] not in allowed(b[0])  # "color" etc. missing
    with pytest.raises(GrammarError, match="breaks its grammar"):
        grammar_attach(seq_with(spec, "x"), tokenizer, compiler.vocab_width, replay=tokenizer.encode("[1]"))


def test_compiled_grammars_are_cached_by_the_canonical_spec(tokenizer):
    compiler = GrammarCompiler(tokenizer)
    first = compiler.compile({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {}}}})
    again = compiler.compile({"schema": {"properties": {"a": {}}, "type": "object"}, "type": "json_schema"})
    assert again is first and (compiler.hits, compiler.misses) == (1, 1)
    assert spec_key({"b": 1, "a": [2]}) == spec_key({"a": [2], "b": 1})
    compiler.compile({"type": "regex", "pattern": "x+"})
    assert compiler.misses == 2


@pytest.mark.parametrize("spec, message", [
    ({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "strung"}}}}, "strung"),
    ({"type": "regex", "pattern": "(ab"}, "parenthesis"),
    ({"type": "grammar", "ebnf": "root ::= missing_rule"}, "missing_rule"),
    ({"type": "choice", "choices": []}, "non-empty"),
    ({"type": "nope"}, "unknown structured output type"),
])
def test_a_spec_that_does_not_compile_raises_grammar_error_once(tokenizer, spec, message):
    compiler = GrammarCompiler(tokenizer)
    for _ in range(2):
        with pytest.raises(GrammarError, match=message):
            compiler.compile(spec)
    assert (compiler.hits, compiler.misses) == (1, 1)


# ---- the engine on the real model: the hook in Engine.step, over many seeds -------------------------------------

SEEDS = range(20)


def chat(model, text):
    return model.tokenizer.encode_chat([{"role": "user", "content": text}])


def run_seeds(model, prompt, spec, max_tokens, temperature=1.0, seeds=SEEDS):
    engine = make_engine(model, num_pages=512, max_num_seqs=len(seeds))
    seqs = [engine.add_request(f"s{seed}", prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                                  seed=seed, structured=spec)) for seed in seeds]
    return run_until_done(engine, seqs)


@pytest.mark.timeout(900)
def test_json_schema_output_always_parses_and_validates_over_20_seeds(real_model):
    seqs = run_seeds(real_model, chat(real_model, "Describe a person as JSON."),
                     {"type": "json_schema", "schema": PERSON}, 160)
    for seq in seqs:
        assert seq.finish_reason == "stop", (seq.finish_reason, seq.text)
        validate(json.loads(seq.text), PERSON)
    assert len({s.text for s in seqs}) > 1  # sampled, not one answer


@pytest.mark.timeout(600)
def test_regex_output_always_matches_over_20_seeds(real_model):
    pattern = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3} years old\."
    for seq in run_seeds(real_model, chat(real_model, "How old is Bob?"), {"type": "regex", "pattern": pattern}, 40):
        assert seq.finish_reason == "stop" and re.fullmatch(pattern, seq.text), seq.text


@pytest.mark.timeout(600)
def test_choice_output_is_always_one_of_the_choices_over_20_seeds(real_model):
    choices = ["positive", "negative", "neutral"]
    seqs = run_seeds(real_model, chat(real_model, "Sentiment of: I love it!"), {"type": "choice", "choices": choices}, 16)
    assert all(s.finish_reason == "stop" and s.text in choices for s in seqs), [s.text for s in seqs]


@pytest.mark.timeout(600)
def test_json_object_greedy_output_is_a_json_object(real_model):
    (seq,) = run_seeds(real_model, chat(real_model, "Give me a JSON object about a cat."), {"type": "json_object"},
                       200, temperature=0.0, seeds=[0])
    assert seq.finish_reason == "stop" and isinstance(json.loads(seq.text), dict), seq.text


def test_a_prefilled_handoff_replays_its_first_token_and_decodes_on(real_model):
    """The decode side's engine (add_prefilled) rebuilds the grammar from the first token and keeps to it."""
    spec = {"type": "choice", "choices": ["positive", "negative"]}
    prompt = chat(real_model, "Sentiment of: I love it!")
    params = SamplingParams(max_tokens=16, structured=spec)
    prefill = make_engine(real_model, num_pages=64)
    seq = prefill.add_request("p", prompt, SamplingParams(max_tokens=16, structured=spec), prefill_only=True)
    while not seq.is_done:
        prefill.step()
    blob, _ = prefill.export_kv(seq)
    first = seq.output_ids[0]
    decode = make_engine(real_model, num_pages=64)
    out = decode.add_prefilled("p", prompt, first, blob, params)
    run_until_done(decode, [out])
    assert out.text in spec["choices"] and out.finish_reason == "stop"
    with pytest.raises(GrammarError, match="breaks its grammar"):
        decode.add_prefilled("q", prompt, tokenizer_first_bad(real_model), blob, params)
    assert not decode.has_request("q") and decode.block_manager.num_free() == 64


def tokenizer_first_bad(model) -> int:
    return model.tokenizer.encode("zzz")[0]

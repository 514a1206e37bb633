"""Each sampling knob proven on the real model (SmolLM2-135M-Instruct) through the engine: what it must change
changes, what it must keep equals greedy, and the text at every cut is whole UTF-8."""
import pytest

from inference.sequence import SamplingParams, SeqStatus
from tests.inference.helpers import make_engine, run_until_done

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]  # greedy: "The capital of France is Paris."
FRUITS = [{"role": "user", "content": "List fruits, separated by commas."}]  # greedy: "* Apple\n" over and over
EMOJI = [{"role": "user", "content": "Write a smiley emoji: "}]  # greedy: "👍👎", 3 byte-level tokens each


@pytest.fixture(scope="module")
def engine(real_model):
    return make_engine(real_model, num_pages=256)


@pytest.fixture(scope="module")
def chat(engine):
    def run(messages, **kw):
        kw.setdefault("max_tokens", 16)
        (seq,) = engine.generate([engine.tokenizer.encode_chat(messages)], SamplingParams(**kw))
        return seq
    return run


def test_top_k_1_at_temperature_1_5_is_greedy(chat):
    greedy = chat(FRANCE, max_tokens=12, ignore_eos=True)
    assert chat(FRANCE, max_tokens=12, ignore_eos=True, temperature=1.5, top_k=1, seed=7).output_ids == \
        greedy.output_ids
    assert chat(FRANCE, max_tokens=12, ignore_eos=True, temperature=1.5, seed=7).output_ids != greedy.output_ids


def test_min_p_near_1_at_high_temperature_is_greedy(chat):
    greedy = chat(FRANCE, max_tokens=12, ignore_eos=True)
    for seed in (1, 2):
        assert chat(FRANCE, max_tokens=12, ignore_eos=True, temperature=1.8, min_p=0.99, seed=seed).output_ids == \
            greedy.output_ids


def test_logit_bias_minus_100_on_the_greedy_first_token_changes_it(chat):
    first = chat(FRANCE, max_tokens=1).output_ids[0]
    assert chat(FRANCE, max_tokens=1, logit_bias=((first, -100.0),)).output_ids[0] != first


def test_logit_bias_plus_100_forces_a_token(chat, engine):
    paris = engine.tokenizer.encode(" Paris")
    assert len(paris) == 1
    seq = chat(FRANCE, max_tokens=3, logit_bias=((paris[0], 100.0),), ignore_eos=True)
    assert seq.output_ids == paris * 3
    hot = chat(FRANCE, max_tokens=3, logit_bias=((paris[0], 100.0),), ignore_eos=True, temperature=1.5, seed=3)
    assert hot.output_ids == paris * 3


def test_min_tokens_holds_the_end_back(chat, engine):
    natural = chat(FRANCE, max_tokens=40)
    assert natural.finish_reason == "stop" and len(natural.output_ids) < 20
    held = chat(FRANCE, max_tokens=40, min_tokens=20)
    assert len(held.output_ids) >= 20 and held.text.startswith(natural.text)
    assert not set(held.output_ids[:20]) & set(engine.tokenizer.eos_ids)


@pytest.mark.parametrize("penalty", [dict(frequency_penalty=1.0), dict(presence_penalty=1.5),
                                     dict(repetition_penalty=1.3)],
                         ids=["frequency_penalty", "presence_penalty", "repetition_penalty"])
def test_each_penalty_changes_a_repetitive_reply(chat, penalty):
    greedy = chat(FRUITS, max_tokens=40, ignore_eos=True)
    assert greedy.text.count("Apple") >= 6  # the reply the penalties are for
    penalized = chat(FRUITS, max_tokens=40, ignore_eos=True, **penalty)
    assert penalized.text != greedy.text and penalized.text.count("Apple") < greedy.text.count("Apple")


def test_stop_token_ids_end_the_answer_without_their_text(chat, engine):
    france = engine.tokenizer.encode(" France")[0]
    greedy = chat(FRANCE, max_tokens=16)
    assert france in greedy.output_ids
    seq = chat(FRANCE, max_tokens=16, stop_token_ids=(france,))
    assert seq.finish_reason == "stop" and seq.output_ids[-1] == france and seq.text == "The capital of"


def test_include_stop_str_in_output_keeps_the_stop_string(chat):
    kept = chat(FRANCE, max_tokens=16, stop=(" Paris",), include_stop_str_in_output=True)
    cut = chat(FRANCE, max_tokens=16, stop=(" Paris",))
    assert (kept.text, kept.finish_reason) == ("The capital of France is Paris", "stop")
    assert cut.text == "The capital of France is"


def test_ignore_eos_runs_to_max_tokens(chat):
    assert len(chat(FRANCE, max_tokens=30).output_ids) < 30
    seq = chat(FRANCE, max_tokens=30, ignore_eos=True)
    assert len(seq.output_ids) == 30 and seq.finish_reason == "length"


def test_logprobs_list_every_completion_token_the_eos_included(engine):
    seq = engine.add_request("lp", engine.tokenizer.encode_chat(FRANCE), SamplingParams(max_tokens=32, logprobs=2))
    events = []
    while not seq.is_done:
        events += [e for e in engine.step() if e.seq is seq]
    engine.pop_finished()
    assert seq.finish_reason == "stop" and seq.output_ids[-1] in engine.tokenizer.eos_ids
    assert [e.token for e in events if e.logprobs] == seq.output_ids  # one entry per completion token


def test_a_cut_inside_a_character_never_shows_u_fffd(chat, engine):
    whole = chat(EMOJI, max_tokens=16)
    assert whole.text == "👍👎" and len(whole.output_ids) == 7
    for n in range(1, 7):
        cut = chat(EMOJI, max_tokens=n)
        assert "\ufffd" not in cut.text and cut.finish_reason == "length"
        assert cut.text == ("👍" if n >= 3 else "") + ("👎" if n >= 6 else "")
    seq = engine.add_request("cut", engine.tokenizer.encode_chat(EMOJI), SamplingParams(max_tokens=5))
    deltas = []
    while not seq.is_done:
        deltas += [e.text_delta for e in engine.step() if e.seq is seq]
    engine.pop_finished()
    assert deltas and not any("\ufffd" in d for d in deltas) and "".join(deltas) == seq.text == "👍"


ALL_KNOBS = dict(temperature=1.1, top_k=40, top_p=0.9, min_p=0.02, frequency_penalty=0.4, presence_penalty=0.3,
                 repetition_penalty=1.1, min_tokens=4, logit_bias=((30, -2.0),), max_tokens=14, ignore_eos=True)


def test_a_seeded_request_draws_the_same_alone_in_a_batch_and_across_the_handoff(real_model, engine):
    ids = real_model.tokenizer.encode_chat(FRUITS)
    params = SamplingParams(seed=11, **ALL_KNOBS)
    (alone,) = engine.generate([ids], params)
    others = [real_model.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in ("Hi!", "Name a color.")]
    batch = engine.generate([others[0], ids, others[1]], [SamplingParams(seed=1, **ALL_KNOBS), params,
                                                          SamplingParams(max_tokens=9)])
    assert batch[1].output_ids == alone.output_ids
    prefill, decode = make_engine(real_model, num_pages=32), make_engine(real_model, num_pages=32)
    p = prefill.add_request("h", ids, params, prefill_only=True)
    run_until_done(prefill, [p])
    blob, _ = prefill.export_kv(p)
    d = decode.add_prefilled("h", ids, p.output_ids[0], blob, params, num_transferred=len(ids))
    run_until_done(decode, [d])
    assert d.status is SeqStatus.FINISHED and d.output_ids == alone.output_ids
    assert SamplingParams(seed=12, **ALL_KNOBS) != params
    assert engine.generate([ids], SamplingParams(seed=12, **ALL_KNOBS))[0].output_ids != alone.output_ids

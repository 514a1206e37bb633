"""WorkerRuntime with n choices against real Redis: one prefill samples every choice's first token, the one handoff
carries them (signed, checked), decode forks it, one stream carries every choice's deltas by index and exactly
one Done with the prompt counted once; best_of returns the best cumulative logprobs."""
import dataclasses

import pytest

from inference.engine import EngineConfig
from inference.events import Delta, Done, Error
from inference.handoff import HandoffRefused, Verdict
from inference.sequence import SamplingParams
from inference.worker import RuntimeOptions, WorkerRuntime

KEY = b"k" * 32
PROMPT = list(range(10, 47))  # 37 tokens: 2 full pages of 16 and 5 on the third


def sampled(max_tokens=6, seed=99):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


@pytest.fixture
def pair(redis_client, ledger_prefix, tiny_model):
    opts = RuntimeOptions(prefix=ledger_prefix, lease_ttl_s=30, registry_ttl_s=15)
    made = [WorkerRuntime(role, redis_client, KEY, model=tiny_model, options=opts,
                          config=EngineConfig(num_pages=64, page_size=16, window=1024)) for role in ("prefill", "decode")]
    yield made
    for rt in made:
        rt.stop()


def test_n_choices_one_prefill_one_stream_one_done(pair):
    prefill, decode = pair
    single = decode.decode("r0", PROMPT, sampled(), prefill.prefill("r0", PROMPT, sampled()).to_dict())
    handoff = prefill.prefill("r1", PROMPT, sampled(), choices=3)
    assert handoff.verdict is Verdict.OK and len(handoff.choice_tokens) == 3
    assert handoff.choice_tokens[0] == handoff.first_token == single.output_ids[0]
    seqs = decode.decode("r1", PROMPT, sampled(), handoff.to_dict(), choices=3)
    assert [s.index for s in seqs] == [0, 1, 2] and seqs[0].output_ids == single.output_ids
    assert decode.ledger.num_free() == 64 and not decode.engine.groups
    decode.ledger.check_integrity()
    events = list(decode.outputs.read("r1", timeout_s=5))
    assert sum(isinstance(e, (Done, Error)) for e in events) == 1 and isinstance(events[-1], Done)
    done = events[-1]
    assert done.usage.prompt_tokens == len(PROMPT) and done.usage.completion_tokens == 18
    assert [c.index for c in done.choices] == [0, 1, 2] and all(c.finish_reason == "length" for c in done.choices)
    texts = {i: "".join(e.text for e in events if isinstance(e, Delta) and e.index == i) for i in range(3)}
    assert [texts[i] for i in range(3)] == [s.text for s in seqs] and texts[0] == single.text
    records = {r["request"]: r for r in decode.outputs.read_records({s.request_id for s in seqs})}
    assert len(records) == 3 and all(r["shared"] == 2 and r["choice_of"] == "r1" for r in records.values())


def test_best_of_returns_the_highest_cumulative_logprobs_and_counts_them(pair):
    prefill, decode = pair
    handoff = prefill.prefill("all", PROMPT, sampled(), choices=3, score=True)
    assert handoff.first_logprobs is None and all(lp is not None for lp in handoff.choice_logprobs)  # scored only
    every = decode.decode("all", PROMPT, sampled(), handoff.to_dict(), choices=3, returned=3, score=True)
    scores = [s.cumulative_logprob for s in every]  # best_of == n: all, by index
    assert [s.index for s in every] == [0, 1, 2] and len(set(scores)) == 3
    top = max(every, key=lambda s: s.cumulative_logprob)
    best = decode.decode("b1", PROMPT, sampled(), prefill.prefill("b1", PROMPT, sampled(), choices=3,
                                                                   score=True).to_dict(),
                         choices=3, returned=1, score=True)
    events = list(decode.outputs.read("b1", timeout_s=5))
    done = events[-1]
    assert all(isinstance(e, Delta) and e.logprobs is None for e in events[:-1])  # not asked: none shown
    (chosen,) = done.choices
    assert chosen.index == best[0].index == top.index and best[0].output_ids == top.output_ids
    assert done.usage.completion_tokens == 6  # the returned choice's tokens (as vLLM), prompt once
    assert chosen.cumulative_logprob == pytest.approx(top.cumulative_logprob)


def test_the_handoff_must_carry_exactly_the_tasks_choices(pair):
    prefill, decode = pair
    handoff = prefill.prefill("m1", PROMPT, sampled(), choices=2)
    with pytest.raises(HandoffRefused) as err:  # a task of 3 never forks a handoff of 2
        decode.decode("m1", PROMPT, sampled(), handoff.to_dict(), choices=3)
    assert err.value.kind == "handoff_mismatch"
    one = prefill.prefill("m2", PROMPT, sampled())
    with pytest.raises(HandoffRefused):
        decode.decode("m2", PROMPT, sampled(), one.to_dict(), choices=2)
    forged = dataclasses.replace(prefill.prefill("m3", PROMPT, sampled(), choices=2), choice_tokens=(1, 2, 3))
    with pytest.raises(HandoffRefused) as err:  # the choices are signed with the rest
        decode.decode("m3", PROMPT, sampled(), forged.to_dict(), choices=3)
    assert err.value.kind == "handoff_forged"
    assert decode.ledger.num_free() == 64


def test_a_prefill_of_choices_that_can_never_fit_is_rejected(pair):
    prefill, _ = pair
    handoff = prefill.prefill("big", PROMPT, sampled(max_tokens=400), choices=3)  # 37 + 3 x 400 > 1024
    assert handoff.verdict is Verdict.REJECTED and prefill.ledger.num_free() == 64


def test_every_choices_read_record_is_stored_before_its_request_resolves(pair):
    """The audit stream holds each choice's read record once the caller has its answer: the records are written
    before the request's one Done (its first finishing choice would publish it while the loop still had the
    others' records to write)."""
    prefill, decode = pair
    for i in range(5):
        rid = f"r8-{i}"
        seqs = decode.decode(rid, PROMPT, sampled(seed=i), prefill.prefill(rid, PROMPT, sampled(seed=i), choices=8)
                             .to_dict(), choices=8)
        assert len(decode.outputs.read_records({s.request_id for s in seqs})) == 8, i

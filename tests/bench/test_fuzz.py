"""bench.fuzz's seeded short run (the real model, in process, on a real RedisLedger): every output equals its
request run alone, no sentinel crosses, nothing is left in the engine or the pool; and the fuzzer does
report a cross-request corruption (a prefix cache whose chain ignores the tokens) with a replay command."""
import argparse

import pytest

import inference.prefix_cache as prefix_cache
from bench.fuzz import Alone, fuzz_one, make_schedule

SEED = 13  # its schedule 0 preempts, hits the prefix cache, evicts, aborts and echoes a sentinel (asserted below)


def args(**kw):  # choices 0: the seeded schedules as before n > 1 (test_requests_of_n_choices... fuzzes those)
    return argparse.Namespace(**{"requests": 4, "model": "real", "tie_margin": 0.01, "choices": 0.0, **kw})


@pytest.fixture(scope="module")
def alone(real_model):
    return Alone(real_model)


@pytest.mark.timeout(300)
def test_a_seeded_schedule_matches_each_request_run_alone(real_model, alone, redis_client, ledger_prefix):
    r = fuzz_one(real_model, alone, SEED, 0, args(), redis_client, ledger_prefix)
    assert r["divergences"] == [] and r["foreign_sightings"] == [] and r["problems"] == [], r
    assert r["passed"]
    exercised = {k: r[k] for k in ("preemptions", "prefix_hits", "evicted_pages", "aborted", "echoed_own_sentinel")}
    assert all(exercised.values()), f"the seed no longer exercises everything: {exercised}"


def test_schedules_are_reproducible_from_seed_and_index(real_model):
    a, b = make_schedule(real_model.tokenizer, SEED, 1, 4), make_schedule(real_model.tokenizer, SEED, 1, 4)
    assert [r.describe() for r in a.reqs] == [r.describe() for r in b.reqs] and a.num_pages == b.num_pages
    assert [r.prompt_ids for r in a.reqs] == [r.prompt_ids for r in b.reqs]
    assert [r.describe() for r in make_schedule(real_model.tokenizer, SEED, 2, 4).reqs] != [r.describe() for r in a.reqs]


@pytest.mark.timeout(300)
def test_a_prefix_cache_that_ignores_the_tokens_is_a_divergence_with_a_replay(real_model, alone, redis_client,
                                                                               ledger_prefix, monkeypatch):
    real_chain = prefix_cache.chain_keys
    monkeypatch.setattr(prefix_cache, "chain_keys",
                        lambda salt, tokens, page_size, n: real_chain(salt, [0] * len(tokens), page_size, n))
    r = fuzz_one(real_model, alone, SEED, 0, args(), redis_client, ledger_prefix)
    assert not r["passed"] and r["divergences"], r
    assert r["replay"] == f"python -m bench.fuzz --seed {SEED} --schedule 0 --choices 0.0"
    assert all(not d["tolerated"] for d in r["divergences"])


@pytest.mark.timeout(300)
def test_requests_of_n_choices_match_their_request_run_alone_through_preemption(tiny_model, redis_client,
                                                                                ledger_prefix):
    """Seed 7 schedule 4 (8 requests, two of them of 4 and 2 choices) preempts choices; every greedy choice is still
    its request's alone answer, and the forked requests' shared pages are gone at the end."""
    r = fuzz_one(tiny_model, Alone(tiny_model), 7, 4, args(requests=8, model="tiny", choices=0.25), redis_client,
                 ledger_prefix)
    assert r["passed"] and r["divergences"] == [] and r["problems"] == [], r
    assert r["choices"] == 6 and r["choice_preemptions"] > 0, r

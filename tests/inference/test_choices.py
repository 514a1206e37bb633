"""A request's n choices in the engine: prefilled once, forked after the handoff into n sequences that share the
prompt's full pages read-only under the request's own scope and own the rest; a reader outside that scope is
a violation; the shared pages go (scrubbed) only after the last choice."""
import pytest
import torch

from inference.allocator import LedgerError, cache_entry
from inference.block_manager import OwnershipViolation
from inference.choices import ChoiceEnd, best_choices, choice_id, choice_params, choice_scope, request_of
from inference.engine import Engine, EngineConfig
from inference.ledger import RedisLedger
from inference.scheduler import RequestTooLarge
from inference.sequence import SamplingParams, SeqStatus
from tests.inference.helpers import make_engine, run_until_done

PROMPT = list(range(30, 53))  # 23 tokens: 5 full pages of 4 and a last page holding 3


def sampled(max_tokens=8, seed=1234, temperature=1.0, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True, **kw)


def prefill(engine, rid, prompt, params, choices=1, score=False):
    seq = engine.add_request(rid, prompt, params, prefill_only=True, choices=choices, score=score)
    while seq.status is not SeqStatus.PREFILLED:
        engine.step()
    blob, _ = engine.export_kv(seq)
    engine.release(seq)
    return seq, blob


def single(prefill_engine, decode_engine, rid, prompt, params):
    seq, blob = prefill(prefill_engine, rid, prompt, params)
    out = decode_engine.add_prefilled(rid, prompt, seq.output_ids[0], blob, params)
    run_until_done(decode_engine, [out])
    decode_engine.seqs.pop(rid, None)
    return out


def fork(prefill_engine, decode_engine, rid, prompt, params, n, score=False):
    seq, blob = prefill(prefill_engine, rid, prompt, params, choices=n, score=score)
    assert len(seq.choice_tokens) == n
    return decode_engine.add_prefilled_choices(rid, prompt, seq.choice_tokens, blob, choice_params(params, n, score),
                                               first_logprobs=seq.choice_logprobs, score=score)


def redis_engine(model, redis_client, prefix, pool_id, role, num_pages=64):
    def allocator(n):
        return RedisLedger.register(redis_client, pool_id, role, n, 4, prefix=prefix)

    return Engine(model, EngineConfig(num_pages=num_pages, page_size=4), allocator_factory=allocator)


def test_ids_scopes_and_seeds():
    assert request_of(choice_id("chatcmpl-1", 3)) == "chatcmpl-1" and request_of("chatcmpl-1") == "chatcmpl-1"
    scope = choice_scope("chatcmpl-1")
    assert scope != choice_scope("chatcmpl-2") and len(scope) != 64 and cache_entry(scope)  # never a tenant salt
    params = choice_params(sampled(seed=7), 3)
    assert params[0].seed == 7 and len({p.seed for p in params}) == 3
    assert choice_params(sampled(seed=7), 3) == params  # the same request samples the same choices anywhere
    ends = [ChoiceEnd(0, "length", 4, -3.0), ChoiceEnd(1, "stop", 2, -1.0), ChoiceEnd(2, "length", 4, -2.0)]
    assert [e.index for e in best_choices(ends, 2, ranked=True)] == [1, 2]
    assert [e.index for e in best_choices(ends, 2, ranked=False)] == [0, 1]


def test_n_choices_share_the_prompt_pages_of_the_requests_own_scope_on_the_redis_ledger(
        tiny_model, redis_client, ledger_prefix):
    pre = redis_engine(tiny_model, redis_client, ledger_prefix, "p1", "prefill")
    dec = redis_engine(tiny_model, redis_client, ledger_prefix, "d1", "decode")
    ref = single(pre, make_engine(tiny_model, page_size=4), "r0", PROMPT, sampled())
    ledger = dec.block_manager.allocator
    seqs = fork(pre, dec, "r1", PROMPT, sampled(), 3)
    scope = choice_scope("r1")
    shared = seqs[0].block_table[:5]
    assert all(s.block_table[:5] == shared and s.num_shared == 5 and s.share_scope == scope for s in seqs)
    assert len({s.block_table[5] for s in seqs}) == 3  # each choice its own copy of the partly filled last page
    assert all(ledger.pages_of(s.request_id) == {s.block_table[5]: s.page_epochs[5]} for s in seqs)
    snap = ledger.snapshot()
    assert all(snap[p]["owner"] == cache_entry(scope) and snap[p]["scope"] == scope for p in shared)
    assert all(sorted(snap[p]["readers"]) == sorted(s.request_id for s in seqs) for p in shared)
    ledger.check_integrity()
    run_until_done(dec, seqs)
    assert seqs[0].output_ids == ref.output_ids  # choice 0 is the n=1 answer: the shared KV is the prompt's
    assert len({tuple(s.output_ids) for s in seqs}) > 1  # and the others sample streams of their own
    assert all(s.read_record["shared"] == 5 and s.read_record["scope"] == scope for s in seqs)
    assert dec.groups == {} and ledger.num_free() == 64 and ledger.reads_of(seqs[0].request_id) == []
    assert dec.pool.data[shared].abs().sum() == 0  # scrubbed after the last choice
    ledger.check_integrity()


def test_greedy_choices_equal_the_single_answer(tiny_model):
    pre, dec = make_engine(tiny_model, page_size=4), make_engine(tiny_model, page_size=4)
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = single(pre, make_engine(tiny_model, page_size=4), "g0", PROMPT[:20], greedy)  # a prompt of full pages
    seqs = fork(pre, dec, "g1", PROMPT[:20], greedy, 2)
    assert seqs[0].num_shared == 5 and len(seqs[0].block_table) == 6  # its own page: the first decode page
    run_until_done(dec, seqs)
    assert [s.output_ids for s in seqs] == [ref.output_ids, ref.output_ids]


def test_a_reader_outside_the_requests_scope_is_a_violation(tiny_model, redis_client, ledger_prefix):
    pre = make_engine(tiny_model, page_size=4)
    dec = redis_engine(tiny_model, redis_client, ledger_prefix, "d2", "decode")
    bm = dec.block_manager
    seqs = fork(pre, dec, "r2", PROMPT, sampled(), 2)
    shared, epochs = seqs[0].block_table[:5], seqs[0].page_epochs[:5]
    # another request whose table points at a shared page, as its own page
    intruder = dec.add_request("other", [1, 2, 3], sampled(max_tokens=2))
    dec.scheduler.remove(intruder)
    bm.allocate(intruder, 1)
    intruder.block_table[0], intruder.page_epochs[0] = shared[0], epochs[0]
    with pytest.raises(OwnershipViolation, match="foreign_read: request other would read page"):
        bm.check_reads(intruder, 3, 1)
    # or as shared pages of a tenant's scope: not the request's scope
    tenant = dec.add_request("tenant-reader", PROMPT, sampled(max_tokens=2))
    dec.scheduler.remove(tenant)
    tenant.salt = "a" * 64
    tenant.block_table, tenant.page_epochs, tenant.num_shared = list(shared), list(epochs), 5
    bm.allocate(tenant, 1)
    with pytest.raises(OwnershipViolation, match="foreign_read: request tenant-reader"):
        bm.check_reads(tenant, 20, 3)
    with pytest.raises(LedgerError, match="outside its scope"):  # and the ledger refuses that read itself
        bm.allocator.hit("tenant-reader2", "a" * 64, shared, epochs)
    # a choice of ANOTHER request claiming this one's pages under its own request scope
    thief = dec.add_request("r3-thief", PROMPT, sampled(max_tokens=2))
    dec.scheduler.remove(thief)
    thief.share_scope = choice_scope("r3")
    thief.block_table, thief.page_epochs, thief.num_shared = list(shared), list(epochs), 5
    bm.allocate(thief, 1)
    with pytest.raises(OwnershipViolation, match="foreign_read"):
        bm.check_reads(thief, 20, 3)
    for s in seqs:  # the siblings themselves read fine
        bm.check_reads(s, s.num_cached, 1)


def test_the_guard_fails_an_injected_foreign_read_closed_in_a_step(tiny_model):
    pre, dec = make_engine(tiny_model, page_size=4), make_engine(tiny_model, page_size=4)
    seqs = fork(pre, dec, "r4", PROMPT, sampled(max_tokens=6), 2)
    victim = dec.add_request("v1", [5, 6, 7], sampled(max_tokens=6))
    dec.step()
    victim.block_table[0] = seqs[0].block_table[0]  # a page of the request scope, under a foreign reader
    events = dec.step()
    assert [e.seq.request_id for e in events if e.seq.status is SeqStatus.FAILED] == ["v1"]
    assert [v.kind for v in dec.take_violations()] == ["foreign_read"]
    run_until_done(dec, seqs)
    dec.block_manager.allocator.check_integrity()


def test_the_shared_pages_go_only_after_the_last_choice(tiny_model, redis_client, ledger_prefix):
    pre, other = make_engine(tiny_model, page_size=4), make_engine(tiny_model, page_size=4)
    dec = redis_engine(tiny_model, redis_client, ledger_prefix, "d3", "decode")
    ref = run_until_done(other, fork(pre, other, "r5", PROMPT, sampled(max_tokens=8), 3))
    ledger = dec.block_manager.allocator
    seqs = fork(pre, dec, "r5", PROMPT, sampled(max_tokens=8), 3)
    shared = seqs[0].block_table[:5]
    dec.step()
    dec.abort(choice_id("r5", 1))  # one choice ends early: its own pages go, the shared ones stay for its siblings
    assert ledger.pages_of(choice_id("r5", 1)) == {} and "r5" in dec.groups
    assert dec.pool.data[shared].abs().sum() > 0
    assert all(sorted(ledger.snapshot()[p]["readers"]) == [choice_id("r5", 0), choice_id("r5", 2)] for p in shared)
    dec.step()
    dec.abort(choice_id("r5", 0))
    assert "r5" in dec.groups and dec.pool.data[shared].abs().sum() > 0
    run_until_done(dec, [seqs[2]])
    assert seqs[2].output_ids == ref[2].output_ids  # its siblings' ends never touched what it reads
    assert "r5" not in dec.groups and dec.pool.data[shared].abs().sum() == 0 and ledger.num_free() == 64
    ledger.check_integrity()


def test_aborting_the_request_ends_every_choice_and_frees_everything(tiny_model, redis_client, ledger_prefix):
    pre = make_engine(tiny_model, page_size=4)
    dec = redis_engine(tiny_model, redis_client, ledger_prefix, "d4", "decode")
    seqs = fork(pre, dec, "r6", PROMPT, sampled(max_tokens=8), 4)
    dec.step()
    dec.abort("r6", "client_disconnected")
    assert all(s.status is SeqStatus.FAILED for s in seqs) and not dec.has_request("r6")
    assert dec.block_manager.allocator.num_free() == 64 and dec.pool.data.abs().sum() == 0
    dec.block_manager.allocator.check_integrity()


def test_choices_that_cannot_fit_are_refused_or_wait_holding_nothing(tiny_model):
    pre = make_engine(tiny_model, page_size=4)
    small = make_engine(tiny_model, page_size=4, num_pages=16)  # 64 tokens
    with pytest.raises(RequestTooLarge):  # 23 + 3 x 16 > 64: never
        fork(pre, small, "big", PROMPT, sampled(max_tokens=16), 3)
    with pytest.raises(RequestTooLarge):
        small.add_request("big2", PROMPT, sampled(max_tokens=16), prefill_only=True, choices=3)
    assert small.groups == {} and small.block_manager.num_free() == 16
    busy = small.add_request("busy", list(range(40)), sampled(max_tokens=2))
    small.step()  # holds 10 of the 16 pages
    assert fork(pre, small, "later", PROMPT, sampled(max_tokens=4), 2) is None  # not now: nothing held
    assert small.groups == {} and small.block_manager.num_free() == 16 - len(busy.block_table)
    run_until_done(small, [busy])
    seqs = fork(pre, small, "later", PROMPT, sampled(max_tokens=4), 2)
    run_until_done(small, seqs)
    assert small.block_manager.num_free() == 16 and small.groups == {}


def test_best_of_scores_every_choice_without_showing_logprobs(tiny_model):
    pre, dec = make_engine(tiny_model, page_size=4), make_engine(tiny_model, page_size=4)
    seqs = fork(pre, dec, "r7", PROMPT, sampled(max_tokens=5), 3, score=True)
    events = []
    while any(not s.is_done for s in seqs):
        events += dec.step()
    assert all(e.logprobs is None for e in events)
    assert all(s.cumulative_logprob is not None and s.cumulative_logprob < 0 for s in seqs)
    assert len({round(s.cumulative_logprob, 6) for s in seqs}) == 3


def test_choices_that_end_with_their_first_token_release_everything_at_once(tiny_model, redis_client, ledger_prefix):
    pre = make_engine(tiny_model, page_size=4)
    dec = redis_engine(tiny_model, redis_client, ledger_prefix, "d5", "decode")
    seqs = fork(pre, dec, "r8", PROMPT, sampled(max_tokens=1), 3)
    assert all(s.is_done and s.finish_reason == "length" and len(s.output_ids) == 1 for s in seqs)
    assert all(s.read_record and s.read_record["shared"] == 5 for s in seqs)
    assert dec.groups == {} and dec.block_manager.allocator.num_free() == 64 and not dec.has_work
    assert dec.pool.data.abs().sum() == 0
    dec.block_manager.allocator.check_integrity()


def test_a_preempted_choice_resumes_on_the_shared_prompt_pages(tiny_model, redis_client, ledger_prefix):
    """The pool holds the prompt once and the choices' own pages, never a copy of the prompt per choice: a choice
    preempted by a shortage reads the shared pages again and recomputes only its own tokens, and every greedy
    choice is still the single answer."""
    pre, other = make_engine(tiny_model, page_size=4), make_engine(tiny_model, page_size=4)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = single(pre, other, "p0", PROMPT, greedy)
    # 5 shared + 3 x cdiv(3 + 12, 4) = 17 pages: room for all three, not for a copy of the prompt per choice
    dec = Engine(tiny_model, EngineConfig(num_pages=18, page_size=4, watermark=0),
                 allocator_factory=lambda n: RedisLedger.register(redis_client, "d6", "decode", n, 4,
                                                                  prefix=ledger_prefix))
    squatter = dec.add_request("sq", list(range(60, 64)), SamplingParams(max_tokens=40, ignore_eos=True))
    dec.step()  # holds 2 pages, growing to 11: the choices' growth must preempt
    seqs = fork(pre, dec, "p1", PROMPT, greedy, 3)
    computed = []
    real_build = dec.runner.build
    dec.runner.build = lambda chunks: computed.extend(c.num_tokens for c in chunks) or real_build(chunks)
    run_until_done(dec, seqs + [squatter])
    assert dec.scheduler.num_preemptions > 0
    assert all(s.output_ids == ref.output_ids for s in seqs)
    assert max(computed) < len(PROMPT)  # a resumed choice never recomputed the shared prompt
    assert dec.groups == {} and dec.block_manager.allocator.num_free() == 18
    dec.block_manager.allocator.check_integrity()

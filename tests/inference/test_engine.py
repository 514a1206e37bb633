import pytest

from inference.engine import DuplicateRequest, Engine, EngineConfig
from inference.faults import Faults
from inference.scheduler import RequestTooLarge
from inference.sequence import SamplingParams, SeqStatus
from tests.inference.helpers import greedy, make_engine, run_until_done

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def prompts_of(model, n, base=5, step=9):
    return [list(range(20, 20 + base + step * i)) for i in range(n)]


def test_chunked_prefill_gives_the_same_tokens_as_one_chunk(tiny_model):
    prompt = list(range(10, 60))
    (whole,) = make_engine(tiny_model).generate([prompt], greedy(12))
    (chunked,) = make_engine(tiny_model, chunk_size=7).generate([prompt], greedy(12))
    assert chunked.output_ids == whole.output_ids and len(whole.output_ids) == 12


@pytest.mark.timeout(600)
def test_eight_mixed_prompts_with_mid_flight_joins_match_each_alone(real_model):
    chats = ["What is the capital of France?", "Name three colors.", "Say hello in Spanish.",
             "What is 2 plus 2?", "Write a haiku about the sea, please, with a long preamble about waves and wind.",
             "Who wrote Hamlet?", "List the planets of the solar system in order from the sun.", "Why is the sky blue?"]
    prompts = [real_model.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in chats]
    alone = [make_engine(real_model, num_pages=128).generate([p], greedy(24))[0].output_ids for p in prompts]
    engine = make_engine(real_model, num_pages=256, chunk_size=64)
    seqs = [engine.add_request(f"r{i}", p, greedy(24)) for i, p in enumerate(prompts[:4])]
    for _ in range(6):
        engine.step()
    assert any(s.status is SeqStatus.RUNNING for s in seqs)  # the later ones join a running batch
    seqs += [engine.add_request(f"r{i + 4}", p, greedy(24)) for i, p in enumerate(prompts[4:])]
    run_until_done(engine, seqs)
    assert [s.output_ids for s in seqs] == alone


def test_a_request_that_does_not_fit_now_waits_and_then_runs(tiny_model):
    engine = make_engine(tiny_model, num_pages=6, page_size=4)
    first = engine.add_request("a", list(range(10, 30)), greedy(4))  # a 20-token prompt = 5 pages at admission
    second = engine.add_request("b", list(range(10, 18)), greedy(4))  # an 8-token prompt = 2 pages
    engine.step()
    assert first.status is SeqStatus.RUNNING and second.status is SeqStatus.WAITING
    assert second.block_table == [] and engine.block_manager.num_free() == 1
    run_until_done(engine, [first, second])
    assert second.finish_reason == "length" and len(second.output_ids) == 4
    assert engine.block_manager.num_free() == 6
    engine.block_manager.allocator.check_integrity()


def test_a_request_longer_than_the_pool_is_refused_before_any_page_is_taken(tiny_model):
    engine = make_engine(tiny_model, num_pages=4, page_size=4)
    with pytest.raises(RequestTooLarge, match="pool 16"):
        engine.add_request("big", list(range(10, 25)), greedy(4))
    assert engine.block_manager.num_free() == 4 and not engine.has_work
    window = make_engine(tiny_model, window=20)
    with pytest.raises(RequestTooLarge, match="window 20"):
        window.add_request("w", list(range(10, 25)), greedy(6))


def test_finish_reasons_eos_stop_string_and_length(real_model):
    ids = real_model.tokenizer.encode_chat(FRANCE)
    engine = make_engine(real_model)
    (natural,) = engine.generate([ids], SamplingParams(max_tokens=32))
    assert natural.text == "The capital of France is Paris." and natural.finish_reason == "stop"
    (stopped,) = engine.generate([ids], SamplingParams(max_tokens=32, stop=(" Paris",)))
    assert stopped.text == "The capital of France is" and stopped.finish_reason == "stop"
    (short,) = engine.generate([ids], SamplingParams(max_tokens=3))
    assert short.text == "The capital of" and short.finish_reason == "length"


def test_first_ten_greedy_ids_for_the_reference_prompt(real_model):
    ids = real_model.tokenizer.encode_chat(FRANCE)
    (seq,) = make_engine(real_model).generate([ids], greedy(10))
    assert seq.output_ids == [504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 2]


def test_streamed_deltas_add_up_to_the_final_text(real_model):
    engine = make_engine(real_model)
    seq = engine.add_request("s", real_model.tokenizer.encode_chat(FRANCE), SamplingParams(max_tokens=32))
    deltas = []
    while not seq.is_done:
        deltas += [e.text_delta for e in engine.step() if e.seq is seq]
    assert "".join(deltas) == seq.text == "The capital of France is Paris."


def test_sampling_is_reproducible_by_seed_and_top_k_1_is_greedy(tiny_model):
    prompt = list(range(10, 30))
    engine = make_engine(tiny_model)

    def run(**kw):
        return engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, **kw))[0].output_ids

    hot = dict(temperature=1.5, top_p=0.95)
    assert run(seed=7, **hot) == run(seed=7, **hot)
    assert run(seed=7, **hot) != run(seed=8, **hot)
    assert run(temperature=1.0, top_k=1, seed=3) == run()
    assert run(seed=5, temperature=0.8, top_k=5) == run(seed=5, temperature=0.8, top_k=5)


def test_handoff_export_import_continues_exactly_like_local_generation(real_model):
    ids = real_model.tokenizer.encode_chat(FRANCE)
    (local,) = make_engine(real_model).generate([ids], greedy(12))
    prefill, decode = make_engine(real_model, num_pages=32), make_engine(real_model, num_pages=32)
    p = prefill.add_request("h", ids, greedy(12), prefill_only=True)
    run_until_done(prefill, [p])
    blob, sums = prefill.export_kv(p)
    assert blob.shape[0] == -(-len(ids) // 16) and len(sums) == blob.shape[0]
    prefill.release(p)
    assert prefill.block_manager.num_free() == 32
    d = decode.add_prefilled("h", ids, p.output_ids[0], blob, greedy(12), num_transferred=len(ids))
    run_until_done(decode, [d])
    assert d.output_ids == local.output_ids


def test_decode_that_believes_more_than_was_written_fails_closed(tiny_model):
    """The incident: a 1-token placeholder was prefilled, decode believes the whole prompt is cached."""
    prompt = list(range(10, 40))
    prefill, decode = make_engine(tiny_model), make_engine(tiny_model)
    p = prefill.add_request("ph", [prompt[0]], greedy(4), prefill_only=True)
    run_until_done(prefill, [p])
    blob, _ = prefill.export_kv(p)
    d = decode.add_prefilled("ph", prompt, p.output_ids[0], blob, greedy(4), num_transferred=1)
    events = decode.step()
    assert d.status is SeqStatus.FAILED and d.text == "" and events[0].token is None
    assert decode.take_violations()[0].kind == "unwritten_read" and decode.take_violations() == []
    assert decode.block_manager.num_free() == 64


def test_foreign_page_read_fails_only_the_reader_and_quarantines(tiny_model):
    engine = make_engine(tiny_model)
    a = engine.add_request("a", list(range(10, 40)), greedy(8))
    b = engine.add_request("b", list(range(50, 80)), greedy(8))
    engine.step()
    a.block_table[0] = b.block_table[0]  # the bug: a's table points at b's page
    engine.step()
    assert a.status is SeqStatus.FAILED and "foreign_read" in a.error and a.text == ""
    run_until_done(engine, [b])
    assert b.status is SeqStatus.FINISHED and len(b.output_ids) == 8
    assert engine.take_violations()[0].page_owner == "b"


def test_with_the_guard_faulted_off_the_foreign_read_goes_through(tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_pages=64, faults=Faults.parse("no_ownership_guard")))
    a = engine.add_request("a", list(range(10, 40)), greedy(8))
    b = engine.add_request("b", list(range(50, 80)), greedy(8))
    engine.step()
    a.block_table[0] = b.block_table[0]
    engine.step()
    assert a.status is SeqStatus.RUNNING and not engine.take_violations()


def test_degenerate_sampling_parameters_still_pick_a_token(tiny_model):
    """top_p that underflows to nothing and tiny temperatures must not fail the batch."""
    engine = make_engine(tiny_model)
    prompt = list(range(10, 30))
    (greedy_seq,) = engine.generate([prompt], greedy(6))
    (tiny_p,) = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, temperature=2.0,
                                                         top_p=5e-324, seed=1))
    (cold,) = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, temperature=1e-6, seed=1))
    assert tiny_p.output_ids == greedy_seq.output_ids == cold.output_ids


# ---- what the engine's host hands back: reclaimed pages, a lost pool, finished sequences -------------

def test_reclaimed_pages_fail_their_holder_scrubbed_without_a_violation_and_the_rest_runs_on(tiny_model):
    engine = make_engine(tiny_model)
    a = engine.add_request("a", list(range(10, 40)), greedy(8))
    b = engine.add_request("b", list(range(50, 80)), greedy(8))
    engine.step()
    a_pages, b_pages = list(a.block_table), list(b.block_table)
    failed = engine.reclaim([a_pages[1]])  # the ledger reaped a's lease (all of a's pages, in fact)
    assert failed == [a] and a.status is SeqStatus.FAILED and a.block_table == []
    assert float(engine.pool.data[a_pages].abs().sum()) == 0.0 and float(engine.pool.data[b_pages].abs().sum()) > 0
    assert all(engine.block_manager.owner[p] is None for p in a_pages)
    run_until_done(engine, [b])
    assert b.status is SeqStatus.FINISHED and engine.take_violations() == []
    assert [s.request_id for s in engine.pop_finished()] == ["a", "b"] and not engine.has_request("a")


@pytest.mark.parametrize("scrub_policy", ["on_free", "on_alloc"])
def test_a_lost_pool_fails_everything_and_zeroes_the_whole_tensor(tiny_model, scrub_policy):
    engine = make_engine(tiny_model, scrub_policy=scrub_policy)
    seqs = [engine.add_request(r, list(range(10, 40)), greedy(8)) for r in ("a", "b")]
    engine.step()
    assert sorted(s.request_id for s in engine.reset_pool("pool lost")) == ["a", "b"]
    assert all(s.status is SeqStatus.FAILED and not s.block_table for s in seqs) and not engine.has_work
    assert float(engine.pool.data.abs().sum()) == 0.0 and set(engine.block_manager.owner) == {None}
    assert not engine.has_request("a") and engine.pages_of("a") is None


def test_a_duplicate_request_is_refused_and_the_original_is_untouched(tiny_model):
    prefill, decode = make_engine(tiny_model), make_engine(tiny_model)
    prompt = list(range(10, 40))
    p = prefill.add_request("r", prompt, greedy(4), prefill_only=True)
    run_until_done(prefill, [p])
    blob, _ = prefill.export_kv(p)
    with pytest.raises(DuplicateRequest):
        prefill.add_request("r", prompt, greedy(4))
    d = decode.add_prefilled("r", prompt, p.output_ids[0], blob, greedy(4))
    pages = decode.pages_of("r")
    with pytest.raises(DuplicateRequest):
        decode.add_prefilled("r", prompt, p.output_ids[0], blob, greedy(4))
    assert decode.pages_of("r") == pages and d.status is SeqStatus.RUNNING
    run_until_done(decode, [d])
    assert len(d.output_ids) == 4


def test_abort_takes_out_a_done_sequence_that_still_holds_pages(tiny_model):
    """A prefilled sequence awaiting its export (or a finish whose release failed midway) is done but holds
    pages: an abort frees and scrubs them and the engine keeps nothing of it."""
    engine = make_engine(tiny_model, prefix_cache=True)
    seq = engine.add_request("p", list(range(10, 50)), greedy(4), prefill_only=True, salt="s" * 64)
    run_until_done(engine, [seq])
    assert seq.status is SeqStatus.PREFILLED and seq.block_table
    assert engine.abort("p", "the worker gave up on it") is seq
    assert seq.status is SeqStatus.FAILED and not engine.has_request("p") and not seq.block_table
    assert engine.block_manager.num_free() == 64 and len(engine.prefix_cache) == 0  # freed, never cached
    assert float(engine.pool.data.abs().sum()) == 0.0


def test_engines_on_one_loaded_model_share_its_built_weights_until_the_last_is_gone(tiny_model, monkeypatch):
    """A worker's engine and its canary sandbox's: one packed copy of the weights, not one per engine."""
    import gc
    import weakref

    first, second = make_engine(tiny_model), make_engine(tiny_model, num_pages=8)
    assert second.model is first.model and second.pool is not first.pool
    monkeypatch.setenv("KVSERVE_CPU_GEMM", "blas")  # another packing is another model
    assert make_engine(tiny_model).model is not first.model
    monkeypatch.delenv("KVSERVE_CPU_GEMM")
    built = weakref.ref(first.model)
    del first, second
    gc.collect()
    assert built() is None  # freed with the last engine that held it

"""The chaos suite's judgements (bench/chaos.py, chaos_clients.py, chaos_stack.py): what counts as a foreign
sighting, done / failed / lost, a task that ran twice, a pool's stranded pages (on a real Redis ledger),
and which worker process a worker id names. The suite itself runs in tests/e2e/test_chaos.py."""
import datetime as dt

from bench.chaos import outcome, row_for, stream_matches_row
from bench.chaos_clients import Call, sightings
from bench.chaos_stack import parse_time, pool_report, worker_pid
from inference.events import Delta, Done, Error
from inference.ledger import RedisLedger

A, B, C = "K7Q-B2X-M9T", "Z1Z-Y2Y-X3X", "P4P-Q5Q-R6R"


def call(**fields) -> Call:
    return Call(tenant="chaos-a", sentinel=A, messages=[], max_tokens=8, submitted=100.0, **fields)


def stamp(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")


def row(status: str, finished: float | None, code: str = "", rid: str = "chatcmpl-1", prompt: str = "") -> dict:
    return {"id": rid, "status": status, "error_code": code, "finished_at": stamp(finished) if finished else None,
            "prompt_text": prompt}


def test_a_sentinel_planted_by_another_request_is_a_sighting_and_its_own_is_not():
    planted = {A, B, C}
    assert sightings([f"the code is {A}", ""], {A}, planted) == []
    assert sightings([f"the code is {A} and {B}", f"error: {C}"], {A}, planted) == sorted([B, C])


def test_a_code_of_the_same_shape_that_nobody_planted_is_not_a_sighting():
    assert sightings(["the code is Q1Q-W2W-E3E"], {A}, {A, B}) == []


def test_the_clients_final_event_decides_when_it_has_one():
    assert outcome(call(final="done", ended=105.0), None, deadline=200) == {"outcome": "done", "code": "", "at": 105.0}
    failed = outcome(call(final="error", code="worker_lost", ended=107.0), row("decoding", None), deadline=200)
    assert failed == {"outcome": "failed", "code": "worker_lost", "at": 107.0}


def test_without_a_final_event_the_row_decides_within_the_bound():
    late = outcome(call(), row("failed", 150.0, "client_disconnected"), deadline=200)
    assert late == {"outcome": "failed", "code": "client_disconnected", "at": 150.0}
    assert outcome(call(), row("done", 120.0), deadline=200)["outcome"] == "done"


def test_a_request_final_only_after_the_bound_or_never_is_lost():
    late = {"outcome": "lost", "code": "done 50 s after the bound", "at": None}
    assert outcome(call(), row("done", 250.0), deadline=200) == late
    assert outcome(call(), row("decoding", None), deadline=200)["outcome"] == "lost"
    assert outcome(call(), None, deadline=200) == {"outcome": "lost", "code": "no_row", "at": None}


def test_rows_are_found_by_id_or_else_by_the_sentinel_in_the_stored_prompt():
    rows = [row("done", 1.0, rid="chatcmpl-x", prompt=f'[{{"content": "code {B}"}}]'),
            row("done", 1.0, rid="chatcmpl-y", prompt=f'[{{"content": "code {A}"}}]')]
    assert row_for(call(rid="chatcmpl-x"), rows)["id"] == "chatcmpl-x"
    assert row_for(call(), rows)["id"] == "chatcmpl-y"
    assert row_for(call(rid="chatcmpl-z"), rows) is None


def test_worker_ids_name_their_process():
    assert worker_pid("decode-vm-18199-945f") == 18199
    assert worker_pid("prefill-a-long-host-name-7-ab12") == 7
    assert worker_pid("") is None and worker_pid("decode-vm") is None
    assert parse_time(stamp(1234.5)) == 1234.5 and parse_time(None) is None


def test_a_request_ran_once_when_its_stream_has_one_final_event_and_carries_what_its_row_stored():
    done = {"status": "done", "completion_text": "Once upon"}
    once = [Delta("Once"), Delta(" upon"), Done()]
    assert stream_matches_row(once, done)
    assert not stream_matches_row(once + [Error("engine_error", "")], done)  # two final events
    interleaved = [Delta("Once"), Delta("Once"), Delta(" upon"), Done()]
    assert not stream_matches_row(interleaved, done)
    assert stream_matches_row([Error("lease_lost", "")], {"status": "failed", "completion_text": None})
    assert not stream_matches_row(once, None)


def test_pool_report_counts_owned_and_dirty_pages_and_names_a_missing_pool(redis_client, ledger_prefix):
    ledger = RedisLedger.register(redis_client, "decode-x-1-ab", "decode", 8, 16, prefix=ledger_prefix, lease_ttl_s=4)
    assert pool_report(redis_client, ledger_prefix, "decode-x-1-ab") == {"owned": 0, "dirty": 0, "lost": 0,
                                                                        "cached": 0, "owners": {}, "integrity": "ok"}
    ledger.allocate("chatcmpl-a", 3)
    ledger.allocate("chatcmpl-b", 2)
    report = pool_report(redis_client, ledger_prefix, "decode-x-1-ab")
    assert report["owned"] == 5 and report["owners"] == {"chatcmpl-a": 3, "chatcmpl-b": 2}
    # a prefix-cached page nobody reads is kept by its cache entry, not stranded; a read one is held
    salt = "s" * 64
    c = ledger.allocate("chatcmpl-c", 2)
    ledger.cache("chatcmpl-c", salt, c.pages, c.epochs)
    report = pool_report(redis_client, ledger_prefix, "decode-x-1-ab")
    assert (report["owned"], report["cached"]) == (5, 2)
    assert ledger.hit("chatcmpl-d", salt, c.pages[:1], c.epochs[:1])
    report = pool_report(redis_client, ledger_prefix, "decode-x-1-ab")
    assert (report["owned"], report["cached"]) == (6, 1)
    ledger.unread("chatcmpl-d")
    ledger.evict(salt, c.pages, c.epochs)
    ledger.reap_expired(now_ms=int(redis_client.time()[0] * 1000) + 60_000)  # both leases run out
    report = pool_report(redis_client, ledger_prefix, "decode-x-1-ab")
    assert (report["owned"], report["dirty"], report["integrity"]) == (0, 5, "ok")
    redis_client.lrem(ledger.key("free"), 0, 7)  # a free page vanishes from the books
    report = pool_report(redis_client, ledger_prefix, "decode-x-1-ab")
    assert report["lost"] == 1 and "pages in no state: [7]" in report["integrity"]
    ledger.unregister()
    assert "not registered" in pool_report(redis_client, ledger_prefix, "decode-x-1-ab")["integrity"]

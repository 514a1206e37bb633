"""Output streams in real Redis: events in order from the start, and retention: a running request's stream
lives ttl_s past its latest event; its final event cuts that to the retention recorded at admission, or to
the short replay window when none was recorded."""
from inference.events import Delta, Done, Error
from inference.streams import OutputStream

DONE = Done("stop")


def test_deltas_keep_the_running_ttl_and_the_final_event_the_replay_window(redis_client, ledger_prefix):
    out = OutputStream(redis_client, prefix=ledger_prefix, ttl_s=3600, replay_s=60)
    out.publish_many([("r1", Delta("Hel")), ("r1", Delta("lo"))])
    assert 3500 < redis_client.ttl(out.key("r1")) <= 3600
    out.publish("r1", DONE)
    assert 0 < redis_client.ttl(out.key("r1")) <= 60  # nothing recorded: the short window
    assert list(out.read("r1", timeout_s=5)) == [Delta("Hel"), Delta("lo"), DONE]


def test_the_recorded_retention_applies_at_the_final_event_and_survives_a_second_one(redis_client, ledger_prefix):
    out = OutputStream(redis_client, prefix=ledger_prefix, ttl_s=3600, replay_s=60)
    out.retain("kept", 1800)
    out.retain("short", 20)
    out.publish_many([("kept", Delta("a")), ("kept", DONE), ("short", DONE)])
    assert 1700 < redis_client.ttl(out.key("kept")) <= 1800
    assert 0 < redis_client.ttl(out.key("short")) <= 20
    assert not out.publish("kept", Error("worker_lost", "late"))  # e.g. the reaper, after done: dropped
    assert 1700 < redis_client.ttl(out.key("kept")) <= 1800
    assert redis_client.ttl(out.retention_key("kept")) <= 1800  # the record goes with its stream
    assert list(out.read("kept", timeout_s=5)) == [Delta("a"), DONE]


def test_a_stream_takes_one_final_event_and_nothing_after_it(redis_client, ledger_prefix):
    """Whoever ends a request second (the web side after the worker, or the other way round) appends nothing,
    and a late delta neither shows nor brings back the running TTL."""
    out = OutputStream(redis_client, prefix=ledger_prefix, ttl_s=3600, replay_s=60)
    assert out.publish_many([("r", Delta("a")), ("r", Error("lease_lost", "first")),
                             ("r", Error("lease_lost", "again")), ("other", Delta("b"))]) == 3
    assert not out.publish("r", Error("worker_lost", "the reaper"))
    assert not out.publish("r", Delta("late"))
    assert out.publish("other", DONE)
    assert list(out.read("r", timeout_s=5)) == [Delta("a"), Error("lease_lost", "first")]
    assert redis_client.xlen(out.key("r")) == 2 and 0 < redis_client.ttl(out.key("r")) <= 60
    assert list(out.read("other", timeout_s=5)) == [Delta("b"), DONE]

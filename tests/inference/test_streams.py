"""Output streams in real Redis: events in order from the start, and retention: a running request's stream
lives ttl_s past its latest event; its final event cuts that to the retention recorded at admission, or to
the short replay window when none was recorded."""
from inference.streams import OutputStream

DONE = {"type": "done", "finish_reason": "stop", "usage": {}}


def test_deltas_keep_the_running_ttl_and_the_final_event_the_replay_window(redis_client, ledger_prefix):
    out = OutputStream(redis_client, prefix=ledger_prefix, ttl_s=3600, replay_s=60)
    out.publish_many([("r1", {"type": "delta", "text": "Hel"}), ("r1", {"type": "delta", "text": "lo"})])
    assert 3500 < redis_client.ttl(out.key("r1")) <= 3600
    out.publish("r1", DONE)
    assert 0 < redis_client.ttl(out.key("r1")) <= 60  # nothing recorded: the short window
    assert [e["type"] for e in out.read("r1", timeout_s=5)] == ["delta", "delta", "done"]


def test_the_recorded_retention_applies_at_the_final_event_and_survives_a_second_one(redis_client, ledger_prefix):
    out = OutputStream(redis_client, prefix=ledger_prefix, ttl_s=3600, replay_s=60)
    out.retain("kept", 1800)
    out.retain("short", 20)
    out.publish_many([("kept", {"type": "delta", "text": "a"}), ("kept", DONE), ("short", DONE)])
    assert 1700 < redis_client.ttl(out.key("kept")) <= 1800
    assert 0 < redis_client.ttl(out.key("short")) <= 20
    out.publish("kept", {"type": "error", "code": "worker_lost", "message": "late"})  # e.g. the reaper, after done
    assert 1700 < redis_client.ttl(out.key("kept")) <= 1800
    assert redis_client.ttl(out.retention_key("kept")) <= 1800  # the record goes with its stream
    assert [e["type"] for e in out.read("kept", timeout_s=5)] == ["delta", "done"]

"""The worker's outbox against real Redis: events reach their streams in order and once, a request's callback runs
after its events were attempted, and handing events over never waits for Redis (paused, stopped or with its
connection killed mid-publish)."""
import threading

import redis
import pytest

from inference.events import Delta, Done
from inference.outbox import Outbox
from inference.streams import OutputStream
from tests.e2e.stack import OwnRedis


@pytest.fixture
def own_redis(tmp_path):
    server = OwnRedis(tmp_path).start()
    yield server
    server.stop()


def stream(out: OutputStream, rid: str) -> list:
    return list(out.read(rid, timeout_s=5))


def test_events_reach_their_streams_in_order_and_the_callback_after_them(redis_client, ledger_prefix):
    out = OutputStream(redis_client, prefix=ledger_prefix)
    box = Outbox(out)
    seen = {}
    try:
        for i in range(50):
            box.put([("a", Delta(str(i))), ("b", Delta(str(i)))])
        box.put([("a", Done("stop"))], then=lambda: seen.update(a=out.redis.xlen(out.key("a"))))
        box.put([("b", Done("length"))])
        assert box.drain(10) and box.pending() == 0
    finally:
        box.stop()
    assert seen == {"a": 51}  # every event of "a" was in its stream when its callback ran
    assert stream(out, "a") == [Delta(str(i)) for i in range(50)] + [Done("stop")]
    assert stream(out, "b") == [Delta(str(i)) for i in range(50)] + [Done("length")]


def test_handing_over_never_waits_for_redis_and_nothing_is_lost_or_doubled(own_redis):
    """Writes paused, then the outbox's connection killed while its script waits: put returns at once, the
    callback runs after the failed attempt, and once Redis answers every event is in its stream exactly once."""
    name = "kvstest-outbox"
    out = OutputStream(redis.Redis.from_url(own_redis.url, client_name=name), prefix="kvstest-ob")
    admin = redis.Redis.from_url(own_redis.url)
    box = Outbox(out)
    ended = threading.Event()
    try:
        box.put([("r", Delta("a"))])
        assert box.drain(10)
        admin.execute_command("CLIENT", "PAUSE", 3000, "WRITE")
        try:
            for text in "bcd":
                box.put([("r", Delta(text))])  # returns while the script waits on the paused server
            box.put([("r", Done("stop"))], then=ended.set)
            assert box.pending() == 4
            for c in admin.client_list():
                if c.get("name") == name and "evalsha" in c.get("cmd", ""):
                    admin.client_kill_filter(_id=c["id"])
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
        assert ended.wait(20)
        assert box.drain(20)
    finally:
        box.stop()
    assert stream(OutputStream(admin, prefix="kvstest-ob"), "r") == [Delta(t) for t in "abcd"] + [Done("stop")]


def test_with_redis_gone_the_callbacks_still_run_and_the_events_wait(own_redis):
    out = OutputStream(redis.Redis.from_url(own_redis.url, socket_timeout=1), prefix="kvstest-ob")
    box = Outbox(out)
    ended = threading.Event()
    try:
        own_redis.stop()
        box.put([("r", Delta("a")), ("r", Done("stop"))], then=ended.set)
        assert ended.wait(60), "a request's future must end even while Redis is down"
        assert box.pending() == 2  # kept for when it is back
        own_redis.start()
        assert box.drain(60)
    finally:
        box.stop()
    assert stream(OutputStream(redis.Redis.from_url(own_redis.url), prefix="kvstest-ob"), "r") == [Delta("a"), Done("stop")]


def test_stop_runs_the_callbacks_still_waiting(own_redis):
    out = OutputStream(redis.Redis.from_url(own_redis.url, socket_timeout=1), prefix="kvstest-ob")
    box = Outbox(out)
    own_redis.stop()
    ran = []
    box.put([("r", Done("stop"))], then=lambda: ran.append(1))
    box.stop(timeout_s=0.5)
    assert ran == [1]


def test_past_its_bound_the_outbox_drops_the_oldest_events_while_redis_is_gone(own_redis):
    """A worker cut off from Redis keeps at most max_events (its memory is bounded); what it keeps is the newest, as a
    batch of its own once Redis is back."""
    out = OutputStream(redis.Redis.from_url(own_redis.url, socket_timeout=1), prefix="kvstest-ob")
    box = Outbox(out, max_events=3)
    ended = threading.Event()
    try:
        own_redis.stop()
        box.put([("r", Delta(t)) for t in "abcd"] + [("r", Done("stop"))], then=ended.set)
        assert ended.wait(60)
        assert box.pending() == 3
        own_redis.start()
        assert box.drain(60)
    finally:
        box.stop()
    assert stream(OutputStream(redis.Redis.from_url(own_redis.url), prefix="kvstest-ob"), "r") == \
        [Delta("c"), Delta("d"), Done("stop")]

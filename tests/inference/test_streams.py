"""Output streams in real Redis: events in order from the start, and retention: a running request's stream
lives ttl_s past its latest event; its final event cuts that to the retention recorded at admission, or to
the short replay window when none was recorded. The web's async reader stops when its task is cancelled (the
client gone), and a Redis that stops answering ends its read in bounded time."""
import asyncio
import random
import time

import pytest
import redis

import inference.streams
from inference.events import Delta, Done, Error
from inference.streams import AsyncOutputStream, OutputStream, async_client
from tests.conftest import TEST_REDIS_URL
from tests.e2e.stack import OwnRedis

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


# ---- the web's async reader --------------------------------------------------------------------------------
def test_a_cancelled_async_reader_always_stops_while_events_flow(redis_client, ledger_prefix):
    """Django cancels a streamed response's task when its client disconnects. With redis-py's socket_timeout,
    each command's send ran through asyncio.wait_for, which on Python 3.11 swallowed a cancel that came while the
    send completed: ~3 of 4 cancels here were lost (the reader read on) and the web ran a disconnected client's
    request to its end. Every one of 40 cancels, at random moments of a busy stream, must stop the reader."""
    writer = OutputStream(redis_client, prefix=ledger_prefix)
    rng = random.Random(0)

    async def trial(i: int) -> str:
        rid = f"cancel-{i}"
        writer.publish_many([(rid, Delta("x"))] * 50)
        client = async_client(TEST_REDIS_URL)
        read = []

        async def reader():
            async for event in AsyncOutputStream(client, ledger_prefix).read(rid, timeout_s=30):
                read.append(event)

        async def feeder():
            for _ in range(400):
                await asyncio.to_thread(writer.publish, rid, Delta("y"))

        task, feed = asyncio.create_task(reader()), asyncio.create_task(feeder())
        try:
            while not read:
                await asyncio.sleep(0.001)
            await asyncio.sleep(rng.random() * 0.02)
            task.cancel()
            try:
                await asyncio.wait_for(asyncio.shield(task), 2.0)
            except asyncio.CancelledError:
                return "stopped"
            except TimeoutError:
                return "read on"
            return "ended"
        finally:
            task.cancel()
            feed.cancel()
            await asyncio.gather(task, feed, return_exceptions=True)
            await client.aclose()

    async def trials() -> list[str]:
        return [await trial(i) for i in range(40)]

    outcomes = asyncio.run(trials())
    assert outcomes == ["stopped"] * 40, {o: outcomes.count(o) for o in set(outcomes)}


@pytest.fixture
def own_redis(tmp_path):
    server = OwnRedis(tmp_path).start()
    yield server
    server.stop()


def test_an_async_read_that_redis_leaves_unanswered_ends_with_a_redis_timeout(own_redis, monkeypatch):
    """No socket timeout on the async client: the read bounds itself, REPLY_MARGIN_S past its XREAD BLOCK, and
    says it as redis.TimeoutError (the web's `backend_unavailable`), not as the request's own TimeoutError."""
    monkeypatch.setattr(inference.streams, "REPLY_MARGIN_S", 0.5)
    OutputStream(redis.Redis.from_url(own_redis.url)).publish("r", Delta("a"))
    admin = redis.Redis.from_url(own_redis.url)

    async def read() -> tuple[list, BaseException | None, float]:
        client = async_client(own_redis.url)
        events, t0 = [], time.monotonic()
        try:
            async for event in AsyncOutputStream(client).read("r", timeout_s=60):
                events.append(event)
                admin.execute_command("CLIENT", "PAUSE", 5000, "ALL")  # every later command waits 5 s
        except Exception as exc:
            return events, exc, time.monotonic() - t0
        finally:
            await client.aclose()
        return events, None, time.monotonic() - t0

    events, exc, took = asyncio.run(read())
    assert events == [Delta("a")]
    assert isinstance(exc, redis.TimeoutError) and not isinstance(exc, TimeoutError), repr(exc)
    assert took < 4.0, took  # its block (1 s) and the margin (0.5 s), not the pause (5 s) or timeout_s (60 s)

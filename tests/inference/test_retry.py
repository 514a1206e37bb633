"""A dropped Redis connection against real Redis: a command that is safe to repeat succeeds across it (the
client's own connection killed by CLIENT KILL ID, looked up by its client name), one that is not fails closed;
and each ledger script's REPEAT class holds when its first run took effect and only the reply was lost."""
import threading
import time
import uuid

import pytest
import redis

from inference.allocator import LedgerError

from inference.events import Delta, Done
from inference.ledger import REPEAT, RedisLedger
from inference.ledger.scripts import SCRIPTS
from inference.streams import OutputStream
from tests.conftest import TEST_REDIS_URL
from tests.e2e.stack import OwnRedis


def connection_of(admin: redis.Redis, name: str, until_cmd: str | None = None, timeout_s: float = 5) -> dict:
    """The one connection named `name` (once its current command is `until_cmd`, and blocked when it is)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        mine = [c for c in admin.client_list() if c["name"] == name]
        if mine and (until_cmd is None or (mine[0]["cmd"] == until_cmd and "b" in mine[0]["flags"])):
            return mine[0]
        time.sleep(0.01)
    raise AssertionError(f"no connection named {name} blocked in {until_cmd}")


def kill(admin: redis.Redis, name: str, until_cmd: str) -> None:
    admin.execute_command("CLIENT", "KILL", "ID", connection_of(admin, name, until_cmd)["id"])


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as exc:
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


# ---- across a killed connection ---------------------------------------------------------------------------
def test_a_stream_read_goes_on_from_the_last_event_when_its_connection_is_killed(redis_client, ledger_prefix):
    name = f"kvstest-reader-{uuid.uuid4().hex[:8]}"
    reader = OutputStream(redis.Redis.from_url(TEST_REDIS_URL, client_name=name), prefix=ledger_prefix)
    writer = OutputStream(redis_client, prefix=ledger_prefix)
    writer.publish("r", Delta("a"))
    t, out = in_thread(lambda: list(reader.read("r", timeout_s=10)))
    kill(redis_client, name, "xread")  # blocked waiting for the second event
    writer.publish_many([("r", Delta("b")), ("r", Done())])
    t.join(10)
    assert out == {"value": [Delta("a"), Delta("b"), Done()]}


def test_an_async_stream_read_goes_on_across_killed_connections_with_its_keep_alives(redis_client, ledger_prefix):
    """The web's SSE reader (redis.asyncio): killed twice while it waits, it still yields every event once,
    and its keep-alives keep coming while nothing is published."""
    import asyncio

    import redis.asyncio as aioredis

    from inference.streams import AsyncOutputStream

    name = f"kvstest-areader-{uuid.uuid4().hex[:8]}"
    writer = OutputStream(redis_client, prefix=ledger_prefix)
    writer.publish("r", Delta("a"))

    def kill_twice_then_finish():
        kill(redis_client, name, "xread")
        time.sleep(0.3)
        kill(redis_client, name, "xread")
        writer.publish_many([("r", Delta("b")), ("r", Done())])

    async def read():
        client = aioredis.Redis.from_url(TEST_REDIS_URL, client_name=name)
        try:
            return [(e.type, getattr(e, "text", None)) if e else "keep-alive" async for e in AsyncOutputStream(
                client, ledger_prefix).read("r", timeout_s=10, idle_s=0.2)]
        finally:
            await client.aclose()

    t, _ = in_thread(kill_twice_then_finish)
    events = asyncio.run(read())
    t.join(10)
    assert [e for e in events if e != "keep-alive"] == [("delta", "a"), ("delta", "b"), ("done", None)]
    assert "keep-alive" in events  # sent while it waited


@pytest.fixture
def own_redis(tmp_path):
    server = OwnRedis(tmp_path).start()
    yield server
    server.stop()


def paused_and_killed(server: OwnRedis, call, name: str, cmd: str = "evalsha") -> dict:
    """Runs call() while writes are paused, kills its connection while its write (`cmd`) waits, then resumes."""
    admin = redis.Redis.from_url(server.url)
    admin.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
    try:
        t, out = in_thread(call)
        kill(admin, name, cmd)
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    t.join(10)
    return out


def test_renewals_and_grants_succeed_across_a_killed_connection_and_a_release_fails_closed(own_redis):
    name = "kvstest-ledger"
    client = redis.Redis.from_url(own_redis.url, client_name=name)
    ledger = RedisLedger.register(client, "p0", "decode", num_pages=8, page_size=16, lease_ttl_s=30)
    grant = ledger.allocate("req-a", 2)

    out = paused_and_killed(own_redis, lambda: ledger.renew_leases(["req-a", "req-gone"]), name)
    assert out == {"value": ["req-gone"]}  # repeated after reconnecting; renewed req-a

    out = paused_and_killed(own_redis, lambda: ledger.allocate("req-b", 2), name)
    assert ledger.pages_of("req-b") == dict(zip(out["value"].pages, out["value"].epochs))  # granted once
    before = ledger.snapshot()

    out = paused_and_killed(own_redis, lambda: ledger.release("req-a"), name)
    assert isinstance(out.get("error"), redis.ConnectionError)  # its reply names what to scrub: never repeated
    assert ledger.snapshot() == before and ledger.num_free() == 4  # the killed release never ran
    assert ledger.pages_of("req-a") == dict(zip(grant.pages, grant.epochs))
    ledger.check_integrity()


# ---- a lost reply: the script ran, its answer did not come back --------------------------------------------
class LosesReplies(redis.Redis):
    """A real client whose next reply to one script is dropped after the script ran, with its connection."""

    lose: set[str] = set()
    drop: set[str] = set()  # dropped before the script runs
    lost = 0

    def evalsha(self, sha, numkeys, *args):
        if sha in self.drop:
            self.drop.discard(sha)
            self.lost += 1
            self.connection_pool.disconnect()
            raise redis.ConnectionError("Connection closed by server (injected before the script ran)")
        reply = super().evalsha(sha, numkeys, *args)
        if sha in self.lose:
            self.lose.discard(sha)
            self.lost += 1
            self.connection_pool.disconnect()
            raise redis.ConnectionError("Connection closed by server (injected after the script ran)")
        return reply


@pytest.fixture
def lossy(ledger_prefix):
    client = LosesReplies.from_url(TEST_REDIS_URL)
    client.lose, client.drop, client.lost = set(), set(), 0
    ledger = RedisLedger.register(client, "p0", "decode", num_pages=8, page_size=16, prefix=ledger_prefix)
    ledger.lose_next = lambda script: client.lose.add(ledger._lua[script].sha)
    ledger.drop_next = lambda script: client.drop.add(ledger._lua[script].sha)
    yield ledger
    assert client.lost  # the injection fired


def test_every_ledger_script_is_classed():
    assert REPEAT.keys() == SCRIPTS.keys()
    assert {r.kind for r in REPEAT.values()} <= {"same", "refused", "never"}
    assert REPEAT["release"].kind == "never" and REPEAT["claim_dirty"].kind == "same"


def test_a_dirty_claim_whose_reply_was_lost_is_answered_by_its_repeat(lossy):
    g = lossy.allocate("req", 2)
    lossy.reap_expired(now_ms=int(time.time() * 1000) + 10**9)
    lossy.lose_next("claim_dirty")
    assert lossy.take_dirty("me") == sorted(g.pages)  # the first run claimed them; the repeat names them
    assert lossy.take_dirty("me", in_hand=g.pages) == []
    lossy.mark_clean(g.pages, "me")
    assert lossy.num_free() == 8
    lossy.check_integrity()


def test_a_free_whose_reply_was_lost_is_done_once_and_answers_as_it_would_have(lossy):
    g = lossy.allocate("req", 3)
    lossy.lose_next("free")
    assert lossy.free("req", g.pages[:2], g.epochs[:2]) == 1  # the repeat was refused: read back, one left
    assert lossy.pages_of("req") == {g.pages[2]: g.epochs[2]}
    assert lossy.num_free() == 7
    with pytest.raises(LedgerError, match="cannot free"):  # a caller's own second free is still refused
        lossy.free("req", g.pages[:2], g.epochs[:2])
    lossy.check_integrity()


def test_a_refused_repeat_whose_effect_is_not_in_place_stays_refused(lossy):
    g = lossy.allocate("req", 2)
    lossy.reap_expired(now_ms=int(time.time() * 1000) + 10**9)  # the lease ran out: the pages went dirty
    lossy.drop_next("free")  # the first run never happened; the repeat is refused for a reason of its own
    with pytest.raises(LedgerError, match="cannot free page .* it is dirty"):
        lossy.free("req", g.pages, g.epochs)
    assert lossy.num_free() == 6
    lossy.check_integrity()


def test_mark_clean_cache_and_evict_repeated_after_a_lost_reply(lossy):
    g = lossy.allocate("req", 2)
    lossy.reap_expired(now_ms=int(time.time() * 1000) + 10**9)
    dirty = lossy.take_dirty("me")
    assert sorted(dirty) == sorted(g.pages)
    lossy.lose_next("mark_clean")
    lossy.mark_clean(dirty, "me")
    assert lossy.num_free() == 8

    g = lossy.allocate("req2", 2)
    lossy.lose_next("cache")
    assert lossy.cache("req2", "salt", g.pages, g.epochs) == "cache~salt"
    assert lossy.pages_of("cache~salt") == dict(zip(g.pages, g.epochs))
    lossy.lose_next("hit")
    assert lossy.hit("reader", "salt", g.pages, g.epochs)
    assert lossy.reads_of("reader") == sorted(g.pages)
    lossy.lose_next("unread")
    lossy.unread("reader")
    assert lossy.reads_of("reader") == []
    lossy.lose_next("evict")
    assert lossy.evict("salt", g.pages, g.epochs) == 0
    assert lossy.num_free() == 8
    lossy.check_integrity()


def test_a_beat_whose_reply_was_lost_is_repeated_and_renews(lossy):
    lossy.allocate("req", 1)
    lossy.lose_next("beat")
    assert lossy.beat(["req", "gone"]).missing == ("gone",)
    lossy.check_integrity()


def test_a_grant_whose_reply_was_lost_answers_its_first_run_and_grants_once(lossy):
    lossy.lose_next("grant")
    grant = lossy.allocate("req", 2)
    assert lossy.pages_of("req") == dict(zip(grant.pages, grant.epochs))  # not 4 pages: never granted twice
    assert lossy.num_free() == 6
    lossy.allocate("other", 1)
    lossy.lose_next("grant")
    (a, b) = lossy.extend_many([("req", 1), ("other", 2)])
    assert len(lossy.pages_of("req")) == 3 and len(lossy.pages_of("other")) == 3 and lossy.num_free() == 2
    assert set(a.pages) | set(b.pages) <= set(lossy.pages_of("req")) | set(lossy.pages_of("other"))
    assert lossy.max_epoch == max(b.epochs)
    lossy.check_integrity()


def test_a_release_whose_reply_was_lost_is_not_repeated(lossy):
    lossy.allocate("req", 2)
    lossy.lose_next("release")
    with pytest.raises(redis.ConnectionError):
        lossy.release("req")
    assert lossy.num_free() == 8  # it ran once; its reply (the pages to scrub) is the caller's to miss


def test_a_publish_whose_reply_was_lost_appends_nothing_twice(ledger_prefix):
    client = LosesReplies.from_url(TEST_REDIS_URL)
    client.lose, client.drop, client.lost = set(), set(), 0
    out = OutputStream(client, prefix=ledger_prefix)
    client.lose.add(out._publish.sha)
    out.publish_many([("r", Delta("a")), ("r", Delta("b"))], batch="b1")
    assert client.lost == 1
    # the worker's outbox, not answered yet, is the same batch with one more event at its tail
    out.publish_many([("r", Delta("a")), ("r", Delta("b")), ("r", Done())], batch="b1")
    assert list(out.read("r", timeout_s=5)) == [Delta("a"), Delta("b"), Done()]


def test_a_probe_record_is_written_across_a_killed_connection(own_redis):
    """A worker's probe record (what the canary waits for) is a keyed SET: repeated when its connection drops. In a
    soak a record lost to CLIENT KILL kept the canary waiting out its whole deadline."""
    from inference.probes import ProbeRecords

    name = "kvstest-probes"
    records = ProbeRecords(redis.Redis.from_url(own_redis.url, client_name=name), "kvstest")
    out = paused_and_killed(own_redis, lambda: records.put("p1", {"ok": True}), name, cmd="set")
    assert "error" not in out, out
    assert records.get_many(["p1"]) == {"p1": {"ok": True}}

"""RedisLedger against a real Redis: exact pages, epochs and free-list order; guards shown to fire."""
import multiprocessing
import os
import random
import re
import time
from collections import defaultdict, deque
from uuid import uuid4

import pytest
import redis

from inference.allocator import Grant, IntegrityError, LedgerError, PoolLost
from inference.ledger import (
    GENERATION_SPAN,
    Beat,
    ReclaimEvent,
    RedisLedger,
    check_eviction_policy,
    judge_eviction_policy,
    ledger_from_url,
    pool_counts,
)

URL = os.environ.get("KVSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture
def pool(redis_client, ledger_prefix):
    return RedisLedger.register(redis_client, "p0", "decode", num_pages=8, page_size=16, prefix=ledger_prefix)


def free_list(ledger):
    return [int(p) for p in ledger.redis.lrange(ledger.key("free"), 0, -1)]


def dump(client, prefix):
    """Every key under prefix with its full contents, to show an operation wrote nothing."""
    out = {}
    for key in client.scan_iter(match=f"{prefix}*"):
        kind = client.type(key).decode()
        out[key] = {
            "string": lambda: client.get(key),
            "list": lambda: client.lrange(key, 0, -1),
            "set": lambda: sorted(client.smembers(key)),
            "hash": lambda: client.hgetall(key),
            "zset": lambda: client.zrange(key, 0, -1, withscores=True),
        }[kind]()
    return out


def server_ms(client):
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def test_register_lays_out_keys(pool, redis_client, ledger_prefix):
    base = f"{ledger_prefix}:pool:p0"
    assert set(redis_client.scan_iter(match=f"{ledger_prefix}*")) == {
        f"{ledger_prefix}:pools".encode(), f"{base}:meta".encode(), f"{base}:free".encode()
    }
    meta = redis_client.hgetall(f"{base}:meta")
    assert (meta[b"role"], meta[b"num_pages"], meta[b"page_size"]) == (b"decode", b"8", b"16")
    assert abs(int(meta[b"created"]) - server_ms(redis_client)) < 5000
    assert free_list(pool) == list(range(8))
    assert redis_client.smembers(f"{ledger_prefix}:pools") == {b"p0"}
    assert (pool.pool_id, pool.role, pool.num_pages, pool.page_size) == ("p0", "decode", 8, 16)

    pool.allocate("a", 2)
    assert {k.decode().removeprefix(base + ":") for k in redis_client.scan_iter(match=f"{base}:*")} == {
        "meta", "free", "page_owner", "page_epoch", "owners", "leases", "epoch", "owner:a", "last_grant"
    }


def test_allocate_is_fifo_with_monotonic_epochs(pool):
    assert pool.allocate("a", 3) == Grant((0, 1, 2), (1, 2, 3))
    assert pool.num_free() == 5
    pool.free("a", [1], [2])
    assert free_list(pool) == [3, 4, 5, 6, 7, 1]
    assert pool.allocate("b", 6) == Grant((3, 4, 5, 6, 7, 1), (4, 5, 6, 7, 8, 9))
    assert pool.num_free() == 0
    assert pool.pages_of("a") == {0: 1, 2: 3}
    assert pool.pages_of("b") == {1: 9, 3: 4, 4: 5, 5: 6, 6: 7, 7: 8}
    assert pool.owner_of(1) == ("b", 9)
    assert pool.allocate("c", 0) == Grant((), ())
    pool.check_integrity()


def test_allocate_that_does_not_fit_returns_none_and_writes_nothing(pool, redis_client, ledger_prefix):
    pool.allocate("a", 5)
    before = dump(redis_client, ledger_prefix)
    assert pool.allocate("b", 4) is None
    assert pool.extend("a", 4) is None
    assert dump(redis_client, ledger_prefix) == before
    assert pool.allocate("b", 3) == Grant((5, 6, 7), (6, 7, 8))


def test_contract_violations_raise(pool, redis_client, ledger_prefix):
    before = dump(redis_client, ledger_prefix)
    with pytest.raises(LedgerError, match="cannot allocate -1 pages"):
        pool.allocate("a", -1)
    with pytest.raises(LedgerError, match="hold no pages to extend"):
        pool.extend("a", 1)
    with pytest.raises(LedgerError, match="non-empty string"):
        pool.allocate("", 1)
    assert dump(redis_client, ledger_prefix) == before
    with pytest.raises(ValueError, match="role must be one of"):
        RedisLedger.register(redis_client, "p1", "training", 8, 16, prefix=ledger_prefix)
    with pytest.raises(ValueError, match="without ':'"):
        RedisLedger.register(redis_client, "p:1", "decode", 8, 16, prefix=ledger_prefix)
    with pytest.raises(ValueError, match="must be positive"):
        RedisLedger.register(redis_client, "p1", "decode", 0, 16, prefix=ledger_prefix)


def test_extend_appends_to_an_owner(pool):
    pool.allocate("a", 2)
    assert pool.extend("a", 3) == Grant((2, 3, 4), (3, 4, 5))
    assert pool.pages_of("a") == {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}


def test_free_by_non_owner_or_stale_epoch_is_refused_and_changes_nothing(pool, redis_client, ledger_prefix):
    pool.allocate("a", 8)
    pool.free("a", [0], [1])
    assert pool.allocate("a", 1) == Grant((0,), (9,))
    before = dump(redis_client, ledger_prefix)
    with pytest.raises(LedgerError, match="a cannot free page 0 at epoch 1: it is held by a at epoch 9"):
        pool.free("a", [0], [1])
    with pytest.raises(LedgerError, match="b cannot free page 3 at epoch 4: it is held by a at epoch 4"):
        pool.free("b", [3], [4])
    # all or nothing: two good pages, then a bad one
    with pytest.raises(LedgerError, match="page 2 at epoch 99"):
        pool.free("a", [1, 3, 2], [2, 4, 99])
    with pytest.raises(LedgerError, match="listed twice"):
        pool.free("a", [1, 1], [2, 2])
    with pytest.raises(LedgerError, match="2 pages but 1 epochs"):
        pool.free("a", [1, 3], [2])
    assert dump(redis_client, ledger_prefix) == before
    pool.free("a", [3, 1], [4, 2])
    with pytest.raises(LedgerError, match="page 3 at epoch 4: it is free"):
        pool.free("a", [3], [4])
    with pytest.raises(LedgerError, match=r"page 42 at epoch 1: it is not a page of this pool \(0..7\)"):
        pool.free("a", [42], [1])
    assert free_list(pool) == [3, 1]


def test_free_of_last_page_drops_the_lease_and_release_frees_sorted(pool, redis_client):
    a = pool.allocate("a", 2)
    pool.allocate("b", 3)
    pool.free("b", [3], [4])
    assert redis_client.zscore(pool.key("leases"), "a") is not None
    pool.free("a", a.pages, a.epochs)
    assert redis_client.zscore(pool.key("leases"), "a") is None
    assert not redis_client.sismember(pool.key("owners"), "a")
    assert pool.pages_of("a") == {}
    assert free_list(pool) == [5, 6, 7, 3, 0, 1]

    pool.extend("b", 3)  # pages 5, 6, 7
    assert pool.release("b") == [2, 4, 5, 6, 7]
    assert free_list(pool) == [3, 0, 1, 2, 4, 5, 6, 7]
    assert redis_client.zscore(pool.key("leases"), "b") is None
    assert pool.release("b") == []
    assert pool.snapshot() == {p: "free" for p in range(8)}
    pool.check_integrity()


def test_reregister_resets_the_pool_but_epochs_stay_monotonic(pool, redis_client, ledger_prefix):
    pool.allocate("a", 3)
    pool.allocate("b", 1)
    again = RedisLedger.register(redis_client, "p0", "decode", num_pages=4, page_size=16, prefix=ledger_prefix)
    assert again.num_pages == 4
    assert free_list(again) == [0, 1, 2, 3]
    assert again.pages_of("a") == {} and again.pages_of("b") == {}
    assert redis_client.zcard(again.key("leases")) == 0
    assert again.allocate("c", 2) == Grant((0, 1), (5, 6))
    again.check_integrity()


def test_leases_use_server_time_and_renew_only_live_owners(pool, redis_client):
    pool.allocate("a", 1)
    assert abs(redis_client.zscore(pool.key("leases"), "a") - (server_ms(redis_client) + 30_000)) < 2000
    assert pool.renew_leases(["a", "ghost"], ttl_s=5) == ["ghost"]
    assert abs(redis_client.zscore(pool.key("leases"), "a") - (server_ms(redis_client) + 5_000)) < 2000
    assert redis_client.zscore(pool.key("leases"), "ghost") is None
    assert pool.renew_leases([]) == []


def test_expired_lease_moves_pages_to_dirty_until_scrubbed(pool, redis_client):
    pool.allocate("a", 3)
    pool.allocate("b", 1)
    pool.renew_leases(["a"], ttl_s=0.05)
    expiry = int(redis_client.zscore(pool.key("leases"), "a"))
    assert pool.reap_expired(now_ms=expiry - 1) == []  # judged on the given clock: not yet
    assert pool.reap_expired(now_ms=expiry) == [ReclaimEvent("p0", "a", (0, 1, 2), (1, 2, 3), expiry)]
    assert pool.reap_expired(now_ms=expiry) == []
    assert pool.num_free() == 4  # dirty pages are not free
    assert pool.take_dirty("w") == [0, 1, 2]
    assert pool.take_dirty("w", in_hand=[0, 1, 2]) == []  # claimed once: a second beat gets nothing to scrub twice
    assert pool.take_dirty("other") == []  # nor does another claimer
    assert pool.take_dirty("w", in_hand=[1]) == [0, 2]  # a claim whose reply was lost is answered again
    assert pool.owner_of(0) is None and pool.pages_of("a") == {}
    assert [pool.snapshot()[p] for p in range(5)] == ["dirty", "dirty", "dirty", {"owner": "b", "epoch": 4}, "free"]
    assert pool.renew_leases(["a", "b"]) == ["a"]
    assert pool.allocate("c", 5) is None
    with pytest.raises(LedgerError, match="a cannot free page 1 at epoch 2: it is dirty, waiting to be scrubbed by w"):
        pool.free("a", [1], [2])
    pool.check_integrity()

    pool.mark_clean([2, 0], "w")
    assert free_list(pool) == [4, 5, 6, 7, 2, 0]
    with pytest.raises(LedgerError, match="cannot mark page 0 clean: it is free"):
        pool.mark_clean([0], "w")
    with pytest.raises(LedgerError, match="cannot mark page 3 clean: it is held by b at epoch 4"):
        pool.mark_clean([1, 3], "w")
    with pytest.raises(LedgerError, match="x cannot mark page 1 clean: it is dirty, waiting to be scrubbed by w"):
        pool.mark_clean([1], "x")  # only the claimer, who scrubbed it
    assert pool.snapshot()[1] == "dirty"  # all or nothing
    pool.mark_clean([1], "w")
    assert pool.take_dirty("w") == [] and pool.num_free() == 7
    pool.check_integrity()


def test_reap_with_a_far_future_clock_takes_every_owner(pool):
    pool.allocate("a", 2)
    pool.allocate("b", 1)
    events = pool.reap_expired(now_ms=10**15)
    assert sorted((e.owner, e.pages, e.epochs) for e in events) == [("a", (0, 1), (1, 2)), ("b", (2,), (3,))]
    assert pool.take_dirty("w") == [0, 1, 2]
    pool.check_integrity()


def test_beat_renews_its_owners_before_reaping_so_a_clock_step_takes_only_the_others(pool, redis_client):
    pool.allocate("a", 2)
    pool.allocate("b", 1)
    pool.allocate("c", 1)
    step = server_ms(redis_client) + 10**9  # Redis' clock stepped forward far past every lease
    beat = pool.beat(["a", "b", "gone"], now_ms=step)
    assert beat.missing == ("gone",)
    assert [(e.owner, e.pages) for e in beat.reclaimed] == [("c", (3,))]  # not renewed: reaped
    assert pool.pages_of("a") == {0: 1, 1: 2} and pool.pages_of("b") == {2: 3}
    assert int(redis_client.zscore(pool.key("leases"), "a")) == step + 30_000
    assert pool.beat(["a", "b"], now_ms=step + 29_000) == Beat((), ())
    pool.check_integrity()


def test_holds_is_true_only_for_the_owners_pages_at_their_epochs_under_a_lease(pool):
    grant = pool.allocate("a", 2)
    assert pool.holds("a", grant.pages, grant.epochs)
    assert not pool.holds("a", grant.pages, (grant.epochs[0], grant.epochs[1] + 1))
    assert not pool.holds("b", grant.pages, grant.epochs)
    pool.reap_expired(now_ms=10**15)
    assert not pool.holds("a", grant.pages, grant.epochs)


def test_a_lost_pool_raises_pool_lost_and_reset_starts_a_generation_above_every_seen_epoch(pool, redis_client,
                                                                                              ledger_prefix):
    pool.allocate("a", 3)
    for key in redis_client.scan_iter(match=f"{ledger_prefix}*"):
        redis_client.delete(key)  # Redis restarted empty: the epoch counter is gone too
    for call in (lambda: pool.allocate("b", 1), lambda: pool.beat(["a"]), lambda: pool.take_dirty("w"),
                 lambda: pool.free("a", [0], [1]), lambda: pool.mark_clean([0], "w")):
        with pytest.raises(PoolLost, match="pool p0: not registered"):
            call()
    pool.reset()
    assert pool.generation == 1 and pool.allocate("b", 1) == Grant((0,), (GENERATION_SPAN + 1,))
    pool.check_integrity()
    assert RedisLedger(redis_client, "p0", prefix=ledger_prefix).generation == 1


def test_a_counter_behind_what_this_client_was_granted_is_a_lost_pool(pool, redis_client):
    pool.allocate("a", 3)
    redis_client.set(pool.key("epoch"), 1)  # a failover to a replica that missed the last grants
    with pytest.raises(PoolLost, match="epoch counter 1 is behind epoch 3"):
        pool.allocate("b", 1)
    with pytest.raises(PoolLost, match="behind"):
        pool.beat(["a"])
    assert RedisLedger(redis_client, "p0", prefix=pool.prefix).allocate("c", 1) is not None  # others have no floor


def test_snapshot_and_owner_queries(pool):
    pool.allocate("a", 2)
    pool.allocate("b", 1)
    pool.reap_expired(now_ms=10**15)
    pool.allocate("c", 1)
    assert pool.snapshot() == {
        0: "dirty", 1: "dirty", 2: "dirty", 3: {"owner": "c", "epoch": 4}, 4: "free", 5: "free", 6: "free", 7: "free"
    }
    assert pool.owner_of(3) == ("c", 4)
    assert pool.owner_of(7) is None


def test_pool_counts_match_the_snapshot_for_every_pool(pool, redis_client, ledger_prefix):
    other = RedisLedger.register(redis_client, "p1", "prefill", num_pages=5, page_size=16, prefix=ledger_prefix)
    pool.allocate("a", 2)
    pool.allocate("b", 1)
    pool.reap_expired(now_ms=10**15)  # a's and b's pages: dirty
    pool.allocate("c", 2)
    other.allocate("x", 4)
    redis_client.lrem(pool.key("free"), 0, 7)  # a page in no state
    counts = {c.pool_id: c for c in pool_counts(redis_client, ledger_prefix)}
    assert sorted(counts) == ["p0", "p1"]
    for ledger in (pool, other):
        states = [s if isinstance(s, str) else "used" for s in ledger.snapshot().values()]
        c = counts[ledger.pool_id]
        assert (c.role, c.num_pages) == (ledger.role, ledger.num_pages)
        assert (c.used, c.free, c.dirty, c.lost) == tuple(states.count(k) for k in ("used", "free", "dirty", "lost"))
    assert (counts["p0"].used, counts["p0"].dirty, counts["p0"].lost) == (2, 3, 1)
    other.unregister()
    assert [c.pool_id for c in pool_counts(redis_client, ledger_prefix)] == ["p0"]
    assert pool_counts(redis_client, ledger_prefix + "-none") == []


def _corrupt_setup(pool):
    """a holds 0,1,2 (epochs 1-3), b holds 3,4 (4-5), page 5 is dirty, 6 and 7 are free."""
    pool.allocate("a", 3)
    pool.allocate("b", 2)
    pool.allocate("c", 1)
    pool.renew_leases(["c"], ttl_s=0.001)
    assert [e.owner for e in pool.reap_expired(now_ms=pool.redis.zscore(pool.key("leases"), "c"))] == ["c"]
    assert pool.take_dirty("w") == [5]
    pool.check_integrity()


# name -> (inject into the raw keys, what check_integrity must say)
CORRUPTIONS = {
    "owned page pushed onto the free list": (
        lambda r, k: r.rpush(k("free"), 0), "pages both free and owned: [0]"),
    "free page pushed twice": (
        lambda r, k: r.rpush(k("free"), 6), "pages on the free list twice: [6]"),
    "page->owner entry deleted": (
        lambda r, k: r.hdel(k("page_owner"), 1), "page->owner for (page, owner, listed by): [(1, None, ['a'])]"),
    "page dropped from its owner's set": (
        lambda r, k: r.srem(k("owner:a"), 2), "page->owner for (page, owner, listed by): [(2, 'a', [])]"),
    "page owned by two owners": (
        lambda r, k: r.sadd(k("owner:b"), 0), "pages listed by two owners: [(0, ['a', 'b'])]"),
    "page id out of range": (
        lambda r, k: r.rpush(k("free"), 99), "page ids outside 0..7: [99]"),
    "dirty page pushed onto the free list": (
        lambda r, k: r.rpush(k("free"), 5), "pages both free and dirty: [5]"),
    "owned page marked dirty": (
        lambda r, k: r.sadd(k("dirty"), 3), "pages both dirty and owned: [3]"),
    "free page lost": (
        lambda r, k: r.lrem(k("free"), 0, 7), "pages in no state: [7]"),
    "epoch deleted": (
        lambda r, k: r.hdel(k("page_epoch"), 4), "an owner or an epoch but not both: [4]"),
    "lease deleted": (
        lambda r, k: r.zrem(k("leases"), "a"), "without a lease (never reaped): ['a']"),
    "owner index entry deleted": (
        lambda r, k: r.srem(k("owners"), "b"), "owner index ['a'] != owners holding pages ['a', 'b']"),
    "epoch counter reset": (
        lambda r, k: r.set(k("epoch"), 0), "epoch counter 0 is behind granted epoch 5"),
    "epoch duplicated": (
        lambda r, k: r.hset(k("page_epoch"), 1, 1), "pages share an epoch: [1]"),
    "meta deleted": (
        lambda r, k: r.delete(k("meta")), "meta hash is missing"),
    "free page claimed for scrubbing": (
        lambda r, k: r.hset(k("scrubbing"), 6, "w"), "claimed for scrubbing that are not dirty: [6]"),
}


@pytest.mark.parametrize("fault", CORRUPTIONS)
def test_check_integrity_catches_injected_corruption(pool, redis_client, fault):
    _corrupt_setup(pool)
    inject, expected = CORRUPTIONS[fault]
    inject(redis_client, pool.key)
    with pytest.raises(IntegrityError, match=re.escape(expected)):
        pool.check_integrity()


def test_release_refuses_to_free_a_page_another_owner_holds(pool, redis_client):
    _corrupt_setup(pool)
    redis_client.sadd(pool.key("owner:a"), 3)  # a's set claims b's page
    with pytest.raises(IntegrityError, match="a lists page 3 but it is held by b at epoch 4"):
        pool.release("a")
    assert pool.owner_of(3) == ("b", 4) and pool.owner_of(0) == ("a", 1)


def test_missing_pool_is_an_error_not_an_empty_pool(pool, redis_client, ledger_prefix):
    with pytest.raises(LedgerError, match="pool nope is not registered"):
        RedisLedger(redis_client, "nope", prefix=ledger_prefix)
    redis_client.delete(pool.key("meta"))  # e.g. Redis restarted without persistence
    with pytest.raises(PoolLost, match="pool p0: not registered"):
        pool.allocate("a", 1)


def test_unregister_deletes_only_this_pools_keys(pool, redis_client, ledger_prefix):
    other = RedisLedger.register(redis_client, "p1", "prefill", 4, 16, prefix=ledger_prefix)
    pool.allocate("a", 2)
    pool.reap_expired(now_ms=10**15)
    pool.allocate("b", 1)
    pool.unregister()
    assert list(redis_client.scan_iter(match=f"{ledger_prefix}:pool:p0:*")) == []
    assert redis_client.smembers(f"{ledger_prefix}:pools") == {b"p1"}
    assert free_list(other) == [0, 1, 2, 3]
    other.check_integrity()


def test_works_with_a_decoding_client(redis_client, ledger_prefix):
    client = redis.Redis.from_url(URL, decode_responses=True)
    pool = RedisLedger.register(client, "p0", "sandbox", 4, 16, prefix=ledger_prefix)
    assert pool.allocate("a", 2) == Grant((0, 1), (1, 2))
    assert pool.renew_leases(["a", "z"]) == ["z"]
    assert pool.owner_of(1) == ("a", 2)
    assert [e.owner for e in pool.reap_expired(now_ms=10**15)] == ["a"]
    assert pool.take_dirty("w") == [0, 1]
    assert pool.beat(["a"]) == Beat(("a",), ())
    pool.check_integrity()
    assert ledger_from_url(URL, "p0", prefix=ledger_prefix).snapshot() == pool.snapshot()
    client.close()


def test_judge_eviction_policy():
    judge_eviction_policy("noeviction")
    for policy in ("allkeys-lru", "volatile-lru", "allkeys-lfu", "volatile-ttl", "allkeys-random", ""):
        with pytest.raises(LedgerError, match="redis-cli CONFIG SET maxmemory-policy noeviction.*redis.conf"):
            judge_eviction_policy(policy)


def test_check_eviction_policy_against_the_live_server(redis_client):
    policy = redis_client.config_get("maxmemory-policy")["maxmemory-policy"]
    if policy == "noeviction":
        check_eviction_policy(redis_client)
    else:
        with pytest.raises(LedgerError, match="CONFIG SET maxmemory-policy noeviction"):
            check_eviction_policy(redis_client)


def test_check_eviction_policy_when_config_is_not_permitted(redis_client):
    user = f"kvstest-noconfig-{uuid4().hex[:10]}"
    redis_client.acl_setuser(user, enabled=True, nopass=True, keys=["*"], commands=["+@all", "-config"])
    try:
        limited = redis.Redis.from_url(URL, username=user, password="unused")
        with pytest.raises(LedgerError, match="CONFIG GET refused.*maxmemory-policy noeviction"):
            check_eviction_policy(limited)
        limited.close()
    finally:
        redis_client.acl_deluser(user)


# Four processes churn one pool. Each stamps the shared "tensor" with its id while it holds a
# page, so a page granted to two processes at once shows up as a stamp that is not zero.
_stamps = None
_start = None  # a Barrier all churning processes wait at (test_four_processes_never_share_a_page)


def _init_worker(stamps, start):
    global _stamps, _start
    _stamps, _start = stamps, start


def _churn(url, prefix, pool_id, worker, num_grants, seed):
    ledger = RedisLedger(redis.Redis.from_url(url), pool_id, prefix)
    owner, rng = f"w{worker}", random.Random(seed)
    held, records, violations, num_full = deque(), [], [], 0
    _start.wait(timeout=60)  # every process churns at once: started one by one, each could finish alone

    def give_back():
        grant, granted_ns = held.popleft()
        for page, epoch in zip(grant.pages, grant.epochs):
            if ledger.owner_of(page) != (owner, epoch):
                violations.append(f"{owner} lost page {page}@{epoch}: {ledger.owner_of(page)}")
            _stamps[page] = 0
        freeing_ns = time.monotonic_ns()
        ledger.free(owner, grant.pages, grant.epochs)
        records.extend((page, epoch, owner, granted_ns, freeing_ns) for page, epoch in zip(grant.pages, grant.epochs))

    num_granted = 0
    while num_granted < num_grants:
        if held and (len(held) == 3 or rng.random() < 0.4):
            give_back()
            continue
        grant = ledger.allocate(owner, rng.randint(1, 3))
        if grant is None:
            num_full += 1
            if held:
                give_back()
            continue
        granted_ns = time.monotonic_ns()
        for page in grant.pages:
            if _stamps[page] != 0:
                violations.append(f"{owner} got page {page} while w{_stamps[page] - 1} held it")
            _stamps[page] = worker + 1
        held.append((grant, granted_ns))
        num_granted += 1
    while held:
        give_back()
    return records, violations, num_full


def test_four_processes_never_share_a_page(redis_client, ledger_prefix):
    pool = RedisLedger.register(redis_client, "mp", "sandbox", 12, 16, prefix=ledger_prefix)
    ctx = multiprocessing.get_context("spawn")
    stamps = ctx.Array("i", pool.num_pages, lock=False)
    with ctx.Pool(4, initializer=_init_worker, initargs=(stamps, ctx.Barrier(4))) as workers:
        results = workers.starmap(_churn, [(URL, ledger_prefix, "mp", w, 200, w) for w in range(4)])
    records = [r for rs, _, _ in results for r in rs]
    assert [v for _, vs, _ in results for v in vs] == []
    assert sum(num_full for _, _, num_full in results) > 0  # the pool was contended
    assert len(records) >= 4 * 200
    epochs = [epoch for _, epoch, *_ in records]
    assert len(set(epochs)) == len(epochs)
    by_page = defaultdict(list)
    for page, epoch, owner, granted_ns, freeing_ns in records:
        by_page[page].append((epoch, owner, granted_ns, freeing_ns))
    assert len({owner for _, _, owner, _, _ in records}) == 4
    for page, grants in by_page.items():
        grants.sort()  # the ledger's order: epochs
        for (e1, o1, _, freeing), (e2, o2, granted, _) in zip(grants, grants[1:]):
            assert freeing < granted, f"page {page}: {o1}@{e1} still held when {o2}@{e2} was granted"
    assert pool.num_free() == 12
    pool.check_integrity()


# ---- growth: many owners in one script (the scheduler's step), admission's keep_free ------------------

def test_extend_many_grows_every_owner_in_one_script_all_or_nothing(pool, redis_client, ledger_prefix):
    pool.allocate("a", 1)
    pool.allocate("b", 2)
    pool.renew_leases(["a", "b"], ttl_s=1)
    before = dump(redis_client, ledger_prefix)
    assert pool.extend_many([("a", 3), ("b", 3)]) is None  # 6 > 5 free: nothing taken
    assert dump(redis_client, ledger_prefix) == before
    calls = []
    real = pool._call
    pool._call = lambda *args: calls.append(args[0]) or real(*args)
    assert pool.extend_many([("b", 1), ("a", 2)]) == [Grant((3,), (4,)), Grant((4, 5), (5, 6))]
    assert calls == ["grant"]  # one round trip for every sequence crossing a page boundary
    assert pool.pages_of("a") == {0: 1, 4: 5, 5: 6} and pool.pages_of("b") == {1: 2, 2: 3, 3: 4}
    for owner in ("a", "b"):  # each grown owner's lease is renewed with its grant
        assert abs(redis_client.zscore(pool.key("leases"), owner) - (server_ms(redis_client) + 30_000)) < 2000
    assert pool.extend_many([]) == []
    with pytest.raises(LedgerError, match="hold no pages to extend"):
        pool.extend_many([("a", 1), ("nobody", 1)])
    with pytest.raises(LedgerError, match="listed twice"):
        pool.extend_many([("a", 1), ("a", 1)])
    assert pool.num_free() == 2
    pool.check_integrity()


def test_allocate_keeps_free_what_it_is_told_to(pool):
    pool.allocate("a", 5)
    assert pool.allocate("b", 1, keep_free=3) is None
    assert pool.allocate("b", 1, keep_free=2) == Grant((5,), (6,))
    pool.check_integrity()


def test_lease_renewal_covers_grown_pages_and_a_lost_lease_reaps_them_all(pool, redis_client):
    from inference.host_ledger import HostLedger

    host = HostLedger(pool)
    host.allocate("a", 1)
    host.allocate("b", 1)
    assert [g.pages for g in host.extend_many([("a", 2), ("b", 1)])] == [(2, 3), (4,)]
    step = server_ms(redis_client) + 10**9  # far past every lease: only what the beat renews survives
    assert host.beat(now_ms=step) == Beat((), ())
    assert pool.pages_of("a") == {0: 1, 2: 3, 3: 4} and pool.pages_of("b") == {1: 2, 4: 5}
    pool.check_integrity()
    (event,) = [e for e in pool.reap_expired(now_ms=step + 31_000) if e.owner == "a"] or [None]
    assert event is not None and event.pages == (0, 2, 3)  # the grown pages go with the lease
    assert pool.take_dirty("w") == [0, 1, 2, 3, 4]
    pool.check_integrity()


def test_a_grow_for_an_owner_whose_lease_was_reaped_grants_the_others_and_reports_it_refused(pool, redis_client):
    from inference.host_ledger import HostLedger

    host = HostLedger(pool)
    host.allocate("a", 1)
    host.allocate("b", 1)
    step = server_ms(redis_client) + 10**9
    pool.beat(["b"], now_ms=step)  # a's lease runs out: reaped into the dirty set
    grants = host.extend_many([("a", 1), ("b", 2)])
    assert grants == [Grant((), ()), Grant((2, 3), (3, 4))]
    assert host.take_refused() == {"a"} and pool.pages_of("a") == {}
    pool.check_integrity()

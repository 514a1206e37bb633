"""RedisLedger's shared (prefix-cache) pages against a Python model, across two tenants: allocate / cache /
hit / evict / free / release / lease expiry, with the scope invariant and check_integrity after every step."""
import itertools

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from inference.allocator import LedgerError, cache_entry
from inference.ledger import RedisLedger

SALTS = {"x": "a" * 64, "y": "b" * 64}  # two tenant scopes
TENANT = {"a1": "x", "a2": "x", "b1": "y", "b2": "y"}  # request -> its tenant
OWNERS = tuple(TENANT)
NUM_PAGES = 8
_pool_ids = itertools.count()


class SharedLedgerMachine(RuleBasedStateMachine):
    client = None
    prefix = None

    def __init__(self):
        super().__init__()
        self.ledger = RedisLedger.register(self.client, f"s{next(_pool_ids)}", "prefill", NUM_PAGES, 16,
                                           prefix=self.prefix)
        self.free: list[int] = list(range(NUM_PAGES))
        self.owned: dict[int, tuple[str, int]] = {}  # page -> (owner or cache entry, epoch)
        self.scope: dict[int, str] = {}  # cached page -> tenant
        self.readers: dict[int, set[str]] = {}
        self.dirty: set[int] = set()
        self.next_epoch = 1

    def teardown(self):
        self.ledger.unregister()

    def own(self, owner):
        return [(p, e) for p, (o, e) in sorted(self.owned.items()) if o == owner]

    def cached(self, tenant=None):
        return [(p, self.owned[p][1]) for p, t in sorted(self.scope.items()) if tenant in (None, t)]

    def reads(self, owner):
        return sorted(p for p, rs in self.readers.items() if owner in rs)

    @initialize(data=st.data())
    def each_tenant_caches(self, data):
        """Both tenants start with cached pages, so every run has shared pages to hit, evict and probe."""
        for owner in ("a1", "b1"):
            self.allocate(owner, 2)
            self.cache(owner, data)

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(0, 3))
    def allocate(self, owner, n):
        grant = self.ledger.allocate(owner, n)
        if n > len(self.free):
            assert grant is None
            return
        pages, self.free = self.free[:n], self.free[n:]
        assert list(grant.pages) == pages
        for page, epoch in zip(grant.pages, grant.epochs):
            assert epoch == self.next_epoch
            self.next_epoch += 1
            self.owned[page] = (owner, epoch)

    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def cache(self, owner, data):
        mine = self.own(owner)
        chosen = data.draw(st.permutations(mine))[: data.draw(st.integers(min(1, len(mine)), len(mine)))]
        tenant = TENANT[owner]
        entry = self.ledger.cache(owner, SALTS[tenant], [p for p, _ in chosen], [e for _, e in chosen])
        assert entry == cache_entry(SALTS[tenant])
        for page, epoch in chosen:
            self.owned[page] = (entry, epoch)
            self.scope[page] = tenant
            self.readers[page] = set()

    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def hit(self, owner, data):
        tenant = TENANT[owner]
        mine = [pe for pe in self.cached(tenant) if owner not in self.readers[pe[0]]]
        chosen = data.draw(st.permutations(mine))[: data.draw(st.integers(min(1, len(mine)), len(mine)))]
        assert self.ledger.hit(owner, SALTS[tenant], [p for p, _ in chosen], [e for _, e in chosen])
        for page, _ in chosen:
            self.readers[page].add(owner)

    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def stale_hit(self, owner, data):
        """A page that left the cache (or a wrong epoch) is a miss: False, nothing recorded."""
        tenant = TENANT[owner]
        gone = [p for p in range(NUM_PAGES) if p not in self.scope]
        if not gone:
            return
        page = data.draw(st.sampled_from(gone))
        assert not self.ledger.hit(owner, SALTS[tenant], [page], [data.draw(st.integers(1, self.next_epoch + 2))])

    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def foreign_hit(self, owner, data):
        """Another tenant's cached page, alone or among the reader's own scope's: refused, nothing recorded."""
        other = "y" if TENANT[owner] == "x" else "x"
        theirs = self.cached(other)
        if not theirs:
            return
        batch = [data.draw(st.sampled_from(theirs))] + self.cached(TENANT[owner])[:2]
        with pytest.raises(LedgerError, match="outside its scope"):
            self.ledger.hit(owner, SALTS[TENANT[owner]], [p for p, _ in batch], [e for _, e in batch])
        if self.reads(owner):  # a request reads one scope: once reading its own, another salt is refused
            with pytest.raises(LedgerError, match="reads under another scope already"):
                self.ledger.hit(owner, SALTS[other], [p for p, _ in theirs], [e for _, e in theirs])

    @rule(owner=st.sampled_from(OWNERS))
    def unread(self, owner):
        assert self.ledger.unread(owner) == len(self.reads(owner))
        for rs in self.readers.values():
            rs.discard(owner)

    @rule(data=st.data())
    def evict(self, data):
        if not self.scope:
            return
        page, epoch = data.draw(st.sampled_from(self.cached()))
        tenant = self.scope[page]
        if self.readers[page]:
            with pytest.raises(LedgerError, match="has readers"):
                self.ledger.evict(SALTS[tenant], [page], [epoch])
            return
        self.ledger.evict(SALTS[tenant], [page], [epoch])
        del self.owned[page], self.scope[page], self.readers[page]
        self.free.append(page)

    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def free(self, owner, data):
        mine = self.own(owner)
        chosen = data.draw(st.permutations(mine))[: data.draw(st.integers(0, len(mine)))]
        self.ledger.free(owner, [p for p, _ in chosen], [e for _, e in chosen])
        for page, _ in chosen:
            del self.owned[page]
            self.free.append(page)

    @rule(data=st.data())
    def free_cached(self, data):
        """A cached page is never freed as a request's page, not even by the request that cached it."""
        if not self.scope:
            return
        page, epoch = data.draw(st.sampled_from(self.cached()))
        with pytest.raises(LedgerError):
            self.ledger.free(data.draw(st.sampled_from(OWNERS)), [page], [epoch])

    @rule(owner=st.sampled_from(OWNERS))
    def release(self, owner):
        pages = [p for p, _ in self.own(owner)]
        assert self.ledger.release(owner) == pages
        for page in pages:
            del self.owned[page]
        self.free.extend(pages)
        for rs in self.readers.values():
            rs.discard(owner)

    @rule(n=st.integers(0, 9))
    def every_lease_expires(self, n):
        if n:  # rarely: it empties the pool
            return
        self.ledger.reap_expired(now_ms=10**15)
        self.dirty |= self.owned.keys()
        self.owned.clear()
        self.scope.clear()
        self.readers.clear()

    @rule()
    def scrub(self):
        claimed = self.ledger.take_dirty("w")
        self.ledger.mark_clean(claimed, "w")
        self.dirty -= set(claimed)
        self.free.extend(claimed)

    @invariant()
    def ledger_matches_model(self):
        self.ledger.check_integrity()
        snap = self.ledger.snapshot()
        expected = {p: "dirty" if p in self.dirty else "free" for p in range(NUM_PAGES)}
        for page, (owner, epoch) in self.owned.items():
            expected[page] = {"owner": owner, "epoch": epoch}
            if page in self.scope:
                expected[page].update(scope=SALTS[self.scope[page]], readers=sorted(self.readers[page]))
        assert snap == expected
        assert [int(p) for p in self.client.lrange(self.ledger.key("free"), 0, -1)] == self.free
        for owner in OWNERS:
            assert self.ledger.reads_of(owner) == self.reads(owner)
        # the scope invariant, read from Redis alone: every reader of a cached page is of the page's tenant
        for page, state in snap.items():
            if isinstance(state, dict) and "scope" in state:
                assert all(SALTS[TENANT[r]] == state["scope"] for r in state["readers"]), (page, state)


def test_shared_pages_match_their_model(redis_client, ledger_prefix):
    machine = type("Machine", (SharedLedgerMachine,), {"client": redis_client, "prefix": ledger_prefix})
    run_state_machine_as_test(machine, settings=settings(max_examples=60, stateful_step_count=40, deadline=None))


def test_integrity_names_a_read_outside_its_scope(redis_client, ledger_prefix):
    """A reader recorded under another tenant's page (written behind the scripts' back) is an audit failure."""
    ledger = RedisLedger.register(redis_client, "audit", "prefill", 4, 16, prefix=ledger_prefix)
    grant = ledger.allocate("a1", 2)
    ledger.cache("a1", SALTS["x"], grant.pages[:1], grant.epochs[:1])
    ledger.allocate("b1", 1)
    assert ledger.hit("b1", SALTS["y"], [], [])  # nothing read: nothing recorded
    ledger.check_integrity()
    page = grant.pages[0]
    redis_client.sadd(ledger.key(f"readers:{page}"), "b1")
    redis_client.sadd(ledger.key("reads:b1"), page)
    redis_client.hset(ledger.key("reader_scope"), "b1", SALTS["y"])
    with pytest.raises(LedgerError, match=r"reads outside the reader's scope \(reader, page\): \[\('b1', 0\)\]"):
        ledger.check_integrity()


def test_request_cannot_take_a_cache_entry_name(redis_client, ledger_prefix):
    ledger = RedisLedger.register(redis_client, "names", "prefill", 4, 16, prefix=ledger_prefix)
    with pytest.raises(LedgerError, match="are cache entries"):
        ledger.allocate(cache_entry(SALTS["x"]), 1)

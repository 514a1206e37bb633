"""RedisLedger against a Python model of it, driven by hypothesis; integrity checked after every step."""
import itertools

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from inference.allocator import Grant, LedgerError
from inference.ledger import RedisLedger

OWNERS = ("a", "b", "c", "d")
NUM_PAGES = 8
_pool_ids = itertools.count()


class LedgerMachine(RuleBasedStateMachine):
    client = None  # set by the test
    prefix = None

    def __init__(self):
        super().__init__()
        self.ledger = RedisLedger.register(
            self.client, f"m{next(_pool_ids)}", "sandbox", NUM_PAGES, 16, prefix=self.prefix
        )
        self.free: list[int] = list(range(NUM_PAGES))  # in order
        self.owned: dict[int, tuple[str, int]] = {}  # page -> (owner, epoch)
        self.dirty: set[int] = set()
        self.claimed: set[int] = set()  # dirty pages claimed by the scrubber "w"
        self.next_epoch = 1

    def teardown(self):
        self.ledger.unregister()

    def held(self, owner):
        return {p: e for p, (o, e) in sorted(self.owned.items()) if o == owner}

    def _grant(self, owner, n, call):
        grant = call(owner, n)
        if n > len(self.free):
            assert grant is None
            return
        pages, self.free = self.free[:n], self.free[n:]
        epochs = list(range(self.next_epoch, self.next_epoch + n))
        self.next_epoch += n
        assert grant == Grant(tuple(pages), tuple(epochs))
        self.owned.update({p: (owner, e) for p, e in zip(pages, epochs)})

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(0, 4))
    def allocate(self, owner, n):
        self._grant(owner, n, self.ledger.allocate)

    @rule(owner=st.sampled_from(OWNERS), n=st.integers(0, 3))
    def extend(self, owner, n):
        if self.held(owner):
            self._grant(owner, n, self.ledger.extend)
        else:
            with pytest.raises(LedgerError, match="hold no pages to extend"):
                self.ledger.extend(owner, n)

    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def free(self, owner, data):
        held = list(self.held(owner).items())
        chosen = data.draw(st.permutations(held))[: data.draw(st.integers(0, len(held)))]
        self.ledger.free(owner, [p for p, _ in chosen], [e for _, e in chosen])
        for page, _ in chosen:
            del self.owned[page]
            self.free.append(page)

    @rule(owner=st.sampled_from(OWNERS), data=st.data())
    def bad_free(self, owner, data):
        """One page not held by owner at that epoch, among good ones: refused, nothing changes."""
        held = list(self.held(owner).items())
        others = [p for p in range(NUM_PAGES) if p not in self.held(owner)]
        if others and (not held or data.draw(st.booleans())):  # wrong owner: someone else's page, or a free or dirty one
            page = data.draw(st.sampled_from(others))
            epoch = self.owned[page][1] if page in self.owned else data.draw(st.integers(1, self.next_epoch))
        else:  # right owner, wrong epoch: stale or from the future
            page, epoch = data.draw(st.sampled_from(held))
            epoch += data.draw(st.integers(-epoch, 3).filter(bool))
        good = data.draw(st.permutations(held))[: data.draw(st.integers(0, len(held)))]
        good = [(p, e) for p, e in good if p != page]
        batch = good[:]
        batch.insert(data.draw(st.integers(0, len(batch))), (page, epoch))
        with pytest.raises(LedgerError, match=f"{owner} cannot free page {page} at epoch {epoch}"):
            self.ledger.free(owner, [p for p, _ in batch], [e for _, e in batch])

    @rule(owner=st.sampled_from(OWNERS))
    def release(self, owner):
        pages = list(self.held(owner))
        assert self.ledger.release(owner) == pages
        for page in pages:
            del self.owned[page]
        self.free.extend(pages)

    @rule(owner=st.sampled_from(OWNERS))
    def lease_expires(self, owner):
        held = self.held(owner)
        assert self.ledger.renew_leases([owner], ttl_s=0.001) == ([] if held else [owner])
        seconds, micros = self.client.time()
        # a second on, on the given clock: past this lease, long before the others (30 s leases)
        events = self.ledger.reap_expired(now_ms=seconds * 1000 + micros // 1000 + 1000)
        assert [(e.pool_id, e.owner, e.pages, e.epochs) for e in events] == (
            [(self.ledger.pool_id, owner, tuple(held), tuple(held.values()))] if held else []
        )
        for page in held:
            del self.owned[page]
        self.dirty |= held.keys()

    @rule()
    def every_lease_expires(self):
        events = self.ledger.reap_expired(now_ms=10**15)
        holders = sorted({o for o, _ in self.owned.values()})
        assert sorted((e.owner, e.pages, e.epochs) for e in events) == [
            (o, tuple(self.held(o)), tuple(self.held(o).values())) for o in holders
        ]
        self.dirty |= self.owned.keys()
        self.owned.clear()

    @rule()
    def heartbeat(self):
        holders = {o for o, _ in self.owned.values()}
        assert self.ledger.renew_leases(list(OWNERS)) == [o for o in OWNERS if o not in holders]

    @rule(data=st.data())
    def scrub(self, data):
        if data.draw(st.booleans()):  # a claim whose reply was lost: the next one answers its pages again
            self.ledger.take_dirty("w", in_hand=sorted(self.claimed))
        claimed = self.ledger.take_dirty("w", in_hand=sorted(self.claimed))
        assert claimed == sorted(self.dirty - self.claimed)
        self.claimed |= set(claimed)
        assert self.ledger.take_dirty("w", in_hand=sorted(self.claimed)) == []  # never claimed twice
        assert self.ledger.take_dirty("other") == []  # nor by another claimer
        mine = sorted(self.claimed)
        clean = data.draw(st.permutations(mine))[: data.draw(st.integers(0, len(mine)))]
        self.ledger.mark_clean(clean, "w")
        self.dirty -= set(clean)
        self.claimed -= set(clean)
        self.free.extend(clean)

    @rule(data=st.data())
    def bad_mark_clean(self, data):
        page = data.draw(st.sampled_from([p for p in range(NUM_PAGES) if p not in self.claimed] or [NUM_PAGES]))
        batch = sorted(self.claimed) + [page]
        with pytest.raises(LedgerError, match=f"cannot mark page {page} clean"):
            self.ledger.mark_clean(data.draw(st.permutations(batch)), "w")

    @rule()
    def worker_restarts(self):
        RedisLedger.register(self.client, self.ledger.pool_id, "sandbox", NUM_PAGES, 16, prefix=self.prefix)
        self.free, self.owned, self.dirty, self.claimed = list(range(NUM_PAGES)), {}, set(), set()

    @invariant()
    def ledger_matches_model(self):
        self.ledger.check_integrity()
        expected = {p: "dirty" if p in self.dirty else "free" for p in range(NUM_PAGES)}
        expected.update({p: {"owner": o, "epoch": e} for p, (o, e) in self.owned.items()})
        assert self.ledger.snapshot() == expected
        assert [int(p) for p in self.client.lrange(self.ledger.key("free"), 0, -1)] == self.free
        assert self.ledger.num_free() == len(self.free)
        for owner in OWNERS:
            assert self.ledger.pages_of(owner) == self.held(owner)
        leased = {o.decode() for o in self.client.zrange(self.ledger.key("leases"), 0, -1)}
        assert leased == {o for o, _ in self.owned.values()}


def test_ledger_matches_its_model(redis_client, ledger_prefix):
    machine = type("Machine", (LedgerMachine,), {"client": redis_client, "prefix": ledger_prefix})
    run_state_machine_as_test(machine, settings=settings(max_examples=40, stateful_step_count=30, deadline=None))

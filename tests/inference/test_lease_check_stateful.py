"""Shared pages keep their real owner in lease renewal and lease checks: an engine (prefix cache on) over a
HostLedger on real Redis, driven through read (a request admitted on a cached prefix), hit (a read whose
admission then waits for pages), evict, a lease lost with the injected clock (`beat(now_ms=...)`), reads lost
behind the engine's back, and the worker's lease check (`inference.worker.check_leases`) asked about every
owner it renews. A check fails only an owner whose holdings really went; cached pages stay the cache entry's:
never scrubbed, dropped from the index or lost to the pool because a reader was checked."""
import itertools

from hypothesis import settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from inference.allocator import cache_entry
from inference.engine import Engine, EngineConfig
from inference.host_ledger import HostLedger
from inference.ledger import RedisLedger
from inference.sequence import Sequence, SeqStatus
from inference.worker import check_leases
from tests.inference.helpers import greedy

SALTS = {"x": "c" * 64, "y": "d" * 64}
NUM_PAGES = 64
_ids = itertools.count()


def prompt(tenant: str, variant: int) -> list[int]:
    base = list(range(10, 42)) if tenant == "x" else list(range(60, 92))  # two full pages per tenant
    return base + [(100 + 13 * variant + j) % 200 + 20 for j in range(5 + 16 * (variant % 2))]


def server_ms(client) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


class LeaseCheckMachine(RuleBasedStateMachine):
    client = prefix = model = None

    def __init__(self):
        super().__init__()
        self.ledger = RedisLedger.register(self.client, f"lc{next(_ids)}", "prefill", NUM_PAGES, 16,
                                           prefix=self.prefix, lease_ttl_s=30)
        self.host = HostLedger(self.ledger)
        self.engine = Engine(self.model, EngineConfig(num_pages=NUM_PAGES, page_size=16, window=NUM_PAGES * 16,
                                                      prefix_cache=True), allocator_factory=lambda n: self.host)
        self.readers: dict[str, Sequence] = {}  # running requests
        self.lost: set[str] = set()  # readers whose holdings the ledger lost: the next check fails them
        self.now = server_ms(self.client)

    def teardown(self):
        self.ledger.unregister()

    def _rid(self) -> str:
        return f"r{next(_ids)}"

    def _run_until(self, seq, done) -> None:
        while not done(seq):
            self.engine.step()

    def _end(self, seqs) -> None:
        """The worker's side of a failure: the request is aborted (nothing of it stays in the engine)."""
        for seq in seqs:
            self.readers.pop(seq.request_id, None)
            self.lost.discard(seq.request_id)
            self.engine.abort(seq.request_id, "lease lost")
        self.engine.pop_finished()

    def _scrub_dirty(self) -> None:
        """The worker's side of a reap: dirty pages are reclaimed (holders fail), scrubbed, marked clean."""
        dirty = self.ledger.take_dirty("w")
        self._end(self.engine.reclaim(dirty))
        self.ledger.mark_clean(dirty, "w")

    @initialize()
    def each_tenant_caches(self):
        """Both scopes start with a cached prefix, so that reads hit."""
        for tenant in "xy":
            self.cache(tenant, 0)

    @rule(tenant=st.sampled_from("xy"), variant=st.integers(0, 5))
    def cache(self, tenant, variant):
        """A prefill finishes: its prompt's full pages join its scope's cache."""
        seq = self.engine.add_request(self._rid(), prompt(tenant, variant), greedy(1), prefill_only=True,
                                      salt=SALTS[tenant])
        self._run_until(seq, lambda s: s.status is SeqStatus.PREFILLED)
        self.engine.release(seq)

    @precondition(lambda self: len(self.readers) < 4)
    @rule(tenant=st.sampled_from("xy"), variant=st.integers(0, 5), waited=st.booleans())
    def read(self, tenant, variant, waited):
        """A request admitted on its scope's cached prefix, running. `waited`: its first admission read the
        prefix and then found no room (its reads ended, the lease with them), as under a full pool."""
        rid, p = self._rid(), prompt(tenant, variant)
        if waited:
            early = Sequence(rid, p, greedy(400), salt=SALTS[tenant])
            assert not self.engine.prefix_cache.admit(early, lambda s: NUM_PAGES + 1)
        seq = self.engine.add_request(rid, p, greedy(400), salt=SALTS[tenant])
        self._run_until(seq, lambda s: s.status is SeqStatus.RUNNING)
        self.readers[rid] = seq

    @rule(data=st.data())
    def end(self, data):
        if self.readers:
            rid = data.draw(st.sampled_from(sorted(self.readers)))
            self.readers.pop(rid)
            self.lost.discard(rid)
            self.engine.abort(rid, "done")

    @rule(n=st.integers(1, 4))
    def evict(self, n):
        """Eviction of unread cached pages, as an allocation short of `n` pages asks for."""
        self.engine.prefix_cache.evict(self.engine.block_manager.num_free() + n)

    @rule(data=st.data())
    def lose_reads(self, data):
        """A reader's reads vanish from the ledger behind the engine's back: the next check must fail it."""
        shared = [rid for rid, seq in self.readers.items() if seq.num_shared]
        if shared:
            rid = data.draw(st.sampled_from(sorted(shared)))
            self.ledger.unread(rid)
            self.lost.add(rid)

    @rule(data=st.data())
    def lose_lease(self, data):
        """One owner is not renewed by a beat on a clock far ahead (injected): reaped, then what the worker
        does with the beat (lease check of the missing, reclaim of the dirty pages)."""
        with self.host._lock:
            held = sorted(self.host._held)
        if not held:
            return
        victim = data.draw(st.sampled_from(held))
        self.now += 10**8
        beat = self.ledger.beat([o for o in held if o != victim], now_ms=self.now)
        self._end(seq for seq, _ in check_leases(self.engine, self.host, beat.missing))
        self._scrub_dirty()
        self.lost.discard(victim)  # reaped: whatever of it ran has just failed

    @rule()
    def lease_check(self):
        """The worker's check asked about every owner it renews (as a beat racing a re-grant reports them):
        only the readers whose holdings were lost fail, and nothing cached leaves the cache."""
        with self.host._lock:
            held = tuple(sorted(self.host._held))
        cached = set(self.engine.prefix_cache.lru)
        failed = check_leases(self.engine, self.host, held)
        assert {seq.request_id for seq, _ in failed} == self.lost & set(held)
        self._end(seq for seq, _ in failed)
        assert set(self.engine.prefix_cache.lru) == cached

    @invariant()
    def books_balance(self):
        self.ledger.check_integrity()
        snap = self.ledger.snapshot()
        owned = {p: s for p, s in snap.items() if isinstance(s, dict)}
        cached = {p for p, s in owned.items() if "scope" in s}
        assert cached == set(self.engine.prefix_cache.lru), "the index and the ledger's cache disagree"
        own = {p: rid for rid, seq in self.readers.items() for p in seq.block_table[seq.num_shared:]}
        assert set(owned) == cached | set(own), "pages held by no request and no cache entry"
        for rid, seq in self.readers.items():
            assert seq.status is SeqStatus.RUNNING and set(self.engine.seqs) >= {rid}
            assert all(owned[p]["owner"] == rid for p in seq.block_table[seq.num_shared:])
            for p in seq.block_table[: seq.num_shared]:
                assert owned[p]["owner"] == cache_entry(seq.salt) and owned[p]["scope"] == seq.salt
                assert (rid in owned[p]["readers"]) == (rid not in self.lost)
        assert set(self.engine.seqs) == set(self.readers)


def test_lease_checks_keep_shared_pages_with_their_real_owner(redis_client, ledger_prefix, tiny_model):
    machine = type("Machine", (LeaseCheckMachine,), {"client": redis_client, "prefix": ledger_prefix,
                                                     "model": tiny_model})
    run_state_machine_as_test(machine, settings=settings(max_examples=12, stateful_step_count=20, deadline=None))

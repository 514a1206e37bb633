"""Live probes a worker runs on itself for the canary, inside its engine loop, on pages it allocates for a canary
owner in its real pool and ledger (never another request's): the read guard (foreign page, unwritten tail,
stale epoch must each raise in `BlockManager.check_reads`; and a page an n-choice request's choices share, read by
another request, must raise while its own choice reads it) and scrub-on-free (a marker written into a canary
page is gone from the page's bytes once the page is freed through the normal path). A pool with no free page
now answers "busy:" (not proven, not broken). A probe never records a
violation, an incident or a quarantine: its result is returned, and stored by `ProbeRecords`, which owns the
Redis keys `{prefix}:probes:*`. No Django."""
import json
import uuid

from inference.block_manager import OwnershipViolation
from inference.choices import choice_scope
from inference.retry import repeat
from inference.sequence import SamplingParams, Sequence

CANARY_PROBE_PREFIX = "canary-probe-"  # request ids of canary probe traffic (server-made, never a client's)
GUARD_CASES = {"foreign_page": "foreign_read", "unwritten_tail": "unwritten_read", "stale_epoch": "stale_epoch",
               "choice_shared_page": "foreign_read"}


def _owner(kind: str) -> Sequence:
    return Sequence(f"{CANARY_PROBE_PREFIX}{kind}-{uuid.uuid4().hex[:10]}", [0], SamplingParams(max_tokens=1))


def _reading(seq: Sequence, pages: list[int], epochs: list[int]) -> Sequence:
    """A copy of `seq` (same request id) whose block table is `pages` at `epochs`: the read under test."""
    probe = Sequence(seq.request_id, seq.prompt_ids, seq.params)
    probe.block_table, probe.page_epochs = list(pages), list(epochs)
    return probe


def guard_probe(engine) -> dict:
    """Three reads the guard must stop, on canary-owned pages: {case: {"expected", "got", "ok"}}, "ok"."""
    bm, ps = engine.block_manager, engine.page_size
    a, b = _owner("guard-a"), _owner("guard-b")
    evict: list[tuple[str, list[int], list[int]]] = []
    try:
        if not bm.allocate(a, 2) or not bm.allocate(b, 1):
            return {"ok": False, "reason": "busy: no free pages for the guard probe now", "cases": {}}
        bm.mark_written(a, ps + 1)  # a: first page full, one slot of the second
        bm.mark_written(b, 1)
        reads = {
            # a's table pointing at b's page, at b's epoch: only the owner check can tell
            "foreign_page": (_reading(a, [b.block_table[0]], [b.page_epochs[0]]), 0, 1),
            # past a's watermark inside its own second page
            "unwritten_tail": (a, ps + 5, 1),
            # a's own page at an epoch it no longer holds
            "stale_epoch": (_reading(a, a.block_table[:1], [a.page_epochs[0] - 1]), 1, 1),
        }
        cases = {case: _judge(bm, GUARD_CASES[case], *read) for case, read in reads.items()}
        pages = a.block_table + b.block_table
        shared = _choice_case(bm, a, b, evict)
        if shared is not None:
            cases["choice_shared_page"] = shared
        return {"ok": all(c["ok"] for c in cases.values()) and shared is not None, "cases": cases, "pages": pages,
                **({} if shared is not None else {"reason": "unproven: the ledger did not take the shared page"})}
    finally:
        for seq in (a, b):
            if seq.block_table:
                bm.deallocate(seq)
        for scope, pages, epochs in evict:  # the choice case's shared page, after its reader let it go
            bm.evict_pages(scope, pages, epochs)


def _judge(bm, expected: str, seq: Sequence, past: int, new: int) -> dict:
    try:
        bm.check_reads(seq, past, new)
        got = "allowed"
    except OwnershipViolation as exc:
        got = exc.violation.kind
    return {"expected": expected, "got": got, "ok": got == expected}


def _choice_case(bm, a: Sequence, b: Sequence, evict: list) -> dict | None:
    """a's full first page becomes the shared prompt page of a's own n-choice request (its request scope's cache
    entry, as Engine.add_prefilled_choices makes it): a, its choice, must read it; b, another request claiming it
    as a shared page of its own request's scope, must be stopped. None when the ledger did not take the page."""
    a.share_scope = choice_scope(a.request_id)
    if bm.cache_pages(a, [0]) is None:
        return None
    evict.append((a.share_scope, a.block_table[:1], a.page_epochs[:1]))
    a.num_shared = 1  # a reads it shared now (its second page stays its own)
    own = _judge(bm, "allowed", a, bm.page_size + 1, 1)
    thief = _reading(b, a.block_table[:1] + b.block_table, a.page_epochs[:1] + b.page_epochs)
    thief.share_scope, thief.num_shared = choice_scope(b.request_id), 1
    case = _judge(bm, "foreign_read", thief, bm.page_size + 1, 1)
    if not own["ok"]:  # the guard refuses the request's own choice: broken the other way
        return {**case, "got": f"own choice refused ({own['got']})", "ok": False}
    return case


def scrub_probe(engine) -> dict:
    """A marker in a canary-owned page, the page freed by `BlockManager.deallocate`; whether its bytes are zero
    before the allocator can hand it out again (read from the pool tensor itself, not the mirror)."""
    bm, pool = engine.block_manager, engine.pool
    if bm.scrub_policy != "on_free":  # on_alloc zeroes at the next grant, which this probe cannot pick
        return {"ok": False, "scrub_policy": bm.scrub_policy,
                "reason": f"unproven: the scrub probe checks on_free; this pool scrubs {bm.scrub_policy}"}
    c = _owner("scrub")
    if not bm.allocate(c, 1):
        return {"ok": False, "reason": "busy: no free page for the scrub probe now"}
    page = c.block_table[0]
    pool.data[page].fill_(7.0)
    bm.mark_written(c, 1)
    marked = bool((pool.data[page] == 7.0).all())
    bm.deallocate(c)
    nonzero = int(pool.data[page].count_nonzero())
    ok = marked and nonzero == 0
    return {"ok": ok, "page": page, "marker_written": marked, "nonzero_after_free": nonzero,
            "scrub_policy": bm.scrub_policy,
            **({} if ok else {"reason": f"page {page} still holds {nonzero} nonzero values after its free"})}


PROBES = {"guard": guard_probe, "scrub": scrub_probe}


class ProbeRecords:
    """Probe results by probe id (what a worker found, for the canary to read), with a TTL."""

    def __init__(self, redis, prefix: str, ttl_s: int = 3600):
        self.redis, self.prefix, self.ttl_s = redis, prefix, ttl_s

    def key(self, probe_id: str) -> str:
        return f"{self.prefix}:probes:{probe_id}"

    def put(self, probe_id: str, record: dict) -> None:
        """Repeated across a dropped connection (a keyed SET): a record lost to a Redis blip left the canary
        waiting out its whole deadline for it."""
        data = json.dumps(record, default=str)
        repeat(lambda: self.redis.set(self.key(probe_id), data, ex=self.ttl_s), f"recording probe {probe_id}")

    def get_many(self, probe_ids) -> dict[str, dict]:
        ids = list(probe_ids)
        raws = repeat(lambda: self.redis.mget([self.key(i) for i in ids]), "reading probe records") if ids else []
        return {i: json.loads(r) for i, r in zip(ids, raws) if r is not None}

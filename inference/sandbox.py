"""The incident, replayed in a sandbox: the canary self-test's engine half (invariant 7). No Django.

Two fresh in-process engines on their own `LocalAllocator` pools (never a live worker's pages), sized
like the incident in miniature: the window is the model's (8192 tokens) while the prefill pool holds
`prefill_pages` pages and the decode pool `decode_pages`.

1. A previous request P, whose prompt carries a sentinel, decodes in the decode pool until its answer
   shows the sentinel, and finishes. It reserved the whole pool; scrubbing is off there (fault
   `no_scrub`), so its K/V stays in the pages. The pages' checksums are taken while P still holds them.
2. An overlong request O arrives: too long for the prefill pool, short enough for the decode pool.
   Each guard can be switched off by fault injection:
   - `no_admission`: the API-side check (prompt + max_tokens <= min(window, every pool)) is skipped;
   - `placeholder_on_reject`: prefill refuses O internally and swaps in a 1-token placeholder; its
     handoff says REJECTED, expected len(O), transferred 1 (this substitution exists ONLY here: the
     production prefill path answers REJECTED with nothing taken or sent);
   - `no_handoff_check`: decode does not verify the verdict or the counts;
   - `no_ownership_guard` / `no_watermark_guard`: the read guard before attention is off.
   Decode then reserves pages for all of O (the FIFO free list hands it P's pages, in P's order),
   imports the placeholder page, believes len(O) tokens are cached and decodes.

Resources: both engines share the caller's already-built model weights (inference.engine.shared_model: the
worker's own, read-only), so a replay adds two small pools and its activations, no second model; `close()`
(or leaving `with`) drops the engines, and the caller hands the freed heap back (inference.memory).

The observable (deterministic, independent of what the model says): just before O's first decode step
its read record (`BlockManager.read_record`) is audited the way canaries audit live traffic, and every
page in O's attention range is compared byte for byte (page checksum) with the pages P left behind.
The leak is reproduced when O (a) completes with no violation and (b) attends to at least one page,
never written for O, whose bytes are exactly P's K/V. Whether O's text shows P's sentinel is reported
too, but not required: what a model says about stale K/V is not deterministic evidence.
"""
import re
import uuid
from dataclasses import asdict, dataclass, field

import torch

from inference import admission
from inference.allocator import CACHE_ENTRY_PREFIX, LocalAllocator
from inference.block_manager import OwnershipViolation
from inference.choices import choice_scope
from inference.engine import Engine, EngineConfig
from inference.faults import Faults
from inference.handoff import DecodeSide, Handoff, HandoffRefused, Verdict, handoff_accept
from inference.kv_cache import page_checksums
from inference.prefill import prefill_export, prefill_handoff, prefill_refusal
from inference.scheduler import RequestTooLarge
from inference.sequence import SamplingParams, SeqStatus
from inference.transport import LocalTransport

ALL_FAULTS = Faults({"no_scrub", "no_admission", "no_handoff_check", "no_ownership_guard", "no_watermark_guard",
                     "placeholder_on_reject"})
GUARD_FAULTS = ("no_ownership_guard", "no_watermark_guard")

# variant "reserve": decode reserves fresh pages for O (the incident). "stale_table": decode also reuses
# P's page-table entries (pages at P's epochs) instead of the epochs it was granted.
VARIANTS = ("reserve", "stale_table")


def audit_read_record(record: dict) -> list[dict]:
    """What is wrong with one read record (BlockManager.read_record): every page must be the reader's at
    the epoch it holds, and the reader may not have read more tokens than were written for it."""
    problems = []
    rid = record.get("request")
    shared, scope = record.get("shared") or 0, record.get("scope")
    # the prompt pages one of a request's n choices shares are its request's own scope's, recomputed here
    own_scope = choice_scope(record["choice_of"]) if record.get("choice_of") else None
    for i, (page, owner, epoch, page_epoch) in enumerate(zip(record.get("pages", []), record.get("owners", []),
                                                             record.get("epochs", []), record.get("page_epochs", []))):
        if i < shared and own_scope is not None and (scope != own_scope or owner != CACHE_ENTRY_PREFIX + own_scope):
            problems.append({"kind": "foreign_read", "page": page, "owner": owner})
        elif i < shared and own_scope is not None:
            if epoch != page_epoch:
                problems.append({"kind": "stale_epoch", "page": page, "reader_epoch": epoch, "page_epoch": page_epoch})
        elif owner != rid:
            problems.append({"kind": "foreign_read", "page": page, "owner": owner})
        elif epoch != page_epoch:
            problems.append({"kind": "stale_epoch", "page": page, "reader_epoch": epoch, "page_epoch": page_epoch})
    written = sum(record.get("written", []))
    if record.get("read_len", 0) > written:
        problems.append({"kind": "unwritten_read", "read_len": record.get("read_len"), "written": written})
    return problems


def normalize(text: str) -> str:
    return re.sub(r"[^0-9A-Z]", "", text.upper())


def sentinel_seen(text: str, sentinel: str) -> bool:
    """The sentinel, or any two of its consecutive groups, in `text` (case, spacing and dashes ignored)."""
    norm = normalize(text)
    groups = [normalize(g) for g in sentinel.split("-") if g]
    probes = {normalize(sentinel)} | {a + b for a, b in zip(groups, groups[1:])}
    return any(p and p in norm for p in probes)


@dataclass
class ReplayOutcome:
    scenario: str
    variant: str
    faults: list[str]
    stopped_by: str | None = None  # admission | handoff | guard | None (O ran to completion)
    refusal_kind: str | None = None  # context_length_exceeded | HandoffRefused.kind | Violation.kind
    reason: str = ""
    handoff: dict | None = None  # verdict, expected_tokens, transferred_tokens
    pages_taken: dict = field(default_factory=dict)  # pool -> pages held by O when it was stopped/finished
    read_record: dict | None = None
    audit: list[dict] = field(default_factory=list)
    stale_pages: list[int] = field(default_factory=list)  # in O's read range, unwritten for O, bytes == P's
    status: str | None = None
    output_tokens: int = 0
    output_text: str = ""
    previous_sentinel_in_output: bool = False

    @property
    def leaked(self) -> bool:
        return self.stopped_by is None and self.status == SeqStatus.FINISHED.value and bool(self.stale_pages)

    def to_dict(self) -> dict:
        return {**asdict(self), "leaked": self.leaked}


class IncidentReplay:
    """Sandbox prefill + decode engines, the previous request's leftovers, and `run(faults)` per scenario.

    P runs once (in `setup`); every scenario after it still finds P's K/V in the decode pool: a stopped
    scenario writes at most O's placeholder page (page 0, whose bytes then no longer match P's, so it never
    counts as stale), and the leaking one (run it last) writes only at O's own newest positions."""

    def __init__(self, model, *, sentinel: str, page_size: int = 16, prefill_pages: int = 4, decode_pages: int = 8,
                 overlong_max_tokens: int = 4, previous_max_steps: int = 24, key: bytes | None = None):
        self.model = model
        self.sentinel = sentinel
        self.page_size = page_size
        self.key = key or uuid.uuid4().hex.encode()
        tag = uuid.uuid4().hex[:6]
        self.prefill = Engine(model, EngineConfig(num_pages=prefill_pages, page_size=page_size, faults=Faults()),
                              allocator_factory=lambda n: LocalAllocator(n, f"sandbox-prefill-{tag}"))
        self.decode = Engine(model, EngineConfig(num_pages=decode_pages, page_size=page_size,
                                                 faults=Faults({"no_scrub", *GUARD_FAULTS})),
                             allocator_factory=lambda n: LocalAllocator(n, f"sandbox-decode-{tag}"))
        self.overlong_max_tokens = overlong_max_tokens
        self.previous_max_steps = previous_max_steps
        self.transport = LocalTransport()
        self.previous: dict = {}
        self.overlong_ids: list[int] = []

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def window(self) -> int:
        return self.decode.window

    @property
    def admission_limit(self) -> int:
        """What the API admits: the smallest pool's serving limit (inference.admission, as the registry has it)."""
        return admission.deployment_limit([self.prefill.effective_limit, self.decode.effective_limit])

    def pools(self) -> dict:
        return {"window": self.window, "prefill_capacity": self.prefill.capacity_tokens,
                "decode_capacity": self.decode.capacity_tokens, "page_size": self.page_size,
                "prefill_pool": self.prefill.block_manager.pool_id, "decode_pool": self.decode.block_manager.pool_id}

    # ---- the previous request ---------------------------------------------------------------
    def setup(self) -> dict:
        """Runs P in the decode pool (greedy) and finishes it; records the bytes it leaves behind."""
        tok = self.decode.tokenizer
        ids = tok.encode_chat([{"role": "user", "content": f"Repeat exactly: the secret code is {self.sentinel}"}])
        capacity = self.decode.capacity_tokens
        if len(ids) >= capacity:
            raise ValueError(f"previous request has {len(ids)} tokens; the sandbox decode pool holds {capacity}")
        # P holds the whole pool (prompt + max_tokens == capacity; taken up front, since an engine otherwise
        # gives pages as a sequence grows), so O is later handed P's pages in P's
        # order. It answers until its sentinel is out (or `previous_max_steps`); its pages' bytes are recorded
        # then, while it still holds them, and it finishes through the engine's own release (scrub by policy).
        params = SamplingParams(max_tokens=capacity - len(ids), temperature=0.0, seed=0, ignore_eos=True)
        rid = f"sandbox-previous-{uuid.uuid4().hex[:8]}"
        seq = self.decode.add_request(rid, ids, params)
        if not self.decode.block_manager.allocate(seq, self.decode.num_pages):  # held whole, as in the incident
            raise RuntimeError("sandbox: the decode pool is not empty before the previous request")
        for _ in range(self.previous_max_steps):
            self.decode.step()
            if seq.is_done or normalize(self.sentinel) in normalize(seq.text):
                break
        if seq.is_done or not seq.block_table:
            raise RuntimeError(f"sandbox: the previous request ended early ({seq.status.value}, {seq.error})")
        record = self.decode.block_manager.read_record(seq)
        pages = [p for p, w in zip(record["pages"], record["written"]) if w > 0]
        zero = page_checksums(torch.zeros_like(self.decode.pool.export_pages(pages[:1])))[0]
        sums = dict(zip(pages, page_checksums(self.decode.pool.export_pages(pages))))
        seq.status, seq.finish_reason = SeqStatus.FINISHED, "stop"
        self.decode.release(seq)
        self.decode.seqs.pop(rid, None)
        self.previous = {"request": rid, "prompt_tokens": len(ids), "output_tokens": len(seq.output_ids),
                         "text": seq.text, "sentinel_echoed": normalize(self.sentinel) in normalize(seq.text),
                         "pages": record["pages"], "epochs": record["epochs"], "written": record["written"],
                         "checksums": {p: c for p, c in sums.items() if c != zero}}
        if not self.previous["checksums"]:
            raise RuntimeError("sandbox: the previous request left no K/V in its pages")
        # O: longer than the prefill pool admits, within the decode pool (prompt + max_tokens == its capacity)
        n = capacity - self.overlong_max_tokens
        if n + self.overlong_max_tokens <= self.prefill.capacity_tokens:
            raise ValueError("sandbox: the overlong request must exceed the prefill pool")
        filler = tok.encode_chat([{"role": "user", "content": "Summarise this long report for me: " +
                                   "the quarterly figures were revised and the audit found nothing unusual. " * 40}])
        self.overlong_ids = (filler * (n // len(filler) + 1))[:n]
        return self.previous

    # ---- one scenario ---------------------------------------------------------------------------
    def run(self, faults: Faults, scenario: str, variant: str = "reserve") -> ReplayOutcome:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}")
        if not self.previous:
            self.setup()
        faults = Faults(faults)
        ids = self.overlong_ids
        params = SamplingParams(max_tokens=self.overlong_max_tokens, temperature=0.0, seed=0)
        rid = f"sandbox-overlong-{uuid.uuid4().hex[:8]}"
        out = ReplayOutcome(scenario=scenario, variant=variant, faults=sorted(faults))
        bm = self.decode.block_manager
        bm.check_owner = "no_ownership_guard" not in faults  # the guard, switched on or off for this scenario
        bm.check_watermark = "no_watermark_guard" not in faults
        try:
            # API admission
            refusal = admission.admission_error(len(ids), params.max_tokens, self.admission_limit)
            if "no_admission" not in faults and refusal:
                out.stopped_by, out.refusal_kind, out.reason = "admission", "context_length_exceeded", refusal
                return out
            # prefill
            handoff = self._prefill(rid, ids, params, faults)
            out.handoff = {"verdict": handoff.verdict.value, "expected_tokens": handoff.expected_tokens,
                           "transferred_tokens": handoff.transferred_tokens, "num_pages": handoff.num_pages}
            # decode: accept (the decode worker's own rule), then reserve and import
            side = DecodeSide(rid, len(ids), self.decode.fingerprint, self.decode.page_size, self.decode.kv_dtype,
                              page_shape=tuple(self.decode.pool.data.shape[1:]))
            try:
                handoff, blob = handoff_accept(handoff.to_dict(), self.key, side, self.transport.take,
                                               check="no_handoff_check" not in faults)
            except HandoffRefused as refused:
                out.stopped_by, out.refusal_kind, out.reason = "handoff", refused.kind, refused.reason
                return out
            seq = self.decode.add_prefilled(rid, ids, handoff.first_token, blob, params,
                                            num_transferred=handoff.transferred_tokens)
            if seq is None:
                raise RuntimeError("sandbox: the decode pool did not have room for the overlong request")
            out.pages_taken["decode"] = len(seq.block_table)
            if variant == "stale_table":  # decode keeps P's page-table entries: P's pages at P's epochs
                n = min(len(seq.block_table), len(self.previous["pages"]))
                seq.block_table[:n] = self.previous["pages"][:n]
                seq.page_epochs[:n] = self.previous["epochs"][:n]
            # the observable, taken just before the first decode step reads
            record = bm.read_record(seq)
            out.read_record = record
            out.audit = audit_read_record(record)
            out.stale_pages = self._stale_pages(record)
            violations_before = len(self.decode.violations)
            try:
                for _ in range(params.max_tokens + 1):
                    if seq.is_done:
                        break
                    self.decode.step()
            except Exception as exc:  # e.g. the ledger refusing to free pages at epochs that are not O's
                out.stopped_by, out.refusal_kind, out.reason = "error", type(exc).__name__, str(exc)
            new = self.decode.violations[violations_before:]
            if new:
                out.stopped_by, out.refusal_kind, out.reason = "guard", new[0].kind, str(OwnershipViolation(new[0]))
            out.status = seq.status.value
            out.output_tokens = len(seq.output_ids) if not new else 0
            out.output_text = seq.text
            out.previous_sentinel_in_output = sentinel_seen(seq.text, self.sentinel)
            return out
        finally:
            self.transport.discard(rid)
            self._cleanup(rid)

    def _prefill(self, rid: str, ids: list[int], params: SamplingParams, faults: Faults) -> Handoff:
        """The signed handoff, its KV (if any) sent through the sandbox's transport, by the production prefill
        stage (inference.prefill). An overlong prompt is REJECTED with nothing sent; under `placeholder_on_reject`
        its first token is prefilled instead and sent, and the handoff says REJECTED, 1 of len(ids)."""
        e, worker = self.prefill, self.prefill.block_manager.pool_id
        refused, prompt = None, ids
        try:
            seq = e.add_request(rid, ids, params, prefill_only=True)  # the worker's admission re-check
        except RequestTooLarge as exc:
            refused = prefill_refusal(e, rid, ids, worker, Verdict.REJECTED, str(exc))
            if "placeholder_on_reject" not in faults:
                return refused.signed(self.key)
            prompt = ids[:1]
            seq = e.add_request(rid, prompt, params, prefill_only=True)
        while not seq.is_done:
            e.step()
        if seq.status is not SeqStatus.PREFILLED:
            raise RuntimeError(f"sandbox prefill failed: {seq.error}")
        exported = prefill_export(e, seq)
        e.seqs.pop(rid, None)
        if refused is not None:
            handoff = prefill_handoff(e, rid, ids, worker, exported, verdict=Verdict.REJECTED, reason=refused.reason,
                                      transferred=len(prompt))
        else:
            handoff = prefill_handoff(e, rid, ids, worker, exported)
        handoff = handoff.signed(self.key)
        self.transport.send(handoff, exported.blob)
        return handoff

    def _stale_pages(self, record: dict) -> list[int]:
        """Pages in the reader's read range whose slots it needs were not written for it and whose bytes
        are exactly what the previous request left there."""
        ps, read_len = self.page_size, record["read_len"]
        previous = self.previous["checksums"]
        candidates = [(i, p) for i, p in enumerate(record["pages"])
                      if i * ps < read_len and record["written"][i] < min(ps, read_len - i * ps) and p in previous]
        if not candidates:
            return []
        sums = page_checksums(self.decode.pool.export_pages([p for _, p in candidates]))
        return [p for (_, p), s in zip(candidates, sums) if s == previous[p]]

    def _cleanup(self, rid: str) -> None:
        for engine in (self.prefill, self.decode):
            seq = engine.seqs.get(rid)
            if seq is not None and not seq.is_done:
                engine.abort(rid, "sandbox scenario over")
            if seq is not None:
                engine.scheduler.remove(seq)
            engine.seqs.pop(rid, None)
            engine.block_manager.forget(engine.block_manager.allocator.release(rid))
        self.decode.take_violations()

    def free_pages(self) -> dict:
        return {"prefill": self.prefill.block_manager.num_free(), "decode": self.decode.block_manager.num_free()}

    # ---- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Drops both engines (their pools, and their hold on the shared model), the transport's blobs and
        what P and O left; the replay cannot run again."""
        self.prefill = self.decode = self.transport = None
        self.previous, self.overlong_ids = {}, []

    def __enter__(self) -> "IncidentReplay":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

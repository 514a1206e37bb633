"""Continuous batching with pages on demand: every step runs one token for each decoding sequence plus
prefill chunks (up to `chunk_size` tokens in all), so a new request never waits for a batch to drain.

A sequence holds pages for what it has written plus the page it is writing. It is admitted with the pages
of what it prefills (its prompt; prompt + output so far when it resumes); each step the sequences about
to cross a page boundary grow together in one ledger call (`BlockManager.append_slots`). When the pool
cannot give them their pages, the most recently admitted sequence is preempted: its pages are freed and
scrubbed like a finished sequence's, and it goes back to the front of the queue to be recomputed (prefill
of its prompt and the tokens it had generated). Admission itself is unchanged: a request whose prompt +
max_tokens can never fit the pool is refused before any page is taken, so a sequence alone always fits.
New requests are picked round-robin across tenants (inference.fair_queue), FIFO within a tenant.

The probe reserve: while other sequences run, `probe_reserve_pages` pages are left free for canary-probe
requests (ids starting with inference.probes.CANARY_PROBE_PREFIX): admissions leave them free, and growth
that would take them preempts as a shortage does. A probe may take them, and never waits behind preempted
sequences, so the canary's valid handoff is judged on a worker whose pool is full (kvserve/probe_lane.py).
"""
from dataclasses import dataclass

from inference.block_manager import BlockManager
from inference.fair_queue import TenantQueues
from inference.probes import CANARY_PROBE_PREFIX
from inference.sequence import Sequence, SeqStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens fed this step, starting at seq.num_cached


class RequestTooLarge(Exception):
    """The request can never fit this engine (pool or window): refused before any page is taken."""


class Scheduler:
    def __init__(self, block_manager: BlockManager, chunk_size: int = 512, max_num_seqs: int = 64,
                 watermark_pages: int = 0, reserve_whole: bool = False, probe_reserve_pages: int = 0):
        self.block_manager = block_manager
        self.chunk_size = chunk_size
        self.max_num_seqs = max_num_seqs
        self.watermark_pages = watermark_pages  # free pages admission leaves for running sequences to grow into
        self.reserve_whole = reserve_whole  # bench.ondemand's baseline only: prompt + max_tokens at admission
        self.probe_reserve_pages = probe_reserve_pages  # free pages kept for canary probes while others run
        # round-robin across tenants, FIFO within one; a preempted sequence goes first (inference.fair_queue)
        self.waiting: TenantQueues[Sequence] = TenantQueues()
        # gives a waiting sequence its pages (False: not now); the prefix cache replaces it to reuse pages
        self.admit = lambda seq: block_manager.allocate(seq, self.pages_to_admit(seq, seq.num_tokens),
                                                        self.admission_keep_free(seq))
        self.active: list[Sequence] = []  # PREFILLING or RUNNING, in admission order
        self.preempted: list[Sequence] = []  # preempted by the last schedule() (the engine drops their rows)
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def add(self, seq: Sequence) -> None:
        num_pages = seq.num_pages_needed(self.block_manager.page_size)
        if num_pages > self.block_manager.pool.num_pages:
            raise RequestTooLarge(
                f"request {seq.request_id} needs {num_pages} pages; the pool has "
                f"{self.block_manager.pool.num_pages} (raise KVSERVE_NUM_PAGES or lower max_tokens)"
            )
        self.waiting.add(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose pages are already allocated and filled (imported from a handoff)."""
        seq.status = SeqStatus.RUNNING
        self.active.append(seq)

    # ---- page counts (the one place each rule lives) ----------------------------------------
    def pages_to_admit(self, seq: Sequence, num_tokens: int) -> int:
        """Pages a sequence is admitted with when it will have written `num_tokens` tokens."""
        if self.reserve_whole:
            return max(0, seq.num_pages_needed(self.block_manager.page_size) - len(seq.block_table))
        return self.block_manager.pages_short(seq, num_tokens)

    def admission_keep_free(self, seq: Sequence) -> int:
        """Free pages admitting `seq` must leave: the watermark and the probe reserve, unless nothing runs (a
        sequence alone fits); a probe may take them all."""
        return 0 if is_probe(seq) else self.watermark_pages + self.probe_reserve(self.active)

    def probe_reserve(self, others: list[Sequence]) -> int:
        """Pages kept free for probes beside `others`: none when nothing else runs, or only probes do."""
        return self.probe_reserve_pages if any(not is_probe(s) for s in others) else 0

    def growth_keep_free(self) -> int:
        """Free pages growth must leave: the probe reserve while two sequences that are no probes run (one
        alone always fits: growth then preempts down to it)."""
        return self.probe_reserve_pages if sum(not is_probe(s) for s in self.active) > 1 else 0

    def waits_for_preempted(self, seq: Sequence) -> bool:
        """Whether `seq` must wait for preempted sequences to resume first (a probe never does)."""
        return bool(self.waiting) and not is_probe(seq)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        self.preempted = []
        stalled = self._grow()
        chunks = []
        budget = self.chunk_size
        for seq in self.active:
            if seq.status is SeqStatus.RUNNING and seq not in stalled:
                chunks.append(ScheduledChunk(seq, 1))
        for seq in self.active:
            if seq.status is SeqStatus.PREFILLING and budget > 0:
                n = min(budget, seq.num_tokens - seq.num_cached)
                chunks.append(ScheduledChunk(seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.active) < self.max_num_seqs and not self.preempted:
            seq = self.waiting.peek()
            if not self.admit(seq):
                break  # does not fit now: it keeps its turn, nobody overtakes it (no starvation)
            self.waiting.pop_next()
            seq.status = SeqStatus.PREFILLING
            self.active.append(seq)
            n = min(budget, seq.num_tokens - seq.num_cached)  # a cached prefix is not computed again
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

    def _grow(self) -> set[Sequence]:
        """Gives every running sequence the page its next token goes to, in one ledger call, preempting the
        most recently admitted sequences until that fits. Returns the sequences that sit this step out:
        all of them when the ledger could not be reached (no shortage is known, so nobody is preempted
        for it), or those the ledger no longer lists as owners (lease lost; their worker fails them)."""
        while True:
            grows = [(s, n) for s in self.active if s.status is SeqStatus.RUNNING
                     and (n := self.block_manager.pages_short(s, s.num_cached + 1))]
            if not grows:
                return set()
            keep = self.growth_keep_free()
            fits = not keep or self.block_manager.can_append(grows, keep)
            if fits and self.block_manager.append_slots(grows):  # still short: its lease was lost (its worker fails it)
                return {s for s, _ in grows if self.block_manager.pages_short(s, s.num_cached + 1)}
            if fits and self.block_manager.can_append(grows):  # refused or unreachable: not a shortage
                return {s for s, _ in grows}
            self.preempt(self.active[-1])

    def preempt(self, seq: Sequence) -> None:
        """Frees `seq`'s pages (scrubbed, exactly as at a finish) and queues it first, to be recomputed."""
        self.active.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status, seq.num_cached = SeqStatus.WAITING, 0
        seq.num_preemptions += 1
        self.waiting.push_front(seq)
        self.preempted.append(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        if seq in self.active:
            self.active.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def finish(self, seq: Sequence) -> None:
        """Takes a done sequence out of the batch; frees its pages unless it awaits a handoff."""
        self.remove(seq)
        if seq.status is not SeqStatus.PREFILLED:
            self.block_manager.deallocate(seq)


def is_probe(seq: Sequence) -> bool:
    return seq.request_id.startswith(CANARY_PROBE_PREFIX)

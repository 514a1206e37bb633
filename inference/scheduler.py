"""Continuous batching with pages on demand: every step runs one token for each decoding sequence plus
prefill chunks (up to `chunk_size` tokens in all), so a new request never waits for a batch to drain.

A sequence holds pages for what it has written plus the page it is writing. It is admitted with the pages
of what it prefills (its prompt; prompt + output so far when it resumes); each step the sequences about
to cross a page boundary grow together in one ledger call (`BlockManager.append_slots`). When the pool
cannot give them their pages, a sequence is preempted: the most recently admitted one of the tenant holding
the most pages (the one most over its share; a tenant alone loses its newest). Its pages are freed and
scrubbed like a finished sequence's, and it goes back to the front of its tenant's queue to be recomputed
(prefill of its prompt and the tokens it had generated). A request whose prompt + max_tokens can never fit
the pool is refused before any page is taken, so a sequence alone always fits.

Fair across tenants, work-conserving: a waiting request is picked from the tenant holding the fewest pages
(round-robin between equals, inference.fair_queue; FIFO within a tenant), a step's prefill budget goes to
that tenant first, and a tenant under its share of slots or pages preempts one over its own. So a tenant
alone uses every slot and page, and another one's request is not queued behind its prompts. A head
that does not fit the pages free now keeps its turn, but does not hold back smaller requests forever:
others that fit may pass it, taking at most as many pages in all as the head needs (bounded bypass); then
nothing passes it until it is admitted, so it is not starved either.

The probe reserve: while other sequences run, `probe_reserve_pages` pages are left free for canary-probe
requests (ids starting with inference.probes.CANARY_PROBE_PREFIX): admissions leave them free, and growth
that would take them preempts as a shortage does. A probe may take them, and never waits behind preempted
sequences, so the canary's valid handoff is judged on a worker whose pool is full (kvserve/probe_lane.py).
"""
from collections import Counter, deque
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
        self.blocked: Sequence | None = None  # the waiting head that did not fit, and the pages admitted past it
        self.bypassed_pages = 0
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
        """Whether `seq` must wait for preempted sequences to resume first: those of a tenant holding no more
        pages than its own, as the waiting queue would pick them (a probe never waits)."""
        if not self.waiting or is_probe(seq):
            return False
        held = self.pages_held_by_tenant()
        return min(held[t] for t in self.waiting.tenants()) <= held[seq.tenant]

    def pages_held_by_tenant(self) -> Counter:
        """tenant -> pages its admitted sequences hold (a shared prefix page counts for each reader)."""
        held = Counter()
        for seq in reversed(self.active):  # newest first: a tie goes to the tenant admitted last
            held[seq.tenant] += len(seq.block_table)
        return held

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        self.preempted = []
        stalled = self._grow()
        self._preempt_for_waiting()
        decodes = [ScheduledChunk(seq, 1) for seq in self.active
                   if seq.status is SeqStatus.RUNNING and seq not in stalled]
        return decodes + self._prefill_chunks()

    def _prefill_chunks(self) -> list[ScheduledChunk]:
        """Shares the step's prefill budget between prefilling sequences and waiting ones (admitted as it
        goes), the tenant holding the fewest pages first; a tie keeps a prefill in progress first, and
        admission order within a tenant."""
        held = self.pages_held_by_tenant()
        prefilling = deque(sorted((s for s in self.active if s.status is SeqStatus.PREFILLING),
                                  key=lambda s: held[s.tenant]))
        chunks, budget, admitting = [], self.chunk_size, True
        while budget > 0:
            admitting = admitting and self._may_admit()
            if prefilling and not (admitting and held[self._head(held).tenant] < held[prefilling[0].tenant]):
                seq = prefilling.popleft()
            elif admitting:
                seq = self._admit_next(held)
                if seq is None:
                    admitting = False
                    continue
                seq.status = SeqStatus.PREFILLING
                self.active.append(seq)
                held[seq.tenant] += len(seq.block_table)
            else:
                break
            n = min(budget, seq.num_tokens - seq.num_cached)  # a cached prefix is not computed again
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

    def _may_admit(self) -> bool:
        return bool(self.waiting) and len(self.active) < self.max_num_seqs and not self.preempted

    def _head(self, held: Counter) -> Sequence:
        """The waiting sequence offered next: a head that did not fit keeps that place until it is admitted;
        otherwise the head of the waiting tenant holding the fewest pages (round-robin between equals)."""
        if self.blocked is not None and self.blocked in self.waiting:
            return self.blocked
        return self.waiting.peek(held.__getitem__)

    def _admit_next(self, held: Counter) -> Sequence | None:
        """Takes the head with its pages, or, when it does not fit now, a later sequence that fits, while the
        pages admitted past this head stay within what the head needs (bounded bypass); None when nothing
        may be admitted now."""
        head = self._head(held)
        if self.admit(head):
            self.waiting.pop(head)
            self.blocked = None
            return head
        if self.blocked is not head:
            self.blocked, self.bypassed_pages = head, 0
        allowance = self.pages_to_admit(head, head.num_tokens) - self.bypassed_pages
        for seq in self.waiting.behind(head):
            num_pages = self.pages_to_admit(seq, seq.num_tokens)
            if num_pages <= allowance and self.admit(seq):
                self.waiting.pop(seq)
                self.bypassed_pages += num_pages
                return seq
        return None

    def _grow(self) -> set[Sequence]:
        """Gives every running sequence the page its next token goes to, in one ledger call, preempting
        (`victim`) until that fits. Returns the sequences that sit this step out:
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
            self.preempt(self.victim())

    def _preempt_for_waiting(self) -> None:
        """Work-conserving shares: a tenant alone may fill every slot and page, so when another tenant's head
        waits for a slot, or did not fit the pages last step, while its tenant is under its share and another
        tenant is over its own (the slots and the pool split evenly between the tenants running or waiting),
        that tenant's newest sequences are preempted until the head is admitted."""
        held = self.pages_held_by_tenant()
        if self.blocked is not None and self.blocked in self.waiting:
            head = self.blocked
        elif self.waiting and len(self.active) >= self.max_num_seqs:
            head = self._head(held)
        else:
            return
        while True:
            if len(self.active) < self.max_num_seqs and self.admit(head):
                break
            victim = self._over_share_victim(head)
            if victim is None:
                return
            self.preempt(victim)
        self.waiting.pop(head)
        self.blocked = None
        head.status = SeqStatus.PREFILLING
        self.active.append(head)

    def _over_share_victim(self, head: Sequence) -> Sequence | None:
        """The newest sequence of the tenant most over its share of what `head` waits for (a slot, or pages),
        or None when `head`'s tenant would pass its own share or no other tenant is over its."""
        tenants = {s.tenant for s in self.active} | set(self.waiting.tenants())
        if len(self.active) >= self.max_num_seqs:
            usage, share, need = Counter(s.tenant for s in self.active), self.max_num_seqs / len(tenants), 1
        else:
            usage, share = self.pages_held_by_tenant(), self.block_manager.pool.num_pages / len(tenants)
            need = self.pages_to_admit(head, head.num_tokens)
        if usage[head.tenant] + need > share:
            return None
        over = [t for t in usage if t != head.tenant and usage[t] > share]
        if not over:
            return None
        return self._newest_of(max(over, key=usage.__getitem__))

    def victim(self) -> Sequence:
        """The sequence a shortage preempts: the most recently admitted of the tenant holding the most pages
        (shares are equal, so the one most over its share)."""
        held = self.pages_held_by_tenant()
        return self._newest_of(max(held, key=held.__getitem__))

    def _newest_of(self, tenant) -> Sequence:
        return next(s for s in reversed(self.active) if s.tenant == tenant)

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

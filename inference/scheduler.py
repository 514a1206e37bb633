"""Continuous batching: every step runs one token for each decoding sequence plus prefill chunks
(up to `chunk_size` prompt tokens in all), so a new request never waits for a batch to drain.

A request's pages are reserved whole (prompt + max_tokens) when it is admitted to the batch: it
then never needs preemption. One that does not fit now waits; one that can never fit is refused.
"""
from collections import deque
from dataclasses import dataclass

from inference.block_manager import BlockManager
from inference.sequence import Sequence, SeqStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens fed this step, starting at seq.num_cached


class RequestTooLarge(Exception):
    """The request can never fit this engine (pool or window): refused before any page is taken."""


class Scheduler:
    def __init__(self, block_manager: BlockManager, chunk_size: int = 512, max_num_seqs: int = 64):
        self.block_manager = block_manager
        self.chunk_size = chunk_size
        self.max_num_seqs = max_num_seqs
        # gives a waiting sequence its pages (False: not now); the prefix cache replaces it to reuse pages
        self.admit = lambda seq: block_manager.allocate(seq, seq.num_pages_needed(block_manager.page_size))
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []  # PREFILLING or RUNNING, in admission order

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
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose pages are already allocated and filled (imported from a handoff)."""
        seq.status = SeqStatus.RUNNING
        self.active.append(seq)

    def schedule(self) -> list[ScheduledChunk]:
        chunks = []
        budget = self.chunk_size
        for seq in self.active:
            if seq.status is SeqStatus.RUNNING:
                chunks.append(ScheduledChunk(seq, 1))
        for seq in self.active:
            if seq.status is SeqStatus.PREFILLING and budget > 0:
                n = min(budget, seq.num_prompt_tokens - seq.num_cached)
                chunks.append(ScheduledChunk(seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.active) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.admit(seq):
                break  # does not fit now: it waits, and so does everything behind it (FIFO)
            self.waiting.popleft()
            seq.status = SeqStatus.PREFILLING
            self.active.append(seq)
            n = min(budget, seq.num_prompt_tokens - seq.num_cached)  # a cached prefix is not computed again
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

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

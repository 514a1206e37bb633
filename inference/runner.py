"""Builds a step's model inputs: token ids, positions, KV write slots and the `AttentionBatch`.

`BlockTables` owns the device-side copy of every live sequence's block table: one int32 row per
sequence, grown (rows and width) as sequences and their tables grow. A row is compared with
`seq.block_table` (the list the ownership guard checks) every step and rewritten where it differs,
so what attention reads is always exactly what the guard passed.
"""
import torch

from inference.attention import AttentionBatch, PrefillSlice, SeqBatch
from inference.kv_cache import PagePool, cdiv
from inference.sequence import Sequence


class BlockTables:
    def __init__(self, null_page: int, device, rows: int = 64, width: int = 64):
        self.null_page = null_page
        self.device = device
        self.table = torch.full((rows, width), null_page, dtype=torch.int32, device=device)
        self.row_of: dict[str, int] = {}
        self.mirror: list[list[int]] = [[] for _ in range(rows)]  # what each row holds, as a list
        self.free_rows = list(range(rows - 1, -1, -1))

    def _grow(self, rows: int, width: int) -> None:
        old = self.table
        rows, width = max(rows, old.shape[0]), max(width, old.shape[1])
        self.table = torch.full((rows, width), self.null_page, dtype=torch.int32, device=self.device)
        self.table[: old.shape[0], : old.shape[1]] = old
        self.free_rows = list(range(rows - 1, old.shape[0] - 1, -1)) + self.free_rows
        self.mirror += [[] for _ in range(rows - old.shape[0])]

    def row(self, seq: Sequence) -> int:
        """seq's row, synced with its block table."""
        r = self.row_of.get(seq.request_id)
        if r is None:
            if not self.free_rows:
                self._grow(2 * self.table.shape[0], 0)
            r = self.row_of[seq.request_id] = self.free_rows.pop()
        pages, held = seq.block_table, self.mirror[r]
        if pages != held:
            if len(pages) > self.table.shape[1]:
                self._grow(0, max(len(pages), 2 * self.table.shape[1]))
            keep = len(held) if len(pages) >= len(held) and pages[: len(held)] == held else 0
            if keep < len(held) or len(pages) < len(held):
                self.table[r].fill_(self.null_page)
            self.table[r, keep: len(pages)] = torch.tensor(pages[keep:], dtype=torch.int32)
            self.mirror[r] = list(pages)
        return r

    def release(self, seq: Sequence) -> None:
        r = self.row_of.pop(seq.request_id, None)
        if r is not None:
            self.table[r].fill_(self.null_page)
            self.mirror[r] = []
            self.free_rows.append(r)


class StepBuilder:
    """Turns the scheduled chunks into tensors with a few tensor ops per step (no per-token loop)."""

    def __init__(self, pool: PagePool, fresh_reads_pool: bool = False):
        self.pool = pool
        self.page_size = pool.page_size
        self.device = pool.data.device
        self.tables = BlockTables(pool.null_page, self.device)
        self.fresh_reads_pool = fresh_reads_pool  # xformers: every sequence in one call over the pool

    def release(self, seq: Sequence) -> None:
        self.tables.release(seq)

    def build(self, chunks):
        """-> input_ids [T], positions [T], AttentionBatch, sample_rows {request_id: row}."""
        ps, dev = self.page_size, self.device
        ids, rows, starts, counts, ctxs, qstarts, fresh = [], [], [], [], [], [], []
        sample_rows = {}
        t = 0
        for chunk in chunks:
            seq, start, n = chunk.seq, chunk.seq.num_cached, chunk.num_tokens
            ids += seq.token_slice(start, start + n)
            rows.append(self.tables.row(seq))
            starts.append(start)
            counts.append(n)
            ctxs.append(start + n)
            qstarts.append(t)
            fresh.append(start == 0 and not self.fresh_reads_pool)
            t += n
            sample_rows[seq.request_id] = t - 1
        s = len(chunks)
        width = cdiv(max(ctxs), ps)
        tables = self.tables.table.index_select(0, torch.tensor(rows, device=dev))[:, :width]
        ctx_t = torch.tensor(ctxs, dtype=torch.int32, device=dev)
        # pages past a sequence's context are its own, but read as the null page (exactly as much as it needs)
        used = torch.arange(width, dtype=torch.int32, device=dev)[None, :] < cdiv(ctx_t, ps)[:, None]
        tables = torch.where(used, tables, self.pool.null_page).to(torch.int32)
        if t == s:  # every chunk is one token (a pure decode step)
            positions = torch.tensor(starts, device=dev)
            token_seq = torch.arange(s, device=dev)
        else:
            n_t = torch.tensor(counts, device=dev)
            token_seq = torch.repeat_interleave(torch.arange(s, device=dev), n_t)
            first_row = torch.tensor(qstarts, device=dev)
            positions = (torch.tensor(starts, device=dev) - first_row)[token_seq] + torch.arange(t, device=dev)
        slot_pages = tables[token_seq, positions // ps].long()
        batch = AttentionBatch(slot_pages, positions % ps, page_size=ps, null_page=self.pool.null_page)
        paged = [i for i in range(s) if not fresh[i]]
        batch.fresh = [PrefillSlice(qstarts[i], counts[i]) for i in range(s) if fresh[i]]
        if paged:
            if len(paged) < s:
                idx = torch.tensor(paged, device=dev)
                tables, ctx_t = tables.index_select(0, idx), ctx_t.index_select(0, idx)
            lens, qs, qn = [ctxs[i] for i in paged], [qstarts[i] for i in paged], [counts[i] for i in paged]
            batch.paged = SeqBatch(tables.contiguous(), ctx_t, torch.tensor(qs, dtype=torch.int32, device=dev),
                                   torch.tensor(qn, dtype=torch.int32, device=dev), lens, qs, qn)
        return torch.tensor(ids, device=dev), positions, batch, sample_rows


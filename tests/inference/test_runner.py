"""The step builder: device-side block tables stay exactly the sequences' tables (grown, edited in
place, shrunk), and the step's positions and KV write slots equal the per-token rule."""
import random

import torch

from inference.kv_cache import PagePool
from inference.runner import BlockTables, StepBuilder
from inference.scheduler import ScheduledChunk
from inference.sequence import SamplingParams, Sequence


def seq(rid, prompt_len=5, pages=()):
    s = Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4, seed=0))
    s.block_table = list(pages)
    return s


def test_rows_follow_growth_edits_and_shrinking_and_grow_past_their_size():
    bt = BlockTables(null_page=999, device="cpu", rows=2, width=2)
    a, b, c = seq("a", pages=[3]), seq("b", pages=[4, 5]), seq("c", pages=[])
    for s in (a, b, c):  # a third sequence: rows double
        r = bt.row(s)
        assert bt.table[r, : len(s.block_table)].tolist() == s.block_table
    a.block_table += [7, 8, 9]  # growth past the width
    c.block_table[:] = [1]
    b.block_table[0] = 6  # an in-place edit (the guard checks this list: attention must read the same)
    for s in (a, b, c):
        r = bt.row(s)
        row = bt.table[r].tolist()
        assert row[: len(s.block_table)] == s.block_table and set(row[len(s.block_table):]) <= {999}
    a.block_table = [2]  # shrunk: the rest of the row is the null page again
    r = bt.row(a)
    assert bt.table[r].tolist() == [2] + [999] * (bt.table.shape[1] - 1)
    bt.release(a)
    r = bt.row(seq("d", pages=[]))
    assert "a" not in bt.row_of and set(bt.table[r].tolist()) == {999}


def test_positions_slots_and_tables_equal_the_per_token_rule():
    rng = random.Random(0)
    pool = PagePool(64, 4, 1, 1, 8)
    builder = StepBuilder(pool)
    free = list(range(64))
    rng.shuffle(free)
    chunks = []
    for i, (past, n) in enumerate([(0, 7), (9, 1), (5, 3), (0, 2), (13, 1)]):
        s = seq(f"s{i}", prompt_len=past + n + 2, pages=[free.pop() for _ in range((past + n + 2 + 3) // 4)])
        s.num_cached = past
        chunks.append(ScheduledChunk(s, n))
    ids, pos, batch, sample_rows = builder.build(chunks)
    want_ids, want_pos, want_pages, want_offsets = [], [], [], []
    for c in chunks:
        for p in range(c.seq.num_cached, c.seq.num_cached + c.num_tokens):
            want_ids.append(c.seq.token_at(p))
            want_pos.append(p)
            want_pages.append(c.seq.block_table[p // 4])
            want_offsets.append(p % 4)
    assert ids.tolist() == want_ids and pos.tolist() == want_pos
    assert batch.slot_pages.tolist() == want_pages and batch.slot_offsets.tolist() == want_offsets
    assert [(f.row_start, f.num_rows) for f in batch.fresh] == [(0, 7), (11, 2)]
    sb = batch.paged
    assert sb.lens == [10, 8, 14] and sb.starts == [7, 8, 13] and sb.qlens == [1, 3, 1]
    for row, c in zip(sb.tables.tolist(), [chunks[1], chunks[2], chunks[4]]):
        used = (c.seq.num_cached + c.num_tokens + 3) // 4
        assert row[:used] == c.seq.block_table[:used] and set(row[used:]) <= {pool.null_page}
    assert sample_rows == {"s0": 6, "s1": 7, "s2": 10, "s3": 12, "s4": 13}
    assert torch.equal(sb.context_lens, torch.tensor(sb.lens, dtype=torch.int32))

"""InputBatch: each decoding sequence's row of the block table, written once, then grown."""

from __future__ import annotations

import torch

from engine import SamplingParams
from engine.core.sequence import Sequence
from engine.executor.input_batch import InputBatch


def _seq(request_id: str, blocks: list[int]) -> Sequence:
    seq = Sequence(request_id, [1, 2, 3], 3, SamplingParams(), 0)
    seq.block_table = list(blocks)
    return seq


def _row(batch: InputBatch, row: int, n: int) -> list[int]:
    return batch.block_tables[row, :n].tolist()


def test_rows_hold_each_sequence_s_blocks_and_grow_with_them() -> None:
    batch = InputBatch(num_rows=2, num_cols=2)
    a, b = _seq("a", [5, 6]), _seq("b", [9])
    rows = batch.rows([a, b])
    assert len(set(rows)) == 2
    assert [_row(batch, rows[0], 2), _row(batch, rows[1], 1)] == [[5, 6], [9]]
    a.block_table += [7, 8, 11]  # more columns than the table had: it widens
    b.block_table.append(3)
    assert batch.rows([a, b]) == rows
    assert [_row(batch, rows[0], 5), _row(batch, rows[1], 2)] == [[5, 6, 7, 8, 11], [9, 3]]


def test_a_new_block_list_is_written_whole() -> None:
    """Preempted and admitted again, or sharing cached blocks: a new list, rewritten."""
    batch = InputBatch()
    a = _seq("a", [5, 6, 7])
    [row] = batch.rows([a])
    a.block_table = [40, 41]
    assert batch.rows([a]) == [row]
    assert _row(batch, row, 2) == [40, 41]


def test_released_rows_serve_other_sequences_and_more_rows_come_on_demand() -> None:
    batch = InputBatch(num_rows=1)
    a = _seq("a", [1])
    [row_a] = batch.rows([a])
    batch.release(["a", "never-seen"])
    b, c = _seq("b", [2]), _seq("c", [3, 4])
    rows = batch.rows([b, c])
    assert rows[0] == row_a and batch.block_tables.shape[0] >= 2
    assert [_row(batch, rows[0], 1), _row(batch, rows[1], 2)] == [[2], [3, 4]]


def test_a_reused_request_id_gets_its_own_row_contents() -> None:
    batch = InputBatch()
    old = _seq("r", [1, 2, 3])
    batch.rows([old])
    new = _seq("r", [8])  # the old one's release has not come yet
    [row] = batch.rows([new])
    assert _row(batch, row, 1) == [8]
    assert batch.block_tables.dtype == torch.long

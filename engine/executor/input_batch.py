"""InputBatch: the running sequences' block tables, kept between steps.

Every step used to rebuild each decoding sequence's block table, padded to the longest, from
Python lists (150 us a step at batch 32 on a 2-core EPYC). Here each running sequence (a
prefill's too: the attention kernel reads every query's blocks through this table) owns a
row of one preallocated table, as in vLLM v1's InputBatch / BlockTable: a row is written
whole once, then gains only the blocks its sequence gained, and a decode group's tables are
one index of its rows (18 us at batch 32); the kernel reads the table itself. Slots stay a
Python list: one tensor from a list beats a vectorized gather at these batch sizes on CPU
(10 vs 37 us at batch 32). A row is given back when its sequence finishes or is preempted
(`release`, from the scheduler's output); a recomputed or re-admitted sequence is written
whole again.

Table entries past a row's own blocks hold zeros or an earlier sequence's ids: attention
never reads them (the kernel stops at each query's position, the torch path masks them), and
every id in the table names a block that was handed out, so zeroed, at least once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.core.sequence import Sequence


class InputBatch:
    """Engine-thread only (the runner's). Grows its table as rows or blocks demand."""

    def __init__(self, num_rows: int = 8, num_cols: int = 64) -> None:
        self.block_tables = torch.zeros(num_rows, num_cols, dtype=torch.long)  # CPU, [rows, cols]
        self._row_of: dict[str, int] = {}  # request id -> its row
        self._seq: list[Sequence | None] = [None] * num_rows  # the sequence each row holds
        self._table: list[list[int] | None] = [None] * num_rows  # its block_table, as written
        self._num_written = [0] * num_rows  # how many of its blocks the row holds
        self._free = list(range(num_rows - 1, -1, -1))

    def release(self, request_ids: Iterable[str]) -> None:
        """Give back the rows of sequences that finished or were preempted."""
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._seq[row] = self._table[row] = None
                self._free.append(row)

    def rows(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's row, its table brought up to date with its block_table."""
        return [self._sync(seq) for seq in seqs]

    def _sync(self, seq: Sequence) -> int:
        row = self._row_of.get(seq.request_id)
        if row is None or self._seq[row] is not seq:
            if row is not None:  # the id was reused before the old holder's release came
                self.release([seq.request_id])
            row = self._take_row(seq)
        table, written = seq.block_table, self._num_written[row]
        if self._table[row] is not table or written > len(table):  # a new list: write it all
            written = 0
        if len(table) > written:
            self._ensure_cols(len(table))
            self.block_tables[row, written : len(table)] = torch.tensor(
                table[written:], dtype=torch.long
            )
        self._table[row], self._num_written[row] = table, len(table)
        return row

    def _take_row(self, seq: Sequence) -> int:
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self._row_of[seq.request_id] = row
        self._seq[row] = seq
        self._table[row] = None
        self._num_written[row] = 0
        return row

    def _grow_rows(self) -> None:
        old = self.block_tables.shape[0]
        grown = torch.zeros(2 * old, self.block_tables.shape[1], dtype=torch.long)
        grown[:old] = self.block_tables
        self.block_tables = grown
        self._seq += [None] * old
        self._table += [None] * old
        self._num_written += [0] * old
        self._free += range(2 * old - 1, old - 1, -1)

    def _ensure_cols(self, num_cols: int) -> None:
        cols = self.block_tables.shape[1]
        if num_cols <= cols:
            return
        while cols < num_cols:
            cols *= 2
        grown = torch.zeros(self.block_tables.shape[0], cols, dtype=torch.long)
        grown[:, : self.block_tables.shape[1]] = self.block_tables
        self.block_tables = grown

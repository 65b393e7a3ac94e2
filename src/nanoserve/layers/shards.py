"""The shard arithmetic of tensor parallelism: which rows of a dimension each rank holds.

Introduced in stage 09 (task 1 of its lesson). `shard_range` is the one rule for cutting a
dimension into equal slices, and refuses a size that does not divide it; `padded_shard_range`
is the rule for the vocabulary, which need not divide, so the last rank's tail is padding. Plain
integer arithmetic: no tensors, no process group.

    12 items, size 2:  rank 0 [0, 6)   rank 1 [6, 12)
    5 ids, size 2:     rank 0 [0, 3)   rank 1 [3, 5) + 1 padding row   (3 rows each)
"""

from __future__ import annotations


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's equal slice of total items; ValueError if size does not divide it.

    12 items over 2 ranks: rank 0 owns 0..5, rank 1 owns 6..11 -> (0, 6) and (6, 12).
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    if total % size:
        raise ValueError(f"{total} items do not split evenly over {size} ranks")
    share = total // size
    return rank * share, (rank + 1) * share


def padded_shard_range(total: int, rank: int, size: int) -> tuple[int, int, int]:
    """(start, end, rows) for a dimension that need not divide: every rank holds `rows` =
    ceil(total / size) rows, of which [start, end) are real and the rest is zero padding.

    A vocabulary of 5 over 2 ranks: rank 0 holds ids 0..2, rank 1 ids 3..4 plus one padding row
    -> (0, 3, 3) and (3, 5, 3).
    """
    rows = -(-total // size)
    start = min(total, rank * rows)
    return start, min(total, start + rows), rows

"""Sudoku's solver: every solution of a board, up to a limit (task generation keeps a puzzle's
solution unique with it)."""

from __future__ import annotations

import math

import numpy as np


def solutions(
    cells: list[int], n: int, limit: int, rng: np.random.Generator | None = None
) -> list[list[int]]:
    """Up to `limit` solutions of a flat board (0 = empty); `rng` randomizes the digit order.

    Backtracking over bitmasks, always branching on the cell with the fewest candidates.
    """
    box = math.isqrt(n)
    full = (1 << (n + 1)) - 2  # bits 1..n
    rows, cols, boxes = [0] * n, [0] * n, [0] * n
    empty: list[tuple[int, int, int, int]] = []
    for i, v in enumerate(cells):
        r, c = divmod(i, n)
        b = r // box * box + c // box
        if v:
            bit = 1 << v
            if (rows[r] | cols[c] | boxes[b]) & bit:
                return []
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
        else:
            empty.append((i, r, c, b))
    work, found = list(cells), []

    def search(k: int) -> bool:  # cells empty[k:] are unfilled; True = stop
        if k == len(empty):
            found.append(list(work))
            return len(found) >= limit
        best, best_mask, best_count = k, 0, n + 1
        for j in range(k, len(empty)):
            _, r, c, b = empty[j]
            mask = full & ~(rows[r] | cols[c] | boxes[b])
            count = mask.bit_count()
            if count < best_count:
                best, best_mask, best_count = j, mask, count
                if count <= 1:
                    break
        if best_count == 0:
            return False
        empty[k], empty[best] = empty[best], empty[k]
        i, r, c, b = empty[k]
        digits = [d for d in range(1, n + 1) if best_mask >> d & 1]
        if rng is not None:
            digits = [digits[j] for j in rng.permutation(len(digits))]
        for d in digits:
            bit = 1 << d
            work[i] = d
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            stop = search(k + 1)
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[b] ^= bit
            work[i] = 0
            if stop:
                return True
        return False

    search(0)
    return found

"""Mutant of exercise 141: the chunks are cut from the end of the row, so the FIRST one is the short one."""

EXPECTED_HINT = "yours were cut from the end of the row"

import torch

CHUNK = 64


def _tree(sums, lo, hi):
    if hi - lo == 1:
        return sums[lo]
    mid = lo + (hi - lo + 1) // 2
    return _tree(sums, lo, mid) + _tree(sums, mid, hi)


def row_sums(x):
    m, k = x.shape
    first = k % CHUNK or CHUNK  # MUTANT: the first chunk takes the remainder, the others are full
    bounds = [0] + list(range(first, k + 1, CHUNK))
    sums = []
    for a, b in zip(bounds, bounds[1:]):
        s = torch.zeros(m, dtype=torch.float32)
        for j in range(a, b):
            s = s + x[:, j]
        sums.append(s)
    return _tree(sums, 0, len(sums))

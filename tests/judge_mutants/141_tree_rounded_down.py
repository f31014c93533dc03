"""Mutant of exercise 141: the tree over the chunk sums splits at its first half rounded down."""

EXPECTED_HINT = "ROUNDED UP and the rest (3 chunks: (c0 + c1) + c2"

import torch

CHUNK = 64


def _tree(sums, lo, hi):
    if hi - lo == 1:
        return sums[lo]
    mid = lo + (hi - lo) // 2  # MUTANT: rounded down
    return _tree(sums, lo, mid) + _tree(sums, mid, hi)


def row_sums(x):
    m, k = x.shape
    sums = []
    for a in range(0, k, CHUNK):
        s = torch.zeros(m, dtype=torch.float32)
        for j in range(a, min(a + CHUNK, k)):
            s = s + x[:, j]
        sums.append(s)
    return _tree(sums, 0, len(sums))

"""Mutant of exercise 141: split-K chosen by the batch size: longer chunks for big batches (fewer, longer
chains, as a tuned kernel would pick), so a row's bits change with the rows beside it."""

EXPECTED_HINT = "batch invariance: a row's sum must not depend on how many rows are in the batch"

import torch

CHUNK = 64


def _tree(sums, lo, hi):
    if hi - lo == 1:
        return sums[lo]
    mid = lo + (hi - lo + 1) // 2
    return _tree(sums, lo, mid) + _tree(sums, mid, hi)


def row_sums(x):
    m, k = x.shape
    chunk = CHUNK if m < 8 else 2 * CHUNK  # MUTANT: the chunk follows M
    sums = []
    for a in range(0, k, chunk):
        s = torch.zeros(m, dtype=torch.float32)
        for j in range(a, min(a + chunk, k)):
            s = s + x[:, j]
        sums.append(s)
    return _tree(sums, 0, len(sums))

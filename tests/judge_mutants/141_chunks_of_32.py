"""Mutant of exercise 141: chunks of 32 columns (a SIMD width in mind), not 64."""

EXPECTED_HINT = "chunks of 32 columns: CHUNK = 64"

import torch

CHUNK = 32  # MUTANT: the wrong chunk


def _tree(sums, lo, hi):
    if hi - lo == 1:
        return sums[lo]
    mid = lo + (hi - lo + 1) // 2
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

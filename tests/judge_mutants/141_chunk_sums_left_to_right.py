"""Mutant of exercise 141: the chunk sums are added one after the other instead of in the tree."""

EXPECTED_HINT = "the chunk sums were added left to right"

import torch

CHUNK = 64


def row_sums(x):
    m, k = x.shape
    total = None
    for a in range(0, k, CHUNK):
        s = torch.zeros(m, dtype=torch.float32)
        for j in range(a, min(a + CHUNK, k)):
            s = s + x[:, j]
        total = s if total is None else total + s  # MUTANT: left to right, no tree
    return total

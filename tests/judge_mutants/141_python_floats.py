"""Mutant of exercise 141: the statement's s = 0.0; s = s + v taken literally, in Python floats (float64),
rounded to float32 at the end."""

EXPECTED_HINT = "your sums were added in float64"

import torch

CHUNK = 64


def _tree(sums, lo, hi):
    if hi - lo == 1:
        return sums[lo]
    mid = lo + (hi - lo + 1) // 2
    return _tree(sums, lo, mid) + _tree(sums, mid, hi)


def row_sums(x):
    out = []
    for row in x.tolist():
        sums = []
        for a in range(0, len(row), CHUNK):
            s = 0.0
            for v in row[a:a + CHUNK]:
                s = s + v  # MUTANT: Python floats are float64
            sums.append(s)
        out.append(_tree(sums, 0, len(sums)))
    return torch.tensor(out, dtype=torch.float32)

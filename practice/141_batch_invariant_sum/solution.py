"""Exercise 141: a row sum whose bits do not depend on the batch. Edit this file, then run

    python practice/judge.py 141

The statement is in README.md. x is (M, K) float32, contiguous or not; return the (M,) float32 sums,
each row's in one fixed order that depends on K only: chunks of CHUNK columns from column 0 (the last
may be shorter), each added left to right in float32, then the chunk sums in exercise 139's tree.
Do not reduce with torch.sum, x.sum or a matmul (they choose their own order), and leave x unchanged.
"""

import torch

CHUNK = 64  # columns per chunk


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum, (M,) float32: the chunks' sums left to right, then the chunk sums in the tree."""
    raise NotImplementedError

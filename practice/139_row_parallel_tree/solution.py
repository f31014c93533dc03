"""Exercise 139: a row-parallel layer whose sum has one process's bits at every tensor-parallel degree.
Edit this file, then run

    python practice/judge.py 139

The statement is in README.md. Leaves are numbered 0 .. num_leaves - 1; leaf i of a layer is the
input columns k_bounds[i] .. k_bounds[i + 1] - 1. `matmul(x_part, w_part)` is the kernel's product
of one leaf (x_part @ w_part.T, in x's dtype): call it, do not write your own. Leave the arguments
unchanged.
"""

from typing import Callable, Sequence

import torch


def tree_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of parts[0], parts[1], ... (one per leaf, all one shape) in the fixed tree."""
    raise NotImplementedError


def rank_partial(x: torch.Tensor, weight: torch.Tensor, k_bounds: Sequence[int], lo: int, hi: int,
                 matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """What the rank holding leaves lo .. hi - 1 computes: their products, widened to float32 (float64
    stays float64), summed in their subtree. Not rounded back to x's dtype."""
    raise NotImplementedError


def combine(partials: Sequence[torch.Tensor], nodes: Sequence[tuple[int, int]], num_leaves: int) -> torch.Tensor:
    """The whole layer's sum (before rounding) from every rank's partial: partials[r] is the sum over
    leaves nodes[r][0] .. nodes[r][1] - 1, and every node is a node of the tree over num_leaves leaves."""
    raise NotImplementedError

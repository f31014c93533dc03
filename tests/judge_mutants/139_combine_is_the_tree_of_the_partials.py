"""Mutant of exercise 139: combine is the tree over the partials, as if each rank were one leaf."""

EXPECTED_HINT = "is not the tree over the 4 partials"

import torch


def _sum(sums, lo, hi):
    if (lo, hi) in sums:
        return sums[lo, hi]
    mid = lo + (hi - lo + 1) // 2
    return _sum(sums, lo, mid) + _sum(sums, mid, hi)


def tree_sum(parts):
    return _sum({(i, i + 1): p for i, p in enumerate(parts)}, 0, len(parts))


def rank_partial(x, weight, k_bounds, lo, hi, matmul):
    work = torch.promote_types(x.dtype, torch.float32)
    sums = {}
    for i in range(lo, hi):
        a, b = k_bounds[i], k_bounds[i + 1]
        sums[i, i + 1] = matmul(x[:, a:b], weight[:, a:b]).to(work)
    return _sum(sums, lo, hi)


def combine(partials, nodes, num_leaves):
    return tree_sum(partials)  # MUTANT: nodes and num_leaves ignored

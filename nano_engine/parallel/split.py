"""How a model is cut between tensor-parallel ranks, and the one order in which every cut sums.

Megatron's split, as vLLM's layers make it (vllm/model_executor/layers/linear.py): q, k, v and
gate/up are column-parallel (a rank computes some of the output columns, whole), o_proj and
down_proj row-parallel (a rank computes the product over some of the input columns, K, and the
ranks' partial products are summed). Columns are exact at any split: each output number is made
by one rank, from the whole of K, with the kernels' own bits (they split over N only). A sum over K
is not: floating-point addition is not associative, and an all-reduce adds in whatever order its
algorithm picks (vLLM's shared-memory all-reduce, csrc/cpu/shm.cpp, starts each rank from its own
buffer), so the bits of a row-parallel output follow the number of ranks.

Here a row-parallel output is computed, in every configuration including one process, as a fixed
number of K parts, the *leaves*, each a product over its K range by the kernel, combined in one
fixed binary tree of float additions (`Tree`). A rank holds a contiguous run of leaves that is a
node of that tree, sums its subtree alone, and the ranks' sums are combined by the levels above
them: the same additions in the same order as one process makes, so the same bits at every degree.

The leaves are the model's KV heads: leaf i of o_proj is the query heads that share KV head i (a
rank then attends with its own heads and KV cache, and talks to no other rank until o_proj), and
leaf i of down_proj the i-th of as many equal ranges of the MLP's intermediate columns. Any degree
from 1 to the number of KV heads cuts the tree into that many nodes (`Split.of`), evenly where it
can: SmolLM2-135M (9 query heads, 3 KV heads) runs at 1, 2 (2 leaves and 1) and 3; Qwen3-0.6B
(16 and 8) at 1 to 8, evenly at 2, 4 and 8. More ranks than KV heads would need the KV heads copied between ranks,
which vLLM does (QKVParallelLinear) and this split does not yet: such a degree is refused, with
the numbers, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    """The fixed binary tree over leaves lo .. hi - 1: a node of more than one leaf splits into
    its first half, rounded up, and the rest (3 leaves: (0 + 1) + 2; 4: (0 + 1) + (2 + 3); 6:
    ((0 + 1) + 2) + ((3 + 4) + 5)), so that 2, 4, 8 ranks get equal shares where the leaves allow."""

    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo

    def children(self) -> tuple["Tree", "Tree"]:
        if self.size < 2:
            raise ValueError(f"leaf {self.lo} has no children")
        mid = self.lo + (self.size + 1) // 2
        return Tree(self.lo, mid), Tree(mid, self.hi)

    def sum(self, known: dict) -> torch.Tensor:
        """This node's sum, from the sums `known` for some nodes, keyed (lo, hi): every leaf's, or
        the nodes the ranks computed. Each addition in its fixed place."""
        if (self.lo, self.hi) in known:
            return known[self.lo, self.hi]
        if self.size == 1:
            raise KeyError(f"no value for leaf {self.lo}")
        left, right = self.children()
        return left.sum(known) + right.sum(known)


@dataclass(frozen=True)
class Split:
    """Which leaves each of `ranks` tensor-parallel ranks holds: contiguous nodes of Tree(0, leaves)."""

    leaves: int
    nodes: tuple[Tree, ...]  # rank r holds leaves nodes[r].lo .. nodes[r].hi - 1

    @property
    def ranks(self) -> int:
        return len(self.nodes)

    @classmethod
    def of(cls, leaves: int, ranks: int) -> "Split":
        """Cut Tree(0, leaves) into `ranks` nodes: split the node of most leaves (the first such)
        until there are enough. Refuses a degree the tree cannot give."""
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {ranks!r}")
        if ranks > leaves:
            raise ValueError(f"tensor_parallel_size={ranks} is more than the model's {leaves} KV heads: each rank "
                             f"holds at least one KV head (its query heads, its share of the MLP) here; use at "
                             f"most {leaves}")
        nodes = [Tree(0, leaves)]
        while len(nodes) < ranks:
            i = max(range(len(nodes)), key=lambda j: (nodes[j].size, -j))
            nodes[i:i + 1] = nodes[i].children()
        return cls(leaves, tuple(nodes))

    def combine(self, partials: list[torch.Tensor]) -> torch.Tensor:
        """The whole sum from each rank's subtree sum (partials[r] over nodes[r]), in the tree's
        order: what every rank computes after an all-gather of the partials."""
        if len(partials) != self.ranks:
            raise ValueError(f"{len(partials)} partial sums for {self.ranks} ranks")
        return Tree(0, self.leaves).sum({(n.lo, n.hi): p for n, p in zip(self.nodes, partials)})


def bounds(total: int, parts: int) -> list[int]:
    """Where `parts` near-equal contiguous ranges of `total` start, and the end: total * i // parts."""
    return [total * i // parts for i in range(parts + 1)]


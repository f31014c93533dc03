"""Cases of exercise 139: the learner's tree_sum, rank_partial and combine against the tree of
nano_engine.parallel.split, and the layer they make against mini_llm.Linear (one process), bit for bit.

Hand-made cases first, one rule each, then random ones (practice.properties): random shapes, dtypes,
numbers of leaves and ranks; the smallest that differs is shown.
"""

from types import SimpleNamespace

import torch

import nano_engine.parallel.split as ref
from nano_engine.kernels.linear import linear
from nano_engine.mini_llm import Linear
from practice.properties import check_property, st
from practice.worker import Case, Mismatch, require_functions

REFERENCE_FILE = ref.__file__


def _work(dtype):
    return torch.promote_types(dtype, torch.float32)


def ref_tree_sum(parts):
    return ref.Tree(0, len(parts)).sum({(i, i + 1): p for i, p in enumerate(parts)})


def ref_rank_partial(x, weight, k_bounds, lo, hi, matmul):
    return ref.Tree(lo, hi).sum({(i, i + 1): matmul(x[:, k_bounds[i]:k_bounds[i + 1]],
                                                    weight[:, k_bounds[i]:k_bounds[i + 1]]).to(_work(x.dtype))
                                 for i in range(lo, hi)})


def ref_combine(partials, nodes, num_leaves):
    return ref.Tree(0, num_leaves).sum({tuple(n): p for n, p in zip(nodes, partials)})


def learner(module):
    return require_functions(module, ("tree_sum", "rank_partial", "combine"))


def reference():
    return SimpleNamespace(tree_sum=ref_tree_sum, rank_partial=ref_rank_partial, combine=ref_combine)


def kernel(a, b):
    """The leaf product the learner is given: the engine's own matmul kernel, on the leaf's columns of
    the weight as one block (as a rank holds them, and as mini_llm.Linear copies them once)."""
    return linear(a, b.contiguous())


def _same(call, got, expected, hint):
    if not isinstance(got, torch.Tensor):
        raise Mismatch(call, f"  expected a tensor of shape {tuple(expected.shape)}", f"  got {got!r}", "hint: " + hint)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        raise Mismatch(call, f"  expected {expected.dtype} of shape {tuple(expected.shape)}",
                       f"  got      {got.dtype} of shape {tuple(got.shape)}", "hint: " + hint)
    if not torch.equal(got, expected):
        bad = (got != expected).nonzero()[0].tolist()
        raise Mismatch(call, f"  expected at {bad}: {expected[tuple(bad)].item()!r} (bit for bit)",
                       f"  got              {got[tuple(bad)].item()!r}", "hint: " + hint)


TREE_HINT = ("a run of more than one leaf splits into its first half, ROUNDED UP, and the rest: 3 leaves "
             "(0 + 1) + 2, 4 leaves (0 + 1) + (2 + 3), 5 leaves ((0 + 1) + 2) + (3 + 4); each half summed the "
             "same way, then the two added")


def _parts(n, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # Magnitudes over many binades: a sum in another order almost surely rounds otherwise.
    return [(torch.randn(3, 7, generator=gen) * 10.0 ** torch.randint(-4, 5, (3, 7), generator=gen)).to(dtype)
            for _ in range(n)]


def check_tree(api, n, seed, dtype=torch.float32, hint=TREE_HINT):
    parts = _parts(n, seed, dtype)
    given = [p.clone() for p in parts]
    got = api.tree_sum(given)
    if any(not torch.equal(a, b) for a, b in zip(given, parts)):
        raise Mismatch(f"tree_sum({n} parts)", "  expected the parts to stay unchanged", "  got them changed",
                       "hint: add into new tensors (a + b), not into the parts (a += b)")
    _same(f"tree_sum({n} parts of shape (3, 7), {dtype})", got, ref_tree_sum(parts), hint)


def _layer(k, leaves, dtype, seed, rows=5, n=6):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    return x, w, ref.bounds(k, leaves)


PARTIAL_HINT = ("each leaf's product is matmul(x[:, a:b], weight[:, a:b]) in x's dtype; widen each product to "
                "float32 (torch.promote_types(dtype, torch.float32)) BEFORE adding, and add the leaves lo .. hi - 1 "
                "in their own subtree (the same rule as tree_sum, on leaves lo .. hi - 1)")


def check_partial(api, k, leaves, lo, hi, dtype, seed, hint=PARTIAL_HINT):
    x, w, kb = _layer(k, leaves, dtype, seed)
    x0, w0 = x.clone(), w.clone()
    got = api.rank_partial(x, w, list(kb), lo, hi, kernel)
    if not (torch.equal(x, x0) and torch.equal(w, w0)):
        raise Mismatch("rank_partial(...)", "  expected x and weight unchanged", "  got them changed",
                       "hint: slice, do not write into the inputs")
    _same(f"rank_partial(x {tuple(x.shape)} {dtype}, k_bounds={kb}, lo={lo}, hi={hi})", got,
          ref_rank_partial(x, w, kb, lo, hi, kernel), hint)


COMBINE_HINT = ("the ranks' partials are the sums of whole nodes of the tree: add them in the levels ABOVE those "
                "nodes, in the tree's order (8 leaves on 4 ranks holding (0, 2), (2, 4), (4, 6), (6, 8): "
                "(p0 + p1) + (p2 + p3)), never simply rank after rank")


def check_combine(api, leaves, ranks, seed, hint=COMBINE_HINT):
    split = ref.Split.of(leaves, ranks)
    nodes = [(n.lo, n.hi) for n in split.nodes]
    partials = _parts(ranks, seed)
    _same(f"combine({ranks} partials, nodes={nodes}, num_leaves={leaves})", api.combine(partials, nodes, leaves),
          ref_combine(partials, nodes, leaves), hint)


LAYER_HINT = ("the whole layer: rank_partial for each rank's node, then combine, then .to(x.dtype): one rounding "
              "at the very end, as one process does")


def check_layer(api, k, leaves, ranks, dtype, seed, hint=LAYER_HINT):
    """The layer from the ranks' pieces against mini_llm.Linear with these leaves, in one process."""
    x, w, kb = _layer(k, leaves, dtype, seed)
    one = Linear(k, w.shape[0], bias=False).to(dtype).requires_grad_(False)
    with torch.no_grad():
        one.weight.copy_(w)
    one.leaves = tuple(kb)
    with torch.inference_mode():
        expected = one(x)
    split = ref.Split.of(leaves, ranks)
    nodes = [(n.lo, n.hi) for n in split.nodes]
    partials = [api.rank_partial(x, w, list(kb), lo, hi, kernel) for lo, hi in nodes]
    got = api.combine(partials, nodes, leaves)
    got = got.to(dtype) if isinstance(got, torch.Tensor) else got
    _same(f"the layer at {ranks} ranks ({leaves} leaves, K={k}, {dtype}): combine(rank_partial(...) for each "
          f"rank).to(dtype) against one process", got, expected, hint)


def case(name, fn, *args, **kwargs):
    return Case(name, lambda api: fn(api, *args, **kwargs))


DTYPES = (torch.float32, torch.bfloat16, torch.float64)


@st.composite
def _layers(draw):
    leaves = draw(st.integers(1, 8))
    return (draw(st.integers(leaves, 40)), leaves, draw(st.integers(1, leaves)), draw(st.sampled_from(DTYPES)),
            draw(st.integers(0, 1000)))


def random_cases(examples: int) -> Case:
    return Case("random_layers", lambda api: check_property(_layers(), lambda c: check_layer(api, *c),
                                                            examples=examples))


CASES = [
    case("one_leaf_is_itself", check_tree, 1, 0, hint="one part: return it (its sum is itself)"),
    case("two_leaves", check_tree, 2, 1),
    case("three_leaves_first_half_rounded_up", check_tree, 3, 2),
    case("four_leaves_in_pairs_not_left_to_right", check_tree, 4, 3),
    case("five_and_six_leaves", check_tree, 5, 4),
    case("eight_leaves", check_tree, 8, 5),
    case("tree_sum_in_float64", check_tree, 6, 6, torch.float64),
    case("a_rank_of_one_leaf", check_partial, 24, 3, 2, 3, torch.float32, 7),
    case("a_rank_of_two_leaves", check_partial, 24, 3, 0, 2, torch.float32, 8),
    case("bfloat16_products_are_widened_then_added", check_partial, 64, 4, 0, 4, torch.bfloat16, 9,
         hint="in bfloat16, each leaf's product comes back in bfloat16: widen it to float32 and add in float32; "
              "return the float32 sum, not rounded back"),
    case("uneven_leaves", check_partial, 29, 4, 1, 4, torch.float32, 10,
         hint="the leaves are k_bounds[i] .. k_bounds[i + 1] - 1: here of 7 and 8 columns"),
    case("float64_stays_float64", check_partial, 30, 3, 0, 3, torch.float64, 11,
         hint="float64 products are added in float64 (torch.promote_types(float64, float32) is float64)"),
    case("combine_one_rank", check_combine, 3, 1, 12, hint="one rank holds the root: its partial is the sum"),
    case("combine_two_ranks_over_three_leaves", check_combine, 3, 2, 13),
    case("combine_three_ranks_over_four_leaves", check_combine, 4, 3, 14),
    case("combine_three_ranks_over_six_leaves", check_combine, 6, 3, 15),
    case("combine_four_ranks_over_eight_leaves_in_pairs", check_combine, 8, 4, 19),
    case("combine_four_ranks_over_five_leaves", check_combine, 5, 4, 20,
         hint="the tree over 5 leaves is not the tree over the 4 partials: combine adds each partial where its node "
              "sits in the tree of the leaves"),
    case("the_embedded_models_o_proj_at_2_ranks", check_layer, 576, 3, 2, torch.bfloat16, 16),
    case("the_embedded_models_down_proj_at_3_ranks", check_layer, 1536, 3, 3, torch.float32, 17),
    case("eight_kv_heads_at_4_ranks", check_layer, 128, 8, 4, torch.bfloat16, 18),
    random_cases(150),
]

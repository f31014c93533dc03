"""The tensor-parallel cut (nano_engine/parallel/split.py): every degree the tree allows gives the
one-process bits of a row-parallel sum, and a degree it cannot give is refused by its numbers."""

import pytest
import torch

from nano_engine.parallel.split import Split, Tree, bounds


def nodes_of(tree: Tree) -> set[tuple[int, int]]:
    out = {(tree.lo, tree.hi)}
    if tree.size > 1:
        for child in tree.children():
            out |= nodes_of(child)
    return out


@pytest.mark.parametrize("leaves", [1, 2, 3, 4, 6, 8, 9])
def test_every_degree_up_to_the_leaves_cuts_the_tree_into_whole_nodes(leaves):
    tree_nodes = nodes_of(Tree(0, leaves))
    for ranks in range(1, leaves + 1):
        split = Split.of(leaves, ranks)
        assert split.ranks == ranks
        assert split.nodes[0].lo == 0 and split.nodes[-1].hi == leaves
        assert all(a.hi == b.lo for a, b in zip(split.nodes, split.nodes[1:]))  # contiguous, in rank order
        assert {(n.lo, n.hi) for n in split.nodes} <= tree_nodes


@pytest.mark.parametrize("leaves", [2, 4, 8])
def test_powers_of_two_share_the_leaves_evenly(leaves):
    for ranks in (r for r in (2, 4, 8) if r <= leaves):
        assert {n.size for n in Split.of(leaves, ranks).nodes} == {leaves // ranks}


def test_a_degree_the_tree_cannot_give_is_refused_by_its_numbers():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4.*3 KV heads"):
        Split.of(3, 4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            Split.of(3, bad)


def row_parallel(x: torch.Tensor, weight: torch.Tensor, k_bounds: list[int], node: Tree, matmul) -> torch.Tensor:
    """A row-parallel product's sum over the leaves of `node`: leaf i is x[:, k_bounds[i]:k_bounds[i+1]]
    times the same columns of weight (N, K), by `matmul(x_part, weight_part)`, in float32 at least
    (a bfloat16 product is rounded once, after the whole tree)."""
    parts = {}
    for i in range(node.lo, node.hi):
        a, b = k_bounds[i], k_bounds[i + 1]
        parts[i, i + 1] = matmul(x[:, a:b], weight[:, a:b])
    return node.sum(parts)


def float32_product(a, b):
    return a.to(torch.promote_types(a.dtype, torch.float32)) @ b.to(torch.promote_types(b.dtype, torch.float32)).T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("leaves,k", [(3, 576), (4, 256), (8, 1000)])
def test_a_row_parallel_sum_has_the_bits_of_one_process_at_every_degree(dtype, leaves, k):
    torch.manual_seed(leaves)
    x, w = torch.randn(17, k).to(dtype), torch.randn(40, k).to(dtype)
    kb = bounds(k, leaves)
    alone = row_parallel(x, w, kb, Tree(0, leaves), float32_product)
    for ranks in range(2, leaves + 1):
        split = Split.of(leaves, ranks)
        partials = [row_parallel(x, w, kb, node, float32_product) for node in split.nodes]  # one per rank
        assert torch.equal(split.combine(partials), alone), ranks


def test_the_order_matters_so_the_test_above_can_fail():
    # Ranks' sums added one after another (as an all-reduce may) instead of in the tree: other bits.
    torch.manual_seed(0)
    x, w = torch.randn(17, 1024), torch.randn(40, 1024)
    kb = bounds(1024, 4)
    alone = row_parallel(x, w, kb, Tree(0, 4), float32_product)
    split = Split.of(4, 4)
    partials = [row_parallel(x, w, kb, node, float32_product) for node in split.nodes]
    naive = ((partials[0] + partials[1]) + partials[2]) + partials[3]
    assert torch.allclose(naive, alone, rtol=1e-5, atol=1e-4)
    assert not torch.equal(naive, alone)


def test_bounds_cover_the_whole_range_in_near_equal_parts():
    assert bounds(1536, 3) == [0, 512, 1024, 1536]
    b = bounds(10, 4)
    assert b[0] == 0 and b[-1] == 10 and max(y - x for x, y in zip(b, b[1:])) - min(y - x for x, y in zip(b, b[1:])) <= 1


# ----- the model's row-parallel layers (mini_llm.Linear with leaves) -----

from nano_engine import ModelConfig, Transformer  # noqa: E402
from nano_engine.kernels.linear import can_prepack  # noqa: E402
from nano_engine.mini_llm import leaf_sum  # noqa: E402


def four_kv_heads(dtype, prepack=False, kv_heads=4) -> Transformer:
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=100, num_hidden_layers=1,
                      num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads, head_dim=16)
    gen = torch.Generator().manual_seed(1)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    model = model.to(dtype).eval().fuse()
    return model.prepack() if prepack else model


CASES = [(dt, False) for dt in (torch.float32, torch.bfloat16, torch.float64)]
CASES += [(dt, True) for dt in (torch.float32, torch.bfloat16) if can_prepack(dt)]


@pytest.mark.parametrize("dtype,prepack", CASES)
def test_o_proj_and_down_proj_give_one_process_bits_from_any_number_of_ranks(dtype, prepack):
    """What a rank computes (the tree sum of its leaves, unrounded), combined in the tree and rounded
    once, is the layer's own output: on the plain path and on the prepacked one (kernels of ours,
    the sum compiled in fused.cpp)."""
    block = four_kv_heads(dtype, prepack).model.layers[0]
    torch.manual_seed(2)
    for layer in (block.self_attn.o_proj, block.mlp.down_proj):
        assert len(layer.leaves) == 5
        x = torch.randn(23, layer.in_features).to(dtype)
        with torch.inference_mode():  # as the engine runs it (on packed weights: one kernel call, see below)
            alone = layer(x)
            for ranks in (1, 2, 3, 4):
                split = Split.of(4, ranks)
                partials = [leaf_sum(layer.leaf_products(x, node), node) for node in split.nodes]
                assert torch.equal(split.combine(partials).to(dtype), alone), (layer, ranks)


def test_one_kv_head_keeps_the_plain_product():
    cfg = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=4)
    block = Transformer(cfg).model.layers[0]
    assert block.self_attn.o_proj.leaves is None and block.mlp.down_proj.leaves is None


def test_the_embedded_models_leaves_are_its_kv_heads():
    cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    with torch.device("meta"):
        block = Transformer(cfg).model.layers[0]
    assert block.self_attn.o_proj.leaves == (0, 192, 384, 576)  # 3 query heads of 64 each
    assert block.mlp.down_proj.leaves == (0, 512, 1024, 1536)


ONE_CALL = [dt for dt in (torch.float32, torch.bfloat16) if can_prepack(dt)]


@pytest.mark.parametrize("kv_heads", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", ONE_CALL)
def test_all_leaves_in_one_kernel_call_have_the_bits_of_the_leaves_one_by_one(dtype, kv_heads):
    """On packed weights a layer's leaves and their tree sum run as one call of our kernel
    (PackedLeaves.gemm, where the CPU's kernel has it): the same bits as a call per leaf and the
    tree sum, at any row count, for leaves of odd widths (down_proj's 100 columns in 3, 4, 5 or 8)
    and rows read with a stride, for as many leaves as the kernel has a tree of its own for, and one
    it has not (5)."""
    block = four_kv_heads(dtype, prepack=True, kv_heads=kv_heads).model.layers[0]
    torch.manual_seed(3)
    for layer in (block.self_attn.o_proj, block.mlp.down_proj):
        if layer.packed.gemm(torch.zeros(1, layer.in_features, dtype=dtype)) is None:
            continue  # AMX packs: leaf by leaf (what the test above checks)
        wide = torch.randn(13, layer.in_features + 3).to(dtype)
        for x in (wide[:, :layer.in_features].contiguous(), wide[:, 1:layer.in_features + 1]):
            with torch.inference_mode():
                whole = layer(x)
                by_leaf = leaf_sum(layer.leaf_products(x, layer.root), layer.root).to(dtype)
                assert torch.equal(whole, by_leaf), layer
                assert all(torch.equal(layer(x[:m]), whole[:m]) for m in (1, 2, 6, 7)), layer

"""Batched paged attention gives every sequence what it would get alone, whatever the mix."""

from pathlib import Path

import pytest
import torch

from nano_engine.attention import GatherBuffers, group_by_length, paged_attention, plan_attention
from nano_engine.mini_llm import attention
from nano_engine.runner import build_batch, SeqChunk

NH, NKV, HD, BS = 4, 2, 8, 4


def random_step(gen, specs, num_blocks=64, dtype=torch.float64):
    """A cache holding each sequence's context and one step's new q, k, v.

    specs: (num_cached, num_new) per sequence. Returns the batch, the cache, q, k, v and each
    sequence's full K and V (context + new), for the per-sequence reference."""
    kc = torch.randn(num_blocks * BS, NKV, HD, generator=gen, dtype=dtype)
    vc = torch.randn(num_blocks * BS, NKV, HD, generator=gen, dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks
    chunks, full = [], []
    for c, n in specs:
        table = [free.pop() for _ in range(-(-(c + n) // BS))]
        chunks.append(SeqChunk([1] * n, c, table, True))
    batch = build_batch(chunks, BS)
    T = batch.num_tokens
    q = torch.randn(T, NH, HD, generator=gen, dtype=dtype)
    k = torch.randn(T, NKV, HD, generator=gen, dtype=dtype)
    v = torch.randn(T, NKV, HD, generator=gen, dtype=dtype)
    kc[batch.slot_mapping], vc[batch.slot_mapping] = k, v  # what the runner writes before attending
    for ctx in batch.context_slots:
        full.append((kc[ctx], vc[ctx]))
    return batch, kc, vc, q, k, v, full


def test_decodes_split_into_groups_keep_padding_small():
    lengths = [20, 21, 500, 23, 480, 490, 22]
    groups = group_by_length(lengths, max_padding=0.3)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert sum(lengths[i] for i in g) >= 0.7 * longest * len(g)
    assert len(groups) == 2
    assert group_by_length([], 0.3) == []


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit in 2-byte dtypes. In float32, oneDNN and MKL sum a product's terms in an order
    that depends on the matrix sizes, so rows agree to rounding noise only: far below anything
    that changes a greedy token, which is why float32 identity holds in practice (and is tested
    end to end), while a bfloat16 rounding step is not."""
    if a.dtype in (torch.bfloat16, torch.float16):
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=0, atol=1e-12 if a.dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("specs, max_padding", [
    ([(5, 1), (0, 7), (6, 1), (3, 4), (30, 1), (0, 1), (28, 1)], 0.1),  # decode groups, prefills, chunks
    ([(5, 1), (33, 1), (6, 1), (60, 1), (0, 9)], 0.9),  # one decode group, padded to its longest
    ([(0, 6), (8, 3)], 0.1),  # prefills only, with and without a cached prefix
    ([(40, 1)], 0.1),  # one decode
])
def test_paged_attention_gives_each_sequence_the_bits_it_gets_alone(specs, max_padding, dtype):
    """Whatever the mix and the padding of a decode group: bit for bit in 2-byte dtypes, where one
    rounding step is large enough to change a greedy token; to rounding in the others (see `same`)."""
    gen = torch.Generator().manual_seed(len(specs))
    batch, kc, vc, q, k, v, full = random_step(gen, specs, dtype=dtype)
    plan = plan_attention(batch.query_start, batch.num_cached, batch.block_tables, batch.slot_mapping,
                          BS, NKV, GatherBuffers(), max_padding=max_padding)
    if len(specs) > 6:  # grouped decodes that are not neighbours in the batch
        assert any(not isinstance(g.rows, slice) for g in plan.decodes)
    out = paged_attention(plan, kc, vc, q, k, v)
    for s, (K, V) in enumerate(full):
        a, b = batch.query_start[s], batch.query_start[s + 1]
        assert same(out[a:b], attention(q[a:b], K, V, batch.num_cached[s])), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_attention_rows_do_not_depend_on_the_chunking(dtype, seed):
    """Prefill in one call, cut in random chunks over the cached prefix, or one token at a time:
    every query row gets the same result (rows cross ATTENTION_BLOCK boundaries at other offsets)."""
    gen = torch.Generator().manual_seed(seed)
    L = int(torch.randint(2, 400, (1,), generator=gen))
    q = torch.randn(L, NH, HD, generator=gen).to(dtype)
    k = torch.randn(L, NKV, HD, generator=gen).to(dtype)
    v = torch.randn(L, NKV, HD, generator=gen).to(dtype)
    whole = attention(q, k, v, 0)
    cuts = sorted(set(torch.randint(1, L, (3,), generator=gen).tolist())) + [L]
    start = 0
    for end in cuts:
        assert same(attention(q[start:end], k[:end], v[:end], start), whole[start:end]), (start, end)
        start = end
    for i in sorted(set(torch.randint(0, L, (5,), generator=gen).tolist())):
        assert same(attention(q[i:i + 1], k[:i + 1], v[:i + 1], i), whole[i:i + 1]), i


@pytest.mark.parametrize("num_seqs", [2, 14])
@pytest.mark.parametrize("padded_to", [132, 207, 300])
def test_bfloat16_decode_that_once_differed_is_exact(num_seqs, padded_to):
    """A real case (tests/data: SmolLM2's layer 20, a 125-token context, taken from the W2
    benchmark where request 56 then diverged from generate at its 98th token): padded into a
    decode group, float32 scores changed its bits; float64 scores (score_dtype) do not."""
    case = torch.load(Path(__file__).parent / "data" / "bf16_decode_layer20.pt")
    q, K, V = case["q"], case["k"], case["v"]
    L, bs, nkv = K.shape[0], 16, K.shape[1]
    table = list(range(-(-padded_to // bs)))
    fill = torch.zeros(len(table) * bs - L, *K.shape[1:], dtype=K.dtype)
    cached = [L - 1] + [padded_to - 1] * (num_seqs - 1)
    plan = plan_attention(list(range(num_seqs + 1)), cached, [table] * num_seqs, torch.tensor(cached), bs, nkv,
                          GatherBuffers(), max_padding=1.0)
    out = paged_attention(plan, torch.cat([K, fill]), torch.cat([V, fill]), q.expand(num_seqs, -1, -1).contiguous(),
                          None, None)
    assert torch.equal(out[:1], attention(q, K, V, L - 1))


def test_bfloat16_decodes_padded_into_groups_are_exact_in_bulk():
    """Many small decode groups of bfloat16 sequences, each row against the sequence alone.

    Probabilities x V is a sum over the keys; a bfloat16 matmul accumulates it in float32 in an
    order that can depend on the padded number of keys (seen on an AVX2 CPU: about 1 row in 300
    differed, enough to change the embedded model's greedy tokens in a batch of six). Accumulated
    in float64 (score_dtype), the padding's zeros change nothing."""
    nh, nkv, hd, bs = 9, 3, 64, 16  # SmolLM2's heads: the kernels' blocking depends on the sizes
    gen = torch.Generator().manual_seed(0)
    differing = 0
    for _ in range(600):
        n = int(torch.randint(2, 7, (1,), generator=gen))
        lens = torch.randint(20, 120, (n,), generator=gen).tolist()
        tables, b = [], 0
        for L in lens:
            tables.append(list(range(b, b - (-L // bs))))
            b += -(-L // bs)
        kc = (torch.randn(b * bs, nkv, hd, generator=gen) * 2).bfloat16()
        vc = torch.randn(b * bs, nkv, hd, generator=gen).bfloat16()
        q = (torch.randn(n, nh, hd, generator=gen) * 2).bfloat16()
        plan = plan_attention(list(range(n + 1)), [L - 1 for L in lens], tables, torch.zeros(n, dtype=torch.long),
                              bs, nkv, GatherBuffers(), max_padding=1.0)  # one group, padded to the longest
        out = paged_attention(plan, kc, vc, q, None, None)
        for s, L in enumerate(lens):
            slots = torch.tensor([tables[s][p // bs] * bs + p % bs for p in range(L)])
            differing += not torch.equal(out[s], attention(q[s:s + 1], kc[slots], vc[slots], L - 1)[0])
    assert differing == 0

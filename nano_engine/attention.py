"""Paged attention over a ragged batch, in a handful of tensor ops per layer whatever the batch.

The straightforward runner loops over the sequences of a step at every layer: gather this
sequence's K and V from its blocks, build its causal mask, call attention. With 64 decoding
requests and 30 layers that is thousands of small ops per step, and the Python and dispatch
around them cost more than the arithmetic. Here the loop over sequences runs once per step, in
`plan_attention`, which turns the block tables into index tensors and masks; each layer then runs

* decodes (sequences with one new token, the bulk of a busy step): one gather of all their
  contexts from the cache, padded to the longest of their group, laid out head-major, and two
  batched matmuls with a softmax between (grouped-query attention: each KV head serves
  `nh / nkv` query heads, so the queries are grouped by KV head instead of repeating K and V);
* prefill chunks (several new tokens): one causal attention call each, over the chunk's own
  fresh K and V when nothing is cached before it (no read from the cache at all), else over
  its context gathered from the cache.

Decodes are grouped by context length so that padding stays small: a 20-token context is not
padded to 500 because it shares a step with a long one.

With `backend="c"` none of this runs: one call of the compiled kernel per layer
(kernels/paged_attention.py) attends every row of the step, chunks and decodes alike, reading each
sequence's context from the blocks where it lies, through int32 block tables checked once per step.

Mirrors vLLM V1's attention metadata builders, which split a batch into decodes and prefills
(`vllm/v1/attention/backends/utils.py`: split_decodes_and_prefills) and run each with its own
kernel, and its CPU backend (`vllm/v1/attention/backends/cpu_attn.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .kernels import paged_attention as kernels
from .mini_llm import attention, score_dtype
from .paged import slots_of


@dataclass
class DecodeGroup:
    """Sequences with one new token each, attended to together over their padded contexts."""

    rows: slice | torch.Tensor  # their rows in the batch (a slice when consecutive)
    kv_index: torch.Tensor  # (D * nkv * L,) rows of the cache viewed as (slots * nkv, hd)
    bias: torch.Tensor  # (D, 1, 1, L) float32: 0 on each sequence's context, -inf on its padding
    num_seqs: int  # D
    length: int  # L, the longest context in the group


@dataclass
class PrefillChunk:
    """Several new tokens of one sequence: rows a:b of the batch at cache positions c..c+b-a-1."""

    rows: slice
    num_cached: int  # c
    context: torch.Tensor | None  # slots of tokens 0..c+b-a-1; None when c == 0 (use the fresh K, V)


class GatherBuffers:
    """Space for the K and V that decode groups gather, reused by every layer and step.

    A decode step of 64 requests gathers tens of MB per layer; a fresh tensor each time costs more
    in page faults (the allocator hands big blocks back to the OS) than the gather itself.
    """

    def __init__(self):
        self.space: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.space.get(dtype, (torch.empty(0), None))
        if k.numel() < numel:
            k, v = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
            self.space[dtype] = k, v
        return k[:numel], v[:numel]


@dataclass
class AttentionPlan:
    """What every layer's attention needs for one step, built once per step."""

    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    buffers: GatherBuffers
    kernel: kernels.KernelBatch | None = None  # backend "c": the whole step, for kernels.paged_attention


def _rows(indices: list[int]) -> slice | torch.Tensor:
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return slice(indices[0], indices[0] + len(indices))
    return torch.tensor(indices)


def group_by_length(lengths: Sequence[int], max_padding: float) -> list[list[int]]:
    """Split sequence indices into groups, shortest first, so that each group's padding
    (group size x its longest length, minus the lengths) stays within max_padding of its size."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] * (1 - max_padding) <= total + lengths[i]:
            groups[-1].append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


def plan_attention(query_start: Sequence[int], num_cached: Sequence[int],
                   block_tables: Sequence[Sequence[int]], slot_mapping: torch.Tensor, block_size: int,
                   num_kv_heads: int, buffers: GatherBuffers | None = None,
                   max_padding: float = 0.3, backend: str = "torch", num_blocks: int | None = None) -> AttentionPlan:
    """Index tensors and masks for one step of a ragged batch (see the module docstring).
    backend: "torch" (grouped, padded decodes) or "c" (the whole step in one kernel call per layer;
    num_blocks, the cache's size, bounds the block ids it may read)."""
    if backend == "c":
        if num_blocks is None:
            raise ValueError('backend="c" needs num_blocks, the size of the cache it reads')
        batch = kernels.kernel_batch(query_start, num_cached, block_tables, block_size, num_blocks)
        return AttentionPlan(slot_mapping, [], [], buffers or GatherBuffers(), batch)
    decodes, prefills = [], []
    for s, c in enumerate(num_cached):
        a, b = query_start[s], query_start[s + 1]
        if b - a == 1:
            decodes.append(s)
        else:
            ctx = slots_of(block_tables[s], 0, c + b - a, block_size) if c else None
            prefills.append(PrefillChunk(slice(a, b), c, ctx))
    lengths = [num_cached[s] + 1 for s in decodes]
    groups = []
    for members in group_by_length(lengths, max_padding) if decodes else []:
        members = sorted(members)  # batch order, so that one group of all decodes is rows 0..T-1
        seqs = [decodes[i] for i in members]
        lens = torch.tensor([lengths[i] for i in members])
        L = int(lens.max())
        nblocks = -(-L // block_size)
        table = torch.tensor([list(block_tables[s][:nblocks]) + [0] * (nblocks - len(block_tables[s][:nblocks]))
                              for s in seqs])  # (D, nblocks), short tables padded with block 0
        pos = torch.arange(L)
        ctx = table[:, pos // block_size] * block_size + pos % block_size  # (D, L)
        pad = pos[None, :] >= lens[:, None]  # (D, L)
        ctx = ctx.masked_fill(pad, 0)
        # Head-major: row (slot * nkv + h) of the cache viewed as (slots * nkv, hd) is K of head h.
        kv_index = (ctx[:, None, :] * num_kv_heads + torch.arange(num_kv_heads)[None, :, None]).flatten()
        bias = torch.zeros(len(seqs), 1, 1, L).masked_fill(pad[:, None, None, :], float("-inf"))
        groups.append(DecodeGroup(_rows([query_start[s] for s in seqs]), kv_index, bias, len(seqs), L))
    return AttentionPlan(slot_mapping, groups, prefills, buffers or GatherBuffers())


def gather_rows(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = source[index] (rows). Two-byte floats are copied as int16: PyTorch's index_select
    has no fast path for bfloat16 and runs 2x slower on it than on the same bits as integers."""
    if source.dtype in (torch.bfloat16, torch.float16):
        torch.index_select(source.view(torch.int16), 0, index, out=out.view(torch.int16))
        return out
    return torch.index_select(source, 0, index, out=out)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     group: DecodeGroup, buffers: GatherBuffers) -> torch.Tensor:
    """One new token per sequence over its cached context. q: (D, nh, hd) -> (D, nh, hd).

    The same operations as mini_llm.attention for one query row, so that a request gets the same
    result alone and padded into a group: scores in score_dtype (float64 for 2-byte models),
    softmax in float32 at least, then the probabilities rounded to the model's dtype times V,
    accumulated in score_dtype (padding adds exact zeros, in any order).
    """
    D, L = group.num_seqs, group.length
    nkv, hd = k_cache.shape[1], k_cache.shape[2]
    nh, dtype = q.shape[1], q.dtype
    sd, work = score_dtype(dtype), torch.promote_types(dtype, torch.float32)
    n = D * nkv * L * hd
    k, v = buffers.get(n, dtype)
    k = gather_rows(k_cache.view(-1, hd), group.kv_index, k.view(-1, hd))
    v = gather_rows(v_cache.view(-1, hd), group.kv_index, v.view(-1, hd))
    if dtype != sd:
        k_sd, v_sd = buffers.get(n, sd)
        k, v = k_sd.view(-1, hd).copy_(k), v_sd.view(-1, hd).copy_(v)
    k, v = k.view(D * nkv, L, hd), v.view(D * nkv, L, hd)
    q = q.to(sd).reshape(D * nkv, nh // nkv, hd)  # the query heads sharing each KV head
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(hd ** -0.5)
    scores = scores.to(work).view(D, nkv, -1, L) + group.bias  # (D, nkv, nh/nkv, L)
    probs = scores.softmax(dim=-1).to(dtype).to(sd).view(D * nkv, -1, L)
    return torch.bmm(probs, v).view(D, nh, hd).to(dtype)


def take_rows(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """x[rows]: a view for a slice, a copy for an index."""
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def put_rows(out: torch.Tensor, rows: slice | torch.Tensor, values: torch.Tensor) -> None:
    """out[rows] = values."""
    if isinstance(rows, slice):
        out[rows] = values
    else:
        out.index_copy_(0, rows, values)


def paged_attention(plan: AttentionPlan, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of a step's new tokens, each over its own sequence's context.

    q: (T, nh, hd); k, v: (T, nkv, hd), already written to the cache at plan.slot_mapping;
    k_cache, v_cache: (slots, nkv, hd), one layer's cache.
    """
    if plan.kernel is not None:
        return kernels.paged_attention(q, k_cache, v_cache, plan.kernel)
    if len(plan.decodes) == 1 and not plan.prefills:  # decodes only, in one group: rows 0..T-1
        return decode_attention(q, k_cache, v_cache, plan.decodes[0], plan.buffers)
    out = torch.empty_like(q)  # (T, nh, hd)
    for g in plan.decodes:
        put_rows(out, g.rows, decode_attention(take_rows(q, g.rows), k_cache, v_cache, g, plan.buffers))
    for p in plan.prefills:
        if p.context is None:  # nothing cached before the chunk: its own K and V are the context
            out[p.rows] = attention(q[p.rows], k[p.rows], v[p.rows], 0)
        else:
            out[p.rows] = attention(q[p.rows], k_cache[p.context], v_cache[p.context], p.num_cached)
    return out

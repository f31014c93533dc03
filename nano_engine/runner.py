"""One forward pass over a ragged batch: every sequence with its own cached length and step length.

A prefill, a chunk of a prefill, a decode and a recompute after preemption are the same
computation: sequence s brings `n_s` new tokens on top of `c_s` tokens whose KV is already in the
paged cache. The batch flattens all new tokens into one (T,) row of ids, with their positions and
the cache slot where each token's K and V go (its slot mapping). Every linear layer then runs once
over all T tokens; only attention looks at each sequence separately, over its own blocks
(attention.py, which batches the decodes of a step into a few tensor ops per layer).
Logits are computed only for the rows that sample: the last new token of a sequence whose step
reaches the end of its tokens (a prefill chunk in the middle of a prompt samples nothing); a
request that asked for its prompt's logprobs gets every row of its prompt's chunks, one with
drafts (speculative decoding) the rows of its last token and its drafts.

Mirrors vLLM V1's `vllm/v1/worker/gpu_model_runner.py` (_prepare_inputs: query_start_loc,
positions, slot_mapping, logits_indices) and the paged attention backends' metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from .kernels import paged_attention as kernels
from .attention import AttentionPlan, GatherBuffers, paged_attention, plan_attention
from .mini_llm import ATTENTION_BACKENDS, Transformer  # noqa: F401 (ATTENTION_BACKENDS: part of this module's API)
from .paged import PagedKVCache, slots_of  # noqa: F401 (slots_of: part of this module's API)


class SeqChunk(NamedTuple):
    """One sequence's part of a step."""

    token_ids: Sequence[int]  # the new tokens of this step
    num_cached: int  # tokens before them whose KV is in the cache
    block_ids: Sequence[int]  # the block table, long enough for num_cached + len(token_ids)
    sample: bool  # does this step reach the sequence's last token (so it needs logits)?
    # Logits for the last num_logits new tokens (None: the last one if it samples): all of them for
    # prompt logprobs, 1 + the drafts for speculative decoding.
    num_logits: int | None = None


@dataclass
class Batch:
    input_ids: torch.Tensor  # (T,) new tokens of all sequences, back to back
    positions: torch.Tensor  # (T,)
    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    query_start: list[int]  # (B + 1,) sequence s owns rows query_start[s]:query_start[s + 1]
    num_cached: list[int]  # (B,)
    block_tables: list[Sequence[int]]  # (B,) each sequence's block ids
    block_size: int
    logits_indices: torch.Tensor  # rows whose logits are needed, in sequence order (num_logits per chunk)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def context_slots(self) -> list[torch.Tensor]:
        """B tensors: the cache slots of each sequence's tokens 0..num_cached + n - 1."""
        return [slots_of(t, 0, self.query_start[s + 1] - self.query_start[s] + self.num_cached[s],
                         self.block_size) for s, t in enumerate(self.block_tables)]


def build_batch(chunks: Sequence[SeqChunk], block_size: int) -> Batch:
    """Flatten the chunks of one step into the tensors of one forward pass."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts, logits_rows = [0], []
    for c in chunks:
        n = len(c.token_ids)
        end = c.num_cached + n
        if n < 1:
            raise ValueError("every scheduled sequence needs at least one new token")
        if len(c.block_ids) * block_size < end:
            raise ValueError(f"block table of {len(c.block_ids)} blocks cannot hold {end} tokens")
        ids.extend(c.token_ids)
        positions.extend(range(c.num_cached, end))
        slots.extend(c.block_ids[p // block_size] * block_size + p % block_size
                     for p in range(c.num_cached, end))
        starts.append(starts[-1] + n)
        k = int(c.sample) if c.num_logits is None else c.num_logits
        logits_rows.extend(range(starts[-1] - k, starts[-1]))
    return Batch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start=starts,
        num_cached=[c.num_cached for c in chunks],
        block_tables=[c.block_ids for c in chunks],
        block_size=block_size,
        logits_indices=torch.tensor(logits_rows, dtype=torch.long),
    )


class PagedAttend:
    """The attention the model calls at each layer of one step: (layer, q, k, v) -> out. Its cache
    and plan are there too, for a model that runs all its layers in one compiled call
    (kernels/decoder.py, through Transformer.forward)."""

    def __init__(self, cache: PagedKVCache, plan: AttentionPlan):
        self.cache, self.plan = cache, plan

    def __call__(self, layer: int, q, k, v):
        # New K, V go into their slots first: decodes then read their whole context,
        # old and new tokens alike, from the cache.
        self.cache.write(layer, self.plan.slot_mapping, k, v)
        return paged_attention(self.plan, self.cache.k[layer], self.cache.v[layer], q, k, v)


class ModelRunner:
    """Holds the model and its paged KV cache; runs one batch per step."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, attention_backend: str = "torch"):
        """attention_backend: "torch" (attention.py's tensor ops, as the chapters build them), "c"
        (one compiled call per layer reads the blocks in place, kernels/paged_attention.py; built
        here, so a missing compiler fails now) or "auto" (c where it can run, else torch)."""
        cfg = model.config
        self.model = model
        self.block_size = block_size
        # One of ATTENTION_BACKENDS, or "auto" (EngineConfig checks it), which becomes one of them here.
        self.attention_backend = kernels.resolve_backend(attention_backend, model.dtype)
        if self.attention_backend == "c":
            kernels.check_dtype(model.dtype)
            kernels.library()
        self.kv_cache = PagedKVCache(cfg.num_hidden_layers, num_blocks, block_size,
                                     cfg.num_key_value_heads, cfg.head_dim, model.dtype)
        self.buffers = GatherBuffers()

    def plan(self, batch: Batch) -> AttentionPlan:
        """Everything the attention of this step needs, computed once for all layers."""
        return plan_attention(batch.query_start, batch.num_cached, batch.block_tables, batch.slot_mapping,
                              self.block_size, self.model.config.num_key_value_heads, self.buffers,
                              backend=self.attention_backend, num_blocks=self.kv_cache.num_blocks)

    def paged_attend(self, batch: Batch) -> "PagedAttend":
        """The attention function the model calls at each layer, for this batch."""
        return PagedAttend(self.kv_cache, self.plan(batch))

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits (S, vocab) for the rows in batch.logits_indices, in that order, float32 at least."""
        hidden = self.model(batch.input_ids, batch.positions, self.paged_attend(batch))
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        # Exact for bfloat16, and PyTorch's argmax over bfloat16 on CPU is scalar code: 20 ms for
        # 64 rows of 49,152 logits.
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

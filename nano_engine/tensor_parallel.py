"""Tensor parallelism: one model cut between processes, with one process's bits at every degree.

The engine does not change: one scheduler, one block pool, one block table per request, in the
engine's process. Only the runner changes: executor.py's ParallelRunner starts `tensor_parallel_size`
ranks (rank 0 in the engine's process, the others as workers, parallel/workers.py), hands each
its shard of the weights once (`TensorPlan` says which), and at every step hands every rank the step's batch; each rank
runs the whole forward pass over its shard and its own KV cache, which holds only its KV heads,
at the same slots, since the block table is the same for every rank.

What a rank holds (Megatron's split, as vLLM's layers make it, vllm/model_executor/layers/):

* its KV heads, which parallel/split.py assigns (`Split.of`: a contiguous run of them), and the
  query heads that share them: rows of q, k and v (column-parallel: QKVParallelLinear) and the
  matching columns of o_proj (row-parallel: RowParallelLinear);
* as many leaves of the MLP's intermediate columns: rows of gate and up (MergedColumnParallelLinear),
  columns of down_proj (row-parallel);
* a contiguous range of the vocabulary: rows of the embedding (VocabParallelEmbedding) and of the
  LM head (ParallelLMHead), whose logits go to rank 0 (vLLM gathers them there too);
* the norms, whole.

A column-parallel output is computed whole by one rank, with the kernels' bits, which do not
depend on how many columns a call has. A row-parallel output is a sum over K: each rank sums its
leaves in their subtree of the layer's fixed tree (the same additions one process makes,
mini_llm.Linear), the ranks' sums go to every rank (an all-gather), and every rank adds them in
the levels of the tree above (`Split.combine`). So a rank never adds in an order that the number
of ranks chose, and every degree gives one process's logits, bit for bit (tests/test_tensor_parallel.py).
An embedding row is copied from the rank that owns it: exact too.

A step's collectives: two all-gathers a layer (where vLLM all-reduces twice) and one for the
embedding, 2 * layers + 1 (61 for the embedded model's 30 layers); then one gather of the logits to
rank 0, besides the broadcast of the step's batch that opens it (parallel/workers.py, Workers.call).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .mini_llm import ModelConfig, Transformer
from .parallel.split import Split, bounds
from .parallel.workers import Group, max_ranks
from .runner import Batch

__all__ = ["NoGroup", "ShardedTransformer", "TensorPlan", "check_degree", "weight_names"]


def check_degree(cfg: ModelConfig, tensor_parallel_size: int) -> Split:
    """The split of this model between that many ranks; refused, naming the numbers, where the
    model or the machine cannot run it (before any process starts)."""
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: the model's {cfg.num_attention_heads} query "
                         f"heads do not divide into its {cfg.num_key_value_heads} KV heads")
    split = Split.of(cfg.num_key_value_heads, tensor_parallel_size)
    if tensor_parallel_size > max_ranks():
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} is more ranks than this machine runs: at most "
                         f"{max_ranks()} (two a core, {max_ranks() // 2} cores)")
    if tensor_parallel_size > cfg.vocab_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} is more than the {cfg.vocab_size} "
                         f"vocabulary rows to split")
    return split


@dataclass(frozen=True)
class Shard:
    """The ranges of the whole model's weights that one rank holds."""

    q: tuple[int, int]  # rows of q_proj (columns of o_proj): its query heads x head_dim
    kv: tuple[int, int]  # rows of k_proj and v_proj: its KV heads x head_dim
    mlp: tuple[int, int]  # rows of gate_proj and up_proj, columns of down_proj
    vocab: tuple[int, int]  # rows of the embedding and the LM head
    o_leaves: tuple[int, ...]  # o_proj's leaf bounds over the whole K
    mlp_leaves: tuple[int, ...]  # down_proj's

    @classmethod
    def of(cls, cfg: ModelConfig, split: Split, rank: int) -> "Shard":
        node, hd = split.nodes[rank], cfg.head_dim
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        o = tuple(bounds(cfg.num_attention_heads * hd, split.leaves))  # mini_llm.Attention's leaves
        mlp = tuple(bounds(cfg.intermediate_size, split.leaves))  # mini_llm.MLP's
        vocab = bounds(cfg.vocab_size, split.ranks)
        return cls(q=(node.lo * group * hd, node.hi * group * hd), kv=(node.lo * hd, node.hi * hd),
                   mlp=(mlp[node.lo], mlp[node.hi]), vocab=(vocab[rank], vocab[rank + 1]), o_leaves=o, mlp_leaves=mlp)

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The shard's own shape: its heads, its MLP columns, its vocabulary rows."""
        size = lambda r: r[1] - r[0]  # noqa: E731
        return replace(cfg, num_attention_heads=size(self.q) // cfg.head_dim,
                       num_key_value_heads=size(self.kv) // cfg.head_dim,
                       intermediate_size=size(self.mlp), vocab_size=size(self.vocab))

    def cut(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole model's tensor `name` (a view where it can be one)."""
        rows = {"q_proj": self.q, "k_proj": self.kv, "v_proj": self.kv, "gate_proj": self.mlp, "up_proj": self.mlp,
                "embed_tokens": self.vocab, "lm_head": self.vocab}
        cols = {"o_proj": self.q, "down_proj": self.mlp}
        module = name.rsplit(".", 2)[-2] if name.count(".") else name
        if module in rows:
            return t[rows[module][0]:rows[module][1]]
        if module in cols:
            return t[:, cols[module][0]:cols[module][1]]
        return t  # the norms: every rank holds them whole


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of one range of the vocabulary (vLLM's VocabParallelEmbedding). Every rank
    looks up every token in its rows (a token outside them reads row 0: a placeholder), the ranks'
    results go to every rank, and each token's row is taken from the rank that owns its id: a copy,
    exact. (vLLM zeroes the placeholders and all-reduces: a sum with zeros, also exact but for the
    sign of a zero.)"""

    def __init__(self, vocab: list[int], rank: int, hidden: int, group: Group):
        super().__init__()
        self.lo, self.hi, self.group = vocab[rank], vocab[rank + 1], group
        self.starts = vocab[1:-1]  # where ranks 1 .. N - 1 begin (a list: the shard is made on the meta device)
        self._starts: torch.Tensor | None = None  # the same as a tensor of the ids' dtype, made at the first step
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, hidden))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = F.embedding((input_ids - self.lo).clamp(0, self.hi - self.lo - 1), self.weight)
        if self._starts is None or self._starts.dtype != input_ids.dtype:
            self._starts = torch.tensor(self.starts, dtype=input_ids.dtype)
        owner = torch.bucketize(input_ids, self._starts, right=True)
        return torch.stack(self.group.all_gather(local))[owner, torch.arange(len(input_ids))]


class ShardedTransformer(Transformer):
    """One rank's Transformer: mini_llm's own layers on the shard's shape, with the row-parallel
    layers' `reduce` and the vocabulary split. The whole-model config stays in `full_config`."""

    def __init__(self, cfg: ModelConfig, split: Split, group: Group):
        shard = Shard.of(cfg, split, group.rank)
        super().__init__(shard.config(cfg))
        self.full_config, self.split, self.group, self.shard = cfg, split, group, shard
        node = split.nodes[group.rank]
        for block in self.model.layers:
            for layer, whole in ((block.self_attn.o_proj, shard.o_leaves), (block.mlp.down_proj, shard.mlp_leaves)):
                layer.leaves = tuple(b - whole[node.lo] for b in whole[node.lo:node.hi + 1])
                layer.node, layer.reduce = node, self._reduce
        self.vocab = bounds(cfg.vocab_size, split.ranks)  # rank r's ids: vocab[r] .. vocab[r + 1] - 1
        self.vocab_width = max(b - a for a, b in zip(self.vocab, self.vocab[1:]))  # the widest share
        self.model.embed_tokens = VocabParallelEmbedding(self.vocab, group.rank, cfg.hidden_size, group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's whole sum from this rank's subtree sum: every rank's, added in the tree."""
        return self.split.combine(self.group.all_gather(partial))

    def _one_call(self, attend):  # the one-call decoder has no collectives inside: layer by layer here
        return None

    def rank_forward(self, batch: Batch, attend) -> torch.Tensor | None:
        """One step on this rank: logits (S, vocab) on rank 0, as ModelRunner.forward gives them; None elsewhere."""
        hidden = self(batch.input_ids, batch.positions, attend)
        return self.compute_logits(hidden[batch.logits_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The whole vocabulary's logits (float32 at least) on rank 0, from every rank's columns;
        None on the other ranks."""
        local = self.lm_head(hidden)
        local = local.to(torch.promote_types(local.dtype, torch.float32))
        if hidden.shape[0] == 0:  # nothing samples this step (every rank knows: the batch is the same)
            return local.new_empty(0, self.full_config.vocab_size) if self.group.rank == 0 else None
        parts = self.group.gather(F.pad(local, (0, self.vocab_width - local.shape[1])))  # shares of one width
        if parts is None:
            return None
        return torch.cat([p[:, :b - a] for p, a, b in zip(parts, self.vocab, self.vocab[1:])], dim=1)


def weight_names(model: Transformer) -> dict[str, torch.Size]:
    """A rank model's weights, in the order they travel (a tied LM head is the embedding: not twice)."""
    return {name: t.shape for name, t in model.state_dict().items()
            if not (model.config.tie_word_embeddings and name == "lm_head.weight")}


@dataclass
class NoGroup:
    """A rank number without a group: to build a rank's model on the meta device, where nothing runs."""

    rank: int
    size: int


@dataclass(frozen=True)
class TensorPlan:
    """Which shard of the model each of `ranks` ranks holds (executor.py builds and runs them)."""

    config: ModelConfig
    split: Split

    @property
    def ranks(self) -> int:
        return self.split.ranks

    def meta(self, group) -> ShardedTransformer:
        """Rank group.rank's model, on the meta device: its shapes, no memory."""
        with torch.device("meta"):
            return ShardedTransformer(self.config, self.split, group)

    def cut(self, model: Transformer, rank: int) -> dict[str, torch.Tensor]:
        """Rank `rank`'s weights, cut from the whole model's (contiguous: ready to send), by _names."""
        shard = Shard.of(model.config, self.split, rank)
        whole = model.state_dict()
        out = {}
        for name, shape in weight_names(self.meta(NoGroup(rank, self.ranks))).items():
            out[name] = shard.cut(name, whole[name]).contiguous()
            if out[name].shape != shape:
                raise AssertionError(f"{name}: cut {tuple(out[name].shape)}, the shard needs {tuple(shape)}")
        return out

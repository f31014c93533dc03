"""Tensor parallelism: one model cut between processes, with one process's bits at every degree.

The engine does not change: one scheduler, one block pool, one block table per request, in the
engine's process. Only the runner changes. `TensorParallelRunner` starts `tensor_parallel_size`
ranks (rank 0 in the engine's process, the others as workers, parallel/workers.py), hands each
its shard of the weights once, and at every step hands every rank the step's batch; each rank
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

Two collectives a layer (vLLM: two all-reduces), one for the embedding and one gather of the
logits: 2 * layers + 2 a step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from . import checks
from .kernels import paged_attention as kernels
from .mini_llm import ModelConfig, Transformer, rope_inv_freq
from .parallel.split import Split, bounds
from .parallel.workers import Group, Workers, WorkerError, max_ranks
from .runner import Batch, ModelRunner

__all__ = ["ParallelConfig", "TensorParallelRunner", "WorkerError", "check_degree", "shard_state"]


@dataclass
class ParallelConfig:
    """How many processes run the model (vLLM's `vllm/config/parallel.py`, ParallelConfig)."""

    tensor_parallel_size: int = 1
    # Seconds a rank waits in a collective for the others before the step fails: a hung rank.
    worker_timeout_s: float = 120.0

    def __post_init__(self):
        self.tensor_parallel_size = checks.integer("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        self.worker_timeout_s = checks.number("worker_timeout_s", self.worker_timeout_s, minimum=1e-3)


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
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, hidden))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = F.embedding((input_ids - self.lo).clamp(0, self.hi - self.lo - 1), self.weight)
        owner = torch.bucketize(input_ids, torch.tensor(self.starts, dtype=input_ids.dtype), right=True)
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
        self.model.embed_tokens = VocabParallelEmbedding(bounds(cfg.vocab_size, split.ranks), group.rank,
                                                         cfg.hidden_size, group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's whole sum from this rank's subtree sum: every rank's, added in the tree."""
        return self.split.combine(self.group.all_gather(partial))

    def _one_call(self, attend):  # the one-call decoder has no collectives inside: layer by layer here
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The whole vocabulary's logits (float32 at least) on rank 0, from every rank's columns;
        None on the other ranks."""
        local = self.lm_head(hidden)
        local = local.to(torch.promote_types(local.dtype, torch.float32))
        vocab = bounds(self.full_config.vocab_size, self.split.ranks)
        if hidden.shape[0] == 0:  # nothing samples this step (every rank knows: the batch is the same)
            return local.new_empty(0, self.full_config.vocab_size) if self.group.rank == 0 else None
        width = max(b - a for a, b in zip(vocab, vocab[1:]))
        parts = self.group.gather(F.pad(local, (0, width - local.shape[1])))
        if parts is None:
            return None
        return torch.cat([p[:, :b - a] for p, a, b in zip(parts, vocab, vocab[1:])], dim=1)


def _meta_shard(cfg: ModelConfig, split: Split, group: Group) -> ShardedTransformer:
    with torch.device("meta"):
        return ShardedTransformer(cfg, split, group)


def _names(shard: ShardedTransformer) -> dict[str, torch.Size]:
    """The shard's weights, in the order they travel (a tied LM head is the embedding: not twice)."""
    return {name: t.shape for name, t in shard.state_dict().items()
            if not (shard.config.tie_word_embeddings and name == "lm_head.weight")}


def shard_state(model: Transformer, split: Split, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights, cut from the whole model's (contiguous: ready to send)."""
    shard = Shard.of(model.config, split, rank)
    whole = model.state_dict()
    out = {}
    for name, shape in _names(_meta_shard(model.config, split, _Nobody(rank, split.ranks))).items():
        out[name] = shard.cut(name, whole[name]).contiguous()
        if out[name].shape != shape:
            raise AssertionError(f"{name}: cut {tuple(out[name].shape)}, the shard needs {tuple(shape)}")
    return out


@dataclass
class _Nobody:
    """A rank number without a group: to build a shard on the meta device, where nothing runs."""

    rank: int
    size: int


@dataclass(frozen=True)
class RankSpec:
    """What a worker needs to build its rank (no tensors: those come over the group)."""

    config: ModelConfig
    split: Split
    dtype: torch.dtype
    fused: bool  # q/k/v and gate/up as one matmul each (Transformer.fuse)
    prepack: bool  # the packed kernels (Transformer.prepack)
    num_blocks: int
    block_size: int
    attention_backend: str


class RankRunner(ModelRunner):
    """One rank's runner: its shard and its KV cache (its KV heads, every block)."""

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits (S, vocab) on rank 0, as ModelRunner.forward gives them; None on the others."""
        hidden = self.model(batch.input_ids, batch.positions, self.paged_attend(batch))
        return self.model.compute_logits(hidden[batch.logits_indices])


def _build(spec: RankSpec, group: Group, state: dict[str, torch.Tensor]) -> RankRunner:
    shard = _meta_shard(spec.config, spec.split, group)
    shard.load_state_dict(state, strict=False, assign=True)
    if spec.config.tie_word_embeddings:
        shard.lm_head.weight = shard.model.embed_tokens.weight
    shard.inv_freq = rope_inv_freq(spec.config)
    shard = shard.to(spec.dtype).eval().requires_grad_(False)
    if spec.fused:
        shard.fuse()
    if spec.prepack:
        shard.prepack()
    return RankRunner(shard, spec.num_blocks, spec.block_size, spec.attention_backend)


def _worker_rank(spec: RankSpec, group: Group) -> RankRunner:
    """A worker's rank: its weights from rank 0, in the order _names gives."""
    names = _names(_meta_shard(spec.config, spec.split, group))
    state = {name: group.recv(torch.empty(shape, dtype=spec.dtype), 0) for name, shape in names.items()}
    return _build(spec, group, state)


def _main_rank(model: Transformer, spec: RankSpec, group: Group) -> RankRunner:
    """Rank 0, in the engine's process: sends each worker its weights, then builds its own shard."""
    for rank in range(1, group.size):
        for t in shard_state(model, spec.split, rank).values():
            group.send(t, rank)
    return _build(spec, group, shard_state(model, spec.split, 0))


class TensorParallelRunner:
    """ModelRunner's place in the engine at tensor_parallel_size > 1: `forward(batch)` runs the
    step on every rank and returns rank 0's logits. `close()` stops the workers (LLMEngine.close)."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, attention_backend: str = "torch",
                 parallel_config: ParallelConfig | None = None):
        config = parallel_config or ParallelConfig()
        cfg = model.config
        split = check_degree(cfg, config.tensor_parallel_size)
        self.block_size, self.tensor_parallel_size = block_size, config.tensor_parallel_size
        self.attention_backend = kernels.resolve_backend(attention_backend, model.dtype)
        if self.attention_backend == "c":
            kernels.check_dtype(model.dtype)
            kernels.library()  # built here, once, before the workers load it
        itemsize = torch.empty((), dtype=model.dtype).element_size()
        checks.fits_in_memory(f"a KV cache of num_blocks={num_blocks} x block_size={block_size} x "
                              f"{cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads x head_dim "
                              f"{cfg.head_dim} ({model.dtype}, K and V, all ranks together)",
                              2 * cfg.num_hidden_layers * num_blocks * block_size * cfg.num_key_value_heads
                              * cfg.head_dim * itemsize)
        fused_qkv = getattr(model.model.layers[0].self_attn, "qkv_weight", None) is not None
        spec = RankSpec(cfg, split, model.dtype, fused_qkv, model.prepacked, num_blocks, block_size,
                        self.attention_backend)
        self.workers = Workers(config.tensor_parallel_size, functools.partial(_worker_rank, spec),
                               config.worker_timeout_s, main=functools.partial(_main_rank, model, spec))

    @property
    def kv_cache(self):
        """Rank 0's KV cache (its KV heads)."""
        return self.workers.obj.kv_cache

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.workers.call("forward", batch)

    def close(self) -> None:
        self.workers.close()

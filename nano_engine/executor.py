"""The ranks of an engine on several processes: each built from a plan, given its weights once, and
run on every step's batch (vLLM's `vllm/v1/executor/multiproc_executor.py` and its workers).

The engine stays one: its scheduler, block pool and block tables live in its own process, and so
does rank 0. `ParallelRunner` takes ModelRunner's place there. It starts the other ranks
(parallel/workers.py), sends each the weights its plan gives it, and at every step hands every rank
the step's batch; rank 0 returns the logits. A plan says what each rank holds:

* `TensorPlan` (tensor_parallel.py): every layer, a share of each (its KV heads, its MLP columns,
  its vocabulary rows);
* `PipelinePlan` (pipeline_parallel.py): whole layers, a run of them (a stage).

Each rank runs a ModelRunner of its own over its model (`RankRunner`): its KV cache holds what its
layers and heads need, in every block, at the slots of the engine's one block table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import checks
from .kernels import paged_attention as kernels
from .mini_llm import Transformer, rope_inv_freq
from .paged import PagedKVCache
from .parallel.workers import Group, WorkerError, Workers
from .pipeline_parallel import PipelinePlan, check_stages
from .runner import Batch, ModelRunner
from .tensor_parallel import TensorPlan, check_degree, weight_names

__all__ = ["ParallelConfig", "ParallelRunner", "WorkerError", "make_plan"]


@dataclass
class ParallelConfig:
    """How many processes run the model (vLLM's `vllm/config/parallel.py`, ParallelConfig)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Seconds a rank waits in a collective for the others before the step fails: a hung rank.
    worker_timeout_s: float = 120.0

    def __post_init__(self):
        self.tensor_parallel_size = checks.integer("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        self.pipeline_parallel_size = checks.integer("pipeline_parallel_size", self.pipeline_parallel_size, minimum=1)
        # at most a week: torch.distributed keeps a timeout as milliseconds in a C int (24.8 days)
        self.worker_timeout_s = checks.number("worker_timeout_s", self.worker_timeout_s, minimum=1e-3,
                                              maximum=7 * 24 * 3600)
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} with pipeline_parallel_size="
                             f"{self.pipeline_parallel_size}: one or the other here, not both at once")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def make_plan(model: Transformer, config: ParallelConfig) -> TensorPlan | PipelinePlan:
    """The plan for this model at these sizes; refused, naming the numbers, where it cannot run."""
    if config.world_size > 1 and model.quantization is not None:
        raise ValueError(f"a model with {model.quantization} weights runs on one process (tensor_parallel_size="
                         f"{config.tensor_parallel_size}, pipeline_parallel_size={config.pipeline_parallel_size}): "
                         f"the ranks would get its float weights, not its integers")
    if config.pipeline_parallel_size > 1:
        return PipelinePlan(model.config, check_stages(model.config, config.pipeline_parallel_size),
                            model.config.tie_word_embeddings)
    return TensorPlan(model.config, check_degree(model.config, config.tensor_parallel_size))


@dataclass(frozen=True)
class RankSpec:
    """What a worker needs to build its rank (no tensors: those come over the group)."""

    plan: TensorPlan | PipelinePlan
    dtype: torch.dtype
    fused: bool  # q/k/v and gate/up as one matmul each (Transformer.fuse)
    prepack: bool  # the packed kernels (Transformer.prepack)
    num_blocks: int
    block_size: int
    attention_backend: str


class RankRunner(ModelRunner):
    """One rank's runner: its model and its KV cache."""

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits (S, vocab) on rank 0, as ModelRunner.forward gives them; None on the others."""
        return self.model.rank_forward(batch, self.paged_attend(batch))


def _build(spec: RankSpec, group: Group, state: dict[str, torch.Tensor]) -> RankRunner:
    model = spec.plan.meta(group)
    model.load_state_dict(state, strict=False, assign=True)
    if model.config.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(model.config)
    model = model.to(spec.dtype).eval().requires_grad_(False)
    if spec.fused:
        model.fuse()
    if spec.prepack:
        model.prepack()
    return RankRunner(model, spec.num_blocks, spec.block_size, spec.attention_backend)


def _worker_rank(spec: RankSpec, group: Group) -> RankRunner:
    """A worker's rank: its weights from rank 0, in the order weight_names gives."""
    names = weight_names(spec.plan.meta(group))
    state = {name: group.recv(torch.empty(shape, dtype=spec.dtype), 0) for name, shape in names.items()}
    return _build(spec, group, state)


def _main_rank(model: Transformer, spec: RankSpec, group: Group) -> RankRunner:
    """Rank 0, in the engine's process: sends each worker its weights, then builds its own model."""
    for rank in range(1, group.size):
        for t in spec.plan.cut(model, rank).values():
            group.send(t, rank)
    return _build(spec, group, spec.plan.cut(model, 0))


class ParallelRunner:
    """ModelRunner's place in the engine on several processes: `forward(batch)` runs the step on
    every rank and returns rank 0's logits. `close()` stops the workers (LLMEngine.close)."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, attention_backend: str = "torch",
                 parallel_config: ParallelConfig | None = None):
        config = parallel_config or ParallelConfig()
        cfg = model.config
        self.plan = make_plan(model, config)  # before anything else: a refused size starts nothing
        self.block_size = block_size
        self.attention_backend = kernels.resolve_backend(attention_backend, model.dtype)
        if self.attention_backend == "c":
            kernels.check_dtype(model.dtype)
            kernels.library()  # built here, once, before the workers load it
        PagedKVCache.check_fits(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                                model.dtype, where=", all ranks together")
        fused_qkv = getattr(model.model.layers[0].self_attn, "qkv_weight", None) is not None
        spec = RankSpec(self.plan, model.dtype, fused_qkv, model.prepacked, num_blocks, block_size,
                        self.attention_backend)
        self.workers = Workers(config.world_size, functools.partial(_worker_rank, spec),
                               config.worker_timeout_s, main=functools.partial(_main_rank, model, spec))

    @property
    def kv_cache(self):
        """Rank 0's KV cache (its KV heads, or its stage's layers)."""
        return self.workers.obj.kv_cache

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.workers.call("forward", batch)

    def close(self) -> None:
        self.workers.close()

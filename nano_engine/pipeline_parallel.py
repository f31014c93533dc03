"""Pipeline parallelism: the model's layers cut into stages, one process each, the hidden states sent
from stage to stage (vLLM's `pipeline_parallel_size`: `vllm/model_executor/models/utils.py`,
make_layers and PPMissingLayer; `vllm/v1/worker/gpu_model_runner.py` hands IntermediateTensors on).

Stage s holds layers bounds[s] .. bounds[s + 1] - 1 and their KV cache (every block, its layers
only); the first also holds the embedding, the last the final norm and the LM head. At every step
each stage receives the step's batch (executor.py), the first embeds the tokens and runs its
layers, hands (x, delta) to the next (the residual stream and the last block's output not yet
added to it: mini_llm.Block.step), and so on; the last computes the logits and sends them to
rank 0. Nothing is added in another order than in one process, so the bits are one process's by
construction (tests/test_pipeline_parallel.py checks every step's logits with torch.equal).

With one batch in flight, one stage works at a time: the others wait (the bubble). vLLM keeps
several batches in flight (one per stage, `max_concurrent_batches`), which needs a scheduler that
schedules the next batch before the last one's tokens are known; ours schedules one step at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from .mini_llm import ModelConfig, Transformer, rope_cos_sin
from .parallel.split import bounds
from .parallel.workers import Group, max_ranks
from .runner import Batch
from .tensor_parallel import NoGroup, weight_names

__all__ = ["PipelinePlan", "StageTransformer", "check_stages"]


def check_stages(cfg: ModelConfig, pipeline_parallel_size: int) -> tuple[int, ...]:
    """Where each stage's layers begin, and the end: near-equal runs (vLLM's get_pp_indices splits
    them the same way); refused, naming the numbers, where the model or the machine cannot run it."""
    if pipeline_parallel_size > cfg.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} is more stages than the model's "
                         f"{cfg.num_hidden_layers} layers")
    if pipeline_parallel_size > max_ranks():
        raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} is more processes than this machine "
                         f"runs: at most {max_ranks()} (two a core, {max_ranks() // 2} cores)")
    return tuple(bounds(cfg.num_hidden_layers, pipeline_parallel_size))


class StageTransformer(Transformer):
    """One stage's Transformer: mini_llm's layers for its run of layers (numbered from 0 here), the
    embedding on the first stage, the norm and LM head on the last (and the embedding there too
    when the LM head is tied to it)."""

    def __init__(self, cfg: ModelConfig, stages: tuple[int, ...], group: Group):
        self.first_layer, end = stages[group.rank], stages[group.rank + 1]
        super().__init__(replace(cfg, num_hidden_layers=end - self.first_layer))
        self.full_config, self.group, self.stages = cfg, group, stages
        self.first, self.last = group.rank == 0, group.rank == len(stages) - 2
        if not (self.first or (self.last and cfg.tie_word_embeddings)):
            self.model.embed_tokens = None
        if not self.last:
            self.lm_head = None

    def _one_call(self, attend):  # the stages hand tensors on between layers: layer by layer here
        return None

    def rank_forward(self, batch: Batch, attend) -> torch.Tensor | None:
        """This stage's part of one step: logits (S, vocab) on rank 0, float32 at least; None elsewhere."""
        rank, shape = self.group.rank, (batch.num_tokens, self.config.hidden_size)
        if self.first:
            x, delta = self.model.embed_tokens(batch.input_ids), None
        else:
            x, delta = (self.group.recv(torch.empty(shape, dtype=self.dtype), rank - 1) for _ in range(2))
        cos, sin = rope_cos_sin(self.inv_freq, batch.positions, x.dtype)
        for block in self.model.layers:
            x, delta = block.step(x, delta, cos, sin, attend)
        rows = len(batch.logits_indices)
        if not self.last:
            self.group.send(x, rank + 1)
            self.group.send(delta, rank + 1)
            if not self.first:
                return None
            logits = torch.empty(rows, self.full_config.vocab_size, dtype=torch.promote_types(self.dtype, torch.float32))
            return self.group.recv(logits, len(self.stages) - 2) if rows else logits
        hidden = self.model.norm.add(x, delta)[1]
        logits = self.compute_logits(hidden[batch.logits_indices])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if rows:
            self.group.send(logits, 0)
        return None


@dataclass(frozen=True)
class PipelinePlan:
    """Which layers each of the stages holds (executor.py builds and runs them)."""

    config: ModelConfig
    stages: tuple[int, ...]  # stage s: layers stages[s] .. stages[s + 1] - 1
    tied: bool

    @property
    def ranks(self) -> int:
        return len(self.stages) - 1

    def meta(self, group) -> StageTransformer:
        with torch.device("meta"):
            return StageTransformer(self.config, self.stages, group)

    def cut(self, model: Transformer, rank: int) -> dict[str, torch.Tensor]:
        """Stage `rank`'s weights, from the whole model's, by weight_names (its layers renumbered from 0)."""
        whole, first = model.state_dict(), self.stages[rank]
        global_name = lambda name: re.sub(r"^model\.layers\.(\d+)\.",  # noqa: E731
                                          lambda m: f"model.layers.{int(m.group(1)) + first}.", name)
        return {name: whole[global_name(name)].contiguous()
                for name in weight_names(self.meta(NoGroup(rank, self.ranks)))}

"""The engine loop: requests in, one scheduled forward pass per step, tokens out.

`LLMEngine.step()` is three calls, as in vLLM V1's `vllm/v1/engine/core.py` (EngineCore.step):
schedule, run the model, update the requests from its output. Every step is recorded in
`step_log` (who got how many tokens, prefill or decode, preemptions, free blocks, queue lengths),
which is what the chapters' traces and timelines are drawn from.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, fields
from typing import Sequence

from .mini_llm import Transformer
from .paged import BlockPool
from .request import Request, RequestStatus, SamplingParams
from .runner import ModelRunner, SeqChunk, build_batch
from .sampling import sample
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput


@dataclass
class EngineConfig(SchedulerConfig):
    num_blocks: int = 256
    block_size: int = 16
    enable_prefix_caching: bool = True

    def __post_init__(self):
        super().__post_init__()
        for name in ("num_blocks", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(**{f.name: getattr(self, f.name) for f in fields(SchedulerConfig)})


@dataclass
class StepRecord:
    step: int
    start: float  # seconds since the engine was created
    duration: float  # seconds
    scheduled: list[tuple[str, int, str]]  # (request_id, tokens, "prefill" | "decode" | "recompute")
    preempted: list[str]
    finished: list[str]
    num_free_blocks: int  # at the end of the step
    waiting_ids: list[str]  # at the end of the step
    running_ids: list[str]  # at the end of the step (some may have got no tokens in it)
    num_sampled: int = 0  # rows that sampled a token (the LM head ran on these only)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting_ids)

    @property
    def num_running(self) -> int:
        return len(self.running_ids)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n, _ in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens that are not decodes: prompt chunks and recomputed ones."""
        return sum(n for _, n, kind in self.scheduled if kind != "decode")

    @property
    def num_requests(self) -> int:
        return len(self.scheduled)


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    tokens: int = 0  # tokens processed by the model
    recomputed_tokens: int = 0
    seconds: float = 0.0
    finished: list[str] = field(default_factory=list)


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer=None, config: EngineConfig | None = None,
                 scheduler_cls: type[Scheduler] = Scheduler, **kwargs):
        """`scheduler_cls` swaps in another Scheduler (a learner's, in the exercises)."""
        if config is not None and kwargs:
            raise ValueError("pass either config or keyword settings, not both")
        self.config = config or EngineConfig(**kwargs)
        self.model, self.tokenizer = model, tokenizer
        self.block_pool = BlockPool(self.config.num_blocks, self.config.enable_prefix_caching)
        self.scheduler = scheduler_cls(self.config.scheduler_config(), self.block_pool, self.config.block_size)
        self.runner = ModelRunner(model, self.config.num_blocks, self.config.block_size)
        eos = model.config.eos_token_id
        self.eos_token_ids = {eos} if isinstance(eos, int) else set(eos or ())
        self.requests: dict[str, Request] = {}
        self.step_log: list[StepRecord] = []
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._t0 = time.perf_counter()

    @classmethod
    def from_pretrained(cls, path=None, dtype=None, **kwargs) -> "LLMEngine":
        """The embedded model (or `path`, or $NANO_ENGINE_MODEL) with its tokenizer."""
        import torch

        from .loading import load_tokenizer

        model = Transformer.from_pretrained(path, dtype=dtype or torch.float32)
        return cls(model, load_tokenizer(path), **kwargs)

    # ----- requests -----
    def add_request(self, prompt_ids: Sequence[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError for anything that could never run."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        vocab = self.model.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) and not hasattr(t, "__index__"):
                raise ValueError(f"token id {t!r} is not an integer")
            if not 0 <= int(t) < vocab:
                raise ValueError(f"token id {int(t)} is outside the vocabulary [0, {vocab})")
        total = len(ids) + params.max_tokens
        max_len = self.model.config.max_position_embeddings
        if total > max_len:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) = {total} tokens, "
                             f"above the model's max_position_embeddings={max_len}")
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self.requests and not self.requests[rid].is_finished:
            raise ValueError(f"request_id {rid!r} is already in use")
        req = Request(rid, [int(t) for t in ids], params, priority=priority, seq=len(self.requests),
                      arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        self.scheduler.add_request(req)  # may refuse a request that can never fit
        self.requests[rid] = req
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request and free everything it holds."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"no request with id {request_id!r}")
        if not req.is_finished:
            self.scheduler.finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----- one step -----
    def step(self) -> list[Request]:
        """Schedule, run one forward pass, sample and update. Returns the requests that finished."""
        t = time.perf_counter()
        out = self.scheduler.schedule()
        finished: list[Request] = []
        samplers: list[Request] = []
        if out.chunks:
            logits = self.runner.forward(self._batch(out))
            samplers = [c.request for c in out.chunks if c.start + c.n == c.request.num_tokens]
            tokens = sample(logits, [r.sampling_params for r in samplers], [r.generator for r in samplers])
            finished = self._update(out, dict(zip(map(id, samplers), tokens)))
        self._log(out, finished, t, len(samplers))
        return finished

    def _batch(self, out: SchedulerOutput):
        chunks = []
        for c in out.chunks:
            req = c.request
            chunks.append(SeqChunk(req.all_token_ids[c.start:c.start + c.n], c.start, req.block_ids,
                                   sample=c.start + c.n == req.num_tokens))
        return build_batch(chunks, self.config.block_size)

    def _update(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Request]:
        now, bs = time.perf_counter(), self.config.block_size
        finished = []
        for c in out.chunks:
            req = c.request
            req.num_computed = c.start + c.n
            # Full blocks now hold computed KV: name them so later prompts can share them.
            full = req.num_computed // bs
            self.block_pool.cache_blocks(req.block_ids, self.scheduler.hashes(req, full), c.start // bs)
            token = sampled.get(id(req))
            if token is None:
                continue
            req.output_ids.append(token)
            req.token_times.append(now)
            sp = req.sampling_params
            if (token in self.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
                self.scheduler.finish(req, "stop")
            elif len(req.output_ids) >= sp.max_tokens:
                self.scheduler.finish(req, "length")
            if req.is_finished:
                finished.append(req)
        return finished

    def _log(self, out: SchedulerOutput, finished: list[Request], t: float, num_sampled: int) -> None:
        end = time.perf_counter()
        rec = StepRecord(
            step=len(self.step_log), start=t - self._t0, duration=end - t,
            scheduled=[(c.request.request_id, c.n, c.kind) for c in out.chunks],
            preempted=[r.request_id for r in out.preempted],
            finished=[r.request_id for r in finished],
            num_free_blocks=self.block_pool.num_free,
            waiting_ids=[r.request_id for r in self.scheduler.waiting],
            running_ids=[r.request_id for r in self.scheduler.running],
            num_sampled=num_sampled,
        )
        self.step_log.append(rec)
        s = self.stats
        s.steps += 1
        s.preemptions += len(out.preempted)
        s.tokens += rec.num_tokens
        s.recomputed_tokens += sum(n for _, n, kind in rec.scheduled if kind == "recompute")
        s.seconds += rec.duration
        s.finished.extend(rec.finished)

    # ----- the whole loop -----
    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Request]:
        """Run prompts to completion; returns their finished requests in the same order."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, sampling_params):
                ids.append(self.add_request(p, sp))
        except ValueError:
            for rid in ids:  # all or nothing: a bad prompt leaves no half-added batch behind
                self.abort(rid)
            raise
        while any(not self.requests[i].is_finished for i in ids):
            self.step()
            if not self.step_log[-1].scheduled:  # cannot happen for validated requests; never hang
                raise RuntimeError(f"step {self.step_log[-1].step} scheduled nothing with "
                                   f"{len(self.scheduler.waiting)} requests waiting")
        return [self.requests[i] for i in ids]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (only possible when no request holds blocks)."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("cannot reset the prefix cache while requests are unfinished")
        self.block_pool = BlockPool(self.config.num_blocks, self.config.enable_prefix_caching)
        self.scheduler.pool = self.block_pool


__all__ = ["EngineConfig", "LLMEngine", "RequestStatus", "StepRecord"]

"""A request and its sampling parameters: the state the scheduler moves forward.

There is no prefill phase and no decode phase. A request only knows how many of its tokens
(prompt + generated) exist, `num_tokens`, and how many have their KV in the cache, `num_computed`.
The scheduler's job is to let `num_computed` catch up with `num_tokens`. Mirrors vLLM V1's
`vllm/v1/request.py` (Request, RequestStatus) and `vllm/sampling_params.py` (SamplingParams).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = no nucleus cut
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = no limit)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    priority: int = 0  # smaller is more urgent (vLLM's convention)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    block_ids: list[int] = field(default_factory=list)  # the block table
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    recompute_until: int = 0  # tokens that had KV before the last preemption
    token_times: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None
    seq: int = 0  # arrival order; ties in arrival_time are broken by it
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks

    def __post_init__(self):
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_behind(self) -> int:
        """Tokens still to compute before this request can sample again."""
        return self.num_tokens - self.num_computed

    @property
    def max_kv_tokens(self) -> int:
        """Most KV slots this request can ever hold: the last sampled token is never fed back."""
        return len(self.prompt_ids) + self.sampling_params.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def chunk_kind(self, start: int) -> str:
        """What a chunk starting at token `start` is: 'recompute', 'prefill' or 'decode'.

        Judged by where the chunk starts, never by its length: a 1-token chunk of a prompt is a
        prefill, and redoing KV lost to a preemption is a recompute.
        """
        if self.num_preemptions and start < self.recompute_until:
            return "recompute"
        return "prefill" if start < len(self.prompt_ids) else "decode"

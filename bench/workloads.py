"""The benchmark's workloads, as token ids of the embedded SmolLM2-135M-Instruct.

W1: the identity check's 6 chat prompts, greedy, 24 new tokens, stopping at end of sequence.
W2: 64 raw-text prompts of 25-388 tokens, 16-128 new tokens each, end of sequence ignored, so the
    work is fixed: 12,670 prompt tokens, 4,606 generated.
W3: long prompts that only chunked prefill can fit in a step: 4 prompts of about 2,000 tokens
    (consecutive W2 prompts joined), 32 new tokens each, end of sequence ignored.
W1 and W2 are stored in workloads/ exactly as they were handed out; W3 is derived from W2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent / "workloads"


@dataclass(frozen=True)
class Req:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool


@dataclass(frozen=True)
class Workload:
    name: str
    about: str
    requests: tuple[Req, ...]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    @property
    def max_new_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def subset(self, every: int) -> "Workload":
        """Every `every`-th request (a sample that keeps the mix of lengths)."""
        return Workload(f"{self.name}/{every}", f"every {every}th request of {self.name}",
                        self.requests[::every])

    def head(self, n: int) -> "Workload":
        return Workload(f"{self.name}[:{n}]", f"the first {n} requests of {self.name}", self.requests[:n])


def _load(name: str) -> Workload:
    data = json.loads((HERE / f"{name.lower()}.json").read_text())
    reqs = tuple(Req(tuple(r["prompt_ids"]), r["max_tokens"], r.get("ignore_eos", False))
                 for r in data["requests"])
    return Workload(name, data["about"], reqs)


def w1() -> Workload:
    return _load("W1")


def w2() -> Workload:
    return _load("W2")


def w3(num_prompts: int = 4, prompt_len: int = 2000, max_tokens: int = 32) -> Workload:
    prompts, pool = [], [r.prompt_ids for r in w2().requests]
    i = 0
    for _ in range(num_prompts):
        ids: list[int] = []
        while len(ids) < prompt_len:
            ids.extend(pool[i % len(pool)])
            i += 1
        prompts.append(Req(tuple(ids[:prompt_len]), max_tokens, True))
    return Workload("W3", f"{num_prompts} prompts of {prompt_len} tokens (W2 prompts joined), "
                          f"{max_tokens} new tokens each, end of sequence ignored", tuple(prompts))


WORKLOADS = {"W1": w1, "W2": w2, "W3": w3}

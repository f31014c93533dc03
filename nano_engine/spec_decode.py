"""Speculative decoding: guess a few tokens cheaply, check them all in one forward pass.

A decode step computes one token per request, and on a CPU (or a GPU at small batch) its time is
the time to read the weights: the step costs about the same with 1 new token as with 5. So a
request that has a good guess of its next k tokens (the drafts) gets them all checked in one step:
its chunk is the last token plus the k drafts, the model's logits at each of those positions say
which drafts it would have produced itself (sampling.verify), and the step keeps the accepted
prefix plus one token of the model's own (the correction of the first refused draft, or a bonus
after the last). Nothing in the scheduler is special: drafts are more tokens of the request in the
one token budget (vLLM's `num_tokens_with_spec`), and they need KV slots like any token; the slots
of refused drafts are given back after the step.

The proposer here is vLLM's `ngram` (prompt lookup, `vllm/v1/spec_decode/ngram_proposer.py`): find
the longest n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that ends the request's tokens
and appeared before, at its earliest place, and propose the k tokens that followed it there. It
costs no model at all, and it is good exactly where the output repeats the input: summaries,
edits, code, extraction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from . import checks

METHODS = ("ngram",)


@dataclass
class SpeculativeConfig:
    """vLLM's speculative_config (`vllm/config/speculative.py`), the n-gram method's fields."""
    method: str = "ngram"
    num_speculative_tokens: int = 3  # k: the most drafts per request and step
    prompt_lookup_max: int = 4  # the longest n-gram looked up
    prompt_lookup_min: int | None = None  # the shortest (None: prompt_lookup_max, as vLLM)

    def __post_init__(self):
        self.method = checks.choice("speculative_config method", self.method, METHODS)
        self.num_speculative_tokens = checks.integer("speculative_config num_speculative_tokens",
                                                     self.num_speculative_tokens, minimum=1, maximum=64)
        self.prompt_lookup_max = checks.integer("speculative_config prompt_lookup_max", self.prompt_lookup_max,
                                                minimum=1)
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        self.prompt_lookup_min = checks.integer("speculative_config prompt_lookup_min", self.prompt_lookup_min,
                                                minimum=1, maximum=self.prompt_lookup_max)

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """A SpeculativeConfig from itself, a dict of its fields (vLLM's form), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                            f"'num_speculative_tokens': 3}}, got {type(value).__name__}")
        unknown = sorted(set(value) - {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"})
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}")
        return cls(**value)


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the longest earlier occurrence (the earliest one) of an n-gram
    ending `tokens`, for n from max_n down to min_n; [] if none occurred."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = list(tokens[total - n:])
        first = tail[0]
        for i in range(total - n):  # an occurrence that ends before the tail does
            if tokens[i] == first and list(tokens[i:i + n]) == tail:
                return list(tokens[i + n:i + n + k])
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        c = self.config
        return propose_ngram(tokens, min(k, c.num_speculative_tokens), c.prompt_lookup_min, c.prompt_lookup_max)

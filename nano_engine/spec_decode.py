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

The other proposer is a draft model (vLLM's `draft_model`, `vllm/v1/spec_decode/draft_model.py`):
a smaller model of the same vocabulary decodes k tokens ahead of the target. By default it drafts
greedily and its drafts are checked as the n-gram's are (vLLM's `draft_sample_method="greedy"`:
q is one-hot, so the request's tokens are the ones it gets without drafts); with
`draft_sample_method="probabilistic"` it samples its drafts from its own distribution q, and the
step checks them against the target's p by rejection sampling with that q
(`sampling.verify_probabilistic`), which keeps each token distributed as p and accepts more than
one-hot checking would. Here it runs one request at a time over a cache of its own per request
(vLLM batches it over the target's block tables).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from . import checks, sampling
from .mini_llm import ContiguousKVCache, Transformer
from .models.files import ModelLoadError

METHODS = ("ngram", "draft_model")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "draft_sample_method")


@dataclass
class SpeculativeConfig:
    """vLLM's speculative_config (`vllm/config/speculative.py`), the fields of its n-gram and
    draft-model methods. `method` left out is "draft_model" when a `model` is given, else "ngram"
    (vLLM's rule). `model` is a path (loaded in the target's dtype) or a loaded Transformer."""
    method: str | None = None
    num_speculative_tokens: int = 3  # k: the most drafts per request and step
    prompt_lookup_max: int | None = None  # ngram: the longest n-gram looked up (None: 4)
    prompt_lookup_min: int | None = None  # ngram: the shortest (None: prompt_lookup_max, as vLLM)
    model: object | None = None  # draft_model: a path or a mini_llm.Transformer
    draft_sample_method: str = "greedy"  # draft_model: "greedy" (argmax drafts) or "probabilistic"

    def __post_init__(self):
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        self.method = checks.choice("speculative_config method", self.method, METHODS)
        self.num_speculative_tokens = checks.integer("speculative_config num_speculative_tokens",
                                                     self.num_speculative_tokens, minimum=1, maximum=64)
        self.draft_sample_method = checks.choice("speculative_config draft_sample_method", self.draft_sample_method,
                                                 DRAFT_SAMPLE_METHODS)
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config model is a draft model's; the ngram method takes none "
                                 "(use method 'draft_model')")
            if self.draft_sample_method != "greedy":
                raise ValueError("speculative_config draft_sample_method is a draft model's; n-gram drafts are "
                                 "certain (greedy)")
            if self.prompt_lookup_max is None:
                self.prompt_lookup_max = 4
            self.prompt_lookup_max = checks.integer("speculative_config prompt_lookup_max", self.prompt_lookup_max,
                                                    minimum=1)
            if self.prompt_lookup_min is None:
                self.prompt_lookup_min = self.prompt_lookup_max
            self.prompt_lookup_min = checks.integer("speculative_config prompt_lookup_min", self.prompt_lookup_min,
                                                    minimum=1, maximum=self.prompt_lookup_max)
            return
        if self.model is None:
            raise ValueError("speculative_config method 'draft_model' needs a model: a path or a loaded Transformer")
        if not isinstance(self.model, (str, os.PathLike, Transformer)):
            raise TypeError(f"speculative_config model must be a path or a Transformer, "
                            f"got {type(self.model).__name__}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config {name} is the ngram method's; a draft model takes none")

    def to_vllm(self) -> dict:
        """The JSON vLLM's --speculative-config takes for the same setting (a draft model by its path)."""
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            return {**out, "prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}
        if isinstance(self.model, Transformer):
            raise ValueError("speculative_config model is a loaded Transformer; vLLM needs the draft model's path")
        return {**out, "model": os.fspath(self.model), "draft_sample_method": self.draft_sample_method}

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """A SpeculativeConfig from itself, a dict of its fields (vLLM's form), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                            f"'num_speculative_tokens': 3}}, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KEYS))
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
    """Drafts from the request's own tokens: certain ones (no q)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, req, k: int) -> tuple[list[int], None]:
        c = self.config
        return propose_ngram(req.all_token_ids, min(k, c.num_speculative_tokens), c.prompt_lookup_min,
                             c.prompt_lookup_max), None

    def retain(self, requests) -> None:
        """Nothing to forget: the proposer keeps no state between steps."""

    def forget(self, request_id: str) -> None:
        """Nothing to forget."""


def load_draft_model(config: SpeculativeConfig, target: Transformer) -> Transformer:
    """The config's draft model, loaded in the target's dtype if it is a path, checked against the
    target: the same vocabulary (drafts are the target's token ids)."""
    draft = config.model
    if not isinstance(draft, Transformer):
        try:
            draft = Transformer.from_pretrained(draft, dtype=target.dtype)
        except ModelLoadError as e:  # say which model: the draft, not the one being served
            raise type(e)(f"speculative_config model: {e}") from e
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative_config model has a vocabulary of {draft.config.vocab_size} tokens; the "
                         f"target's has {target.config.vocab_size} (a draft model must share its tokenizer)")
    return draft


class DraftModelProposer:
    """k tokens decoded ahead by a smaller model, one request at a time, each request with a cache
    of its own in the draft model (its K and V for the tokens it has seen, kept between steps).

    At each step the cache is cut back to the longest prefix it shares with the request's tokens
    (refused drafts go), the tokens it has not seen (the kept drafts' last one and the step's own
    token) go in as one chunk, and k - 1 more single-token passes follow. Greedy drafts are the
    argmax; probabilistic ones are drawn from the draft's distribution under the request's
    temperature, top-k, top-p and min-p (with the request's generator), and their q rows are
    returned for the check."""

    def __init__(self, config: SpeculativeConfig, model: Transformer, attention_backend: str = "torch"):
        self.config, self.model = config, model
        self.backend = attention_backend if model.dtype in (torch.float32, torch.bfloat16) else "torch"
        self.caches: dict[str, tuple[ContiguousKVCache, list[int]]] = {}  # request_id -> (cache, its tokens)

    def retain(self, requests) -> None:
        """Forget the caches of requests that are gone (finished, aborted, released); `requests` maps
        request ids to the engine's requests. Memory stays bounded by the requests in flight."""
        for rid in [r for r in self.caches if r not in requests or requests[r].is_finished]:
            del self.caches[rid]

    def forget(self, request_id: str) -> None:
        """Drop one request's cache (it was aborted)."""
        self.caches.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, req, k: int) -> tuple[list[int], torch.Tensor | None]:
        tokens = req.all_token_ids
        k = min(k, self.config.num_speculative_tokens)
        cache, seen = self.caches.pop(req.request_id, None) or (ContiguousKVCache(self.backend), [])
        keep = 0
        limit = min(len(seen), len(tokens) - 1)  # the last token always goes in: its logits are wanted
        while keep < limit and seen[keep] == tokens[keep]:
            keep += 1
        cache.truncate(keep)
        seen = list(tokens[:keep])
        p = req.sampling_params
        probabilistic = self.config.draft_sample_method == "probabilistic" and not p.greedy
        step, drafts, qs = list(tokens[keep:]), [], []
        for _ in range(k):
            positions = torch.arange(len(cache), len(cache) + len(step))
            hidden = self.model(torch.tensor(step), positions, cache.attend)
            logits = self.model.compute_logits(hidden[-1:])[0]
            seen.extend(step)
            if probabilistic:
                q = sampling.distribution(logits, p.temperature, p.top_k, p.top_p, p.min_p)
                token = int(torch.multinomial(q, 1, generator=req.generator))
                qs.append(q)
            else:
                token = int(logits.argmax())
            drafts.append(token)
            step = [token]
        self.caches[req.request_id] = (cache, seen)
        return drafts, (torch.stack(qs) if qs else None)


def make_proposer(config: SpeculativeConfig, target: Transformer, attention_backend: str = "torch"):
    if config.method == "ngram":
        return NgramProposer(config)
    return DraftModelProposer(config, load_draft_model(config, target), attention_backend)

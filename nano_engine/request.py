"""A request and its sampling parameters: the state the scheduler moves forward.

There is no prefill phase and no decode phase. A request only knows how many of its tokens
(prompt + generated) exist, `num_tokens`, and how many have their KV in the cache, `num_computed`.
The scheduler's job is to let `num_computed` catch up with `num_tokens`. Mirrors vLLM V1's
`vllm/v1/request.py` (Request, RequestStatus) and `vllm/sampling_params.py` (SamplingParams).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from . import checks, structured
from .detokenizer import check_stop
from .structured import StructuredOutputsParams


# Temperatures below this are greedy: dividing logits by less overflows float32 to inf, and the
# softmax of inf is NaN. vLLM uses the same bound (`_SAMPLING_EPS` in vllm/sampling_params.py).
SAMPLING_EPS = 1e-5
# What torch.Generator.manual_seed accepts (negative seeds wrap around modulo 2**64).
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens; vLLM's names and meanings (`vllm/sampling_params.py`).

    One default differs: temperature is 0.0 (greedy) here and 1.0 in vLLM. Greedy makes the engine's
    tokens a function of the model alone, so tests and the chapters compare them with Hugging Face's
    greedy generate and across batches token for token; sampling is asked for explicitly. The
    server keeps OpenAI's and vLLM's default (1.0) for a request that sets no temperature.
    """
    max_tokens: int = 64
    temperature: float = 0.0  # below SAMPLING_EPS = greedy
    top_p: float = 1.0  # 1 = no nucleus cut
    top_k: int = 0  # 0 = no limit; -1 is read as 0, as vLLM quietly does
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # 0 = off; else drop tokens below min_p x the top token's probability
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens of the prompt and the output
    presence_penalty: float = 0.0  # 0 = off; subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # 0 = off; subtracted once per occurrence in the output
    # token id -> bias added to its logit (ids checked against the vocabulary at add_request). Left
    # out of the hash (a dict has none), kept in ==.
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    min_tokens: int = 0  # EOS and stop_token_ids are masked, stop strings not looked for, until this many are out
    logprobs: int | None = None  # None = none; k = the sampled token's logprob and the top k's
    # Stop strings: the output ends where one first appears in its text (the text is cut before it,
    # or after it with include_stop_str_in_output). Text needs a tokenizer: an engine without one
    # refuses them. A bare str is one stop string (OpenAI's API); kept as a tuple.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # the text leaves out special tokens (EOS, chat markers)
    # Only these token ids may be sampled (vLLM's allowed_token_ids); None = all. Checked against
    # the vocabulary at add_request.
    allowed_token_ids: tuple[int, ...] | None = None
    # Words that must never be generated (vLLM's bad_words): each word's tokens, with and without a
    # leading space, are found by the engine's tokenizer at add_request; the last token of a
    # sequence is banned where the output ends in the ones before it.
    bad_words: tuple[str, ...] = ()
    # None = none; k = the logprob of every prompt token (the first has none) and the top k's. The
    # prompt then needs logits for every row, and it does not read the prefix cache (vLLM's rule).
    prompt_logprobs: int | None = None
    # The output must follow this grammar (JSON schema, JSON object, regex, choice or EBNF:
    # structured.py); compiled for the engine's tokenizer at add_request. Left out of the hash.
    structured_outputs: StructuredOutputsParams | None = field(default=None, hash=False)

    def __post_init__(self):
        # Normalized values (NumPy scalars become Python ones) are written back: frozen dataclass.
        def put(name, value):
            object.__setattr__(self, name, value)

        put("max_tokens", checks.integer("max_tokens", self.max_tokens, minimum=1))
        put("temperature", checks.number("temperature", self.temperature, minimum=0))
        put("top_p", checks.number("top_p", self.top_p, minimum=0, maximum=1, exclusive_minimum=True))
        top_k = checks.integer("top_k", self.top_k, minimum=-1)
        put("top_k", 0 if top_k == -1 else top_k)
        if self.seed is not None:
            put("seed", checks.integer("seed", self.seed, minimum=SEED_MIN, maximum=SEED_MAX))
        stops = checks.token_ids("stop_token_ids", self.stop_token_ids)
        for i, t in enumerate(stops):
            if t < 0:
                raise ValueError(f"stop_token_ids[{i}]={t} must be >= 0 (a token id)")
        put("stop_token_ids", tuple(stops))
        put("ignore_eos", checks.flag("ignore_eos", self.ignore_eos))
        put("min_p", checks.number("min_p", self.min_p, minimum=0, maximum=1))
        put("repetition_penalty", checks.number("repetition_penalty", self.repetition_penalty, minimum=0,
                                                exclusive_minimum=True))
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, checks.number(name, getattr(self, name), minimum=-2, maximum=2))
        put("logit_bias", _logit_bias(self.logit_bias))
        put("min_tokens", checks.integer("min_tokens", self.min_tokens, minimum=0))
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None:
            put("logprobs", checks.integer("logprobs", self.logprobs, minimum=0))
        put("stop", check_stop(self.stop))
        put("include_stop_str_in_output", checks.flag("include_stop_str_in_output", self.include_stop_str_in_output))
        put("skip_special_tokens", checks.flag("skip_special_tokens", self.skip_special_tokens))
        if self.allowed_token_ids is not None:
            allowed = checks.token_ids("allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                raise ValueError("allowed_token_ids is empty: no token could be sampled (None allows all)")
            for i, t in enumerate(allowed):
                if t < 0:
                    raise ValueError(f"allowed_token_ids[{i}]={t} must be >= 0 (a token id)")
            put("allowed_token_ids", tuple(allowed))
        put("bad_words", _bad_words(self.bad_words))
        if self.prompt_logprobs is not None:
            put("prompt_logprobs", checks.integer("prompt_logprobs", self.prompt_logprobs, minimum=0))
        if self.structured_outputs is not None:
            put("structured_outputs", structured.parse(self.structured_outputs, "structured_outputs"))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _bad_words(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"bad_words={value!r} must be a list of strings")
    for w in value:
        if not isinstance(w, str) or not w.strip():
            raise ValueError(f"bad_words={list(value)!r}: each must be a non-blank string, got {w!r}")
    return tuple(value)


# OpenAI's range for a logit bias (vLLM clamps to it): -100 bans a token in practice, +100 forces it.
LOGIT_BIAS_MAX = 100.0


def _logit_bias(value) -> dict[int, float] | None:
    """A copy of {token id: bias} with plain ints and floats; None for None or an empty dict."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"logit_bias={value!r} must be a dict of token id -> bias, got {type(value).__name__}")
    out = {}
    for token, bias in value.items():
        t = checks.integer("logit_bias key", token, minimum=0)
        if t in out:  # 3 and np.int64(3), say: one of the two biases would be lost
            raise ValueError(f"logit_bias has token {t} twice (as {token!r} and as an earlier key)")
        out[t] = checks.number(f"logit_bias[{t}]", bias, minimum=-LOGIT_BIAS_MAX, maximum=LOGIT_BIAS_MAX)
    return out or None


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
    finish_reason: str | None = None  # "stop", "length", "abort", or "error" (see error)
    # With "error": why, when the request's own constraints left no token to sample (a message that
    # starts with the fields at fault); None when its step raised (the step log has the exception)
    error: str | None = None
    # What ended a "stop": the stop string, or the stop_token_ids entry; None for EOS (vLLM's rule)
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    recompute_until: int = 0  # tokens that had KV before the last preemption
    token_times: list[float] = field(default_factory=list)
    first_scheduled_time: float | None = None  # time.perf_counter() at the start of its first step
    generator: torch.Generator | None = None
    seq: int = 0  # arrival order; ties in arrival_time are broken by it
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    cache_salt: str | None = None  # mixed into the first block's hash: shares only with the same salt
    logprobs: list = field(default_factory=list)  # one sampling.SampleLogprobs per output token, if asked
    # With prompt_logprobs: one sampling.SampleLogprobs per prompt token, None for the first (nothing
    # comes before it), filled as the prompt's chunks are computed.
    prompt_logprobs: list = field(default_factory=list)
    # bad_words as token id sequences (the engine tokenizes them at add_request)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    grammar: object | None = field(default=None, repr=False)  # structured.Matcher, with structured_outputs
    # Draft tokens proposed after the last step (speculative decoding): checked in the next one
    spec_token_ids: list[int] = field(default_factory=list)
    # Their q rows (d, V) when a draft model sampled them (draft_sample_method "probabilistic"), else None
    spec_draft_probs: torch.Tensor | None = field(default=None, repr=False)
    num_draft_tokens: int = 0  # drafts checked so far
    num_accepted_tokens: int = 0  # of them, kept
    # The output's text, made by the engine as tokens come, for requests with stop strings
    # (an IncrementalDetokenizer; None otherwise). `output_text` reads it.
    detokenizer: object | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def output_text(self) -> str | None:
        """The output as text, cut at the stop string that ended it; None unless the request has
        stop strings (otherwise decode `output_ids` with the tokenizer)."""
        return None if self.detokenizer is None else self.detokenizer.output_text

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_behind(self) -> int:
        """Tokens still to compute before this request can sample again, its drafts included
        (vLLM's num_tokens_with_spec - num_computed_tokens)."""
        return self.num_tokens + len(self.spec_token_ids) - self.num_computed

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

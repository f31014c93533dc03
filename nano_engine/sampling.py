"""Sampling: turn each sampling row of logits into one token, by its own request's parameters.

The steps, in the order of vLLM's `Sampler.forward` (`vllm/v1/sample/sampler.py`):

0. structured output (structured.py): a row with a grammar has every token it forbids at -inf (vLLM
   applies this bitmask in the model runner, before the sampler: its logprobs see the mask too);
1. logprobs, if asked for, from the RAW logits (vLLM's default logprobs_mode "raw_logprobs"): what
   the model said, before any bias, penalty or temperature;
2. allowed_token_ids (every other token to -inf) and bad_words (the last token of a bad word to -inf
   where the output ends in the tokens before it: `vllm/v1/sample/ops/bad_words.py`), then logit
   bias and min_tokens (`vllm/v1/sample/logits_processor/builtin.py`: LogitBiasLogitsProcessor adds
   each bias; MinTokensLogitsProcessor sets the stop tokens to -inf until min_tokens are out);
3. penalties (`vllm/v1/sample/ops/penalties.py`, which calls `apply_penalties` in
   `vllm/model_executor/layers/utils.py`): repetition over prompt + output tokens (a positive logit
   is divided by it, a negative one multiplied), frequency by each token's count in the output,
   presence by its occurrence in the output;
4. greedy (temperature below SAMPLING_EPS): an argmax of what steps 2-3 left;
5. otherwise temperature, min-p (MinPLogitsProcessor: drop tokens whose probability is below
   min_p times the top one), top-k and top-p (`vllm/v1/sample/ops/topk_topp_sampler.py`), the draw.

A row that these steps leave without a token (every logit at -inf: a grammar that allows only EOS
while min_tokens masks it, allowed_token_ids that are all bad words) samples None, and the engine
finishes that request alone with "error". vLLM samples from such a row anyway (an argmax of -infs
is token 0); here it would also fail torch.multinomial, and the step's other requests with it.

Steps 2-4 change what greedy picks; step 5 does not (vLLM's "argmax-invariant" processors). A
request with a seed draws from its own `torch.Generator` and every step works on its own row only,
so its tokens do not depend on what else shares the batch. A batch of plain greedy requests (no
bias, penalty, min_tokens or logprobs) takes one argmax over all rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .request import SAMPLING_EPS, SamplingParams
from .structured import apply_grammar

NEG_INF = float("-inf")


@dataclass
class SampleLogprobs:
    """The logprobs of one sampled token (from the raw logits) and the `k` most likely tokens."""
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token (vLLM's rank)
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    token_ids: list[int | None]  # None: the row's constraints left no token (has_token)
    logprobs: list[SampleLogprobs | None]  # one per row; None where the request asked for none


# ----- 1. logprobs -----

def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The k largest of logprobs (V,), largest first; equal values by ascending token id."""
    if k <= 0:
        return [], []
    kth = torch.topk(logprobs, min(k, logprobs.shape[-1])).values[-1]
    candidates = torch.nonzero(logprobs >= kth).flatten()  # ascending ids: a stable sort keeps ties so
    values, order = torch.sort(logprobs[candidates], descending=True, stable=True)
    return candidates[order[:k]].tolist(), values[:k].tolist()


def token_logprobs(raw_logits: torch.Tensor, token: int, k: int) -> SampleLogprobs:
    logprobs = raw_logits.float().log_softmax(-1)  # (V,)
    ids, values = top_logprobs(logprobs, k)
    lp = logprobs[token]
    return SampleLogprobs(token, float(lp), int((logprobs > lp).sum()) + 1, ids, values)


def prompt_logprobs(raw_logits: torch.Tensor, next_tokens: Sequence[int], k: int) -> list[SampleLogprobs]:
    """Row i of raw_logits (m, V) predicts next_tokens[i]: its logprob, rank and the top k, as
    token_logprobs gives them one row at a time."""
    logprobs = raw_logits.float().log_softmax(-1)  # (m, V)
    tokens = torch.tensor(list(next_tokens), dtype=torch.long)
    lps = logprobs.gather(1, tokens[:, None])  # (m, 1)
    ranks = (logprobs > lps).sum(-1) + 1
    return [SampleLogprobs(int(t), float(lp), int(r), *top_logprobs(row, k))
            for t, lp, r, row in zip(tokens.tolist(), lps[:, 0].tolist(), ranks.tolist(), logprobs)]


# ----- 2. allowed tokens, bad words, logit bias and min_tokens -----

def apply_allowed_token_ids(logits: torch.Tensor, allowed: Sequence[int]) -> torch.Tensor:
    """Every logit of row logits (1, V) but the allowed tokens' set to -inf; a new tensor."""
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[list(allowed)] = True
    return logits.masked_fill(~keep, NEG_INF)


def apply_bad_words(logits: torch.Tensor, bad_words_token_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[int]) -> torch.Tensor:
    """Ban (-inf) the last token of each bad word whose other tokens end the output; row logits
    (1, V), a new tensor. A one-token word is banned always."""
    logits = logits.clone()
    for word in bad_words_token_ids:
        head = list(word[:-1])
        if len(head) <= len(output_ids) and list(output_ids[len(output_ids) - len(head):]) == head:
            logits[0, word[-1]] = NEG_INF
    return logits


def apply_logit_bias(logits: torch.Tensor, logit_bias: Sequence[dict[int, float] | None]) -> torch.Tensor:
    """Add each row's biases to its logits (B, V); a new tensor."""
    logits = logits.clone()
    for row, bias in enumerate(logit_bias):
        for token, b in (bias or {}).items():
            logits[row, token] += b
    return logits


def apply_min_tokens(logits: torch.Tensor, num_output: Sequence[int], min_tokens: Sequence[int],
                     stop_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set a row's stop tokens (EOS and stop_token_ids) to -inf while it has fewer than min_tokens
    output tokens; logits (B, V), a new tensor."""
    logits = logits.clone()
    for row, (n, m, stops) in enumerate(zip(num_output, min_tokens, stop_ids)):
        if n < m and stops:
            logits[row, list(stops)] = NEG_INF
    return logits


# ----- 3. penalties -----

def apply_penalties(logits: torch.Tensor, prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                    repetition_penalty: Sequence[float], frequency_penalty: Sequence[float],
                    presence_penalty: Sequence[float]) -> torch.Tensor:
    """Repetition, frequency and presence penalties of each row of logits (B, V); a new tensor.

    Repetition (1 = off) touches every token seen in the prompt or the output: a positive logit is
    divided by it, a negative one multiplied, so a penalty > 1 always makes the token less likely.
    Frequency subtracts penalty x (the token's count in the output); presence subtracts the penalty
    once if the token is in the output (both 0 = off; the prompt does not count for either).
    """
    out = logits.clone()
    vocab = logits.shape[-1]
    for row in range(logits.shape[0]):
        r, f, p = float(repetition_penalty[row]), float(frequency_penalty[row]), float(presence_penalty[row])
        counts = torch.bincount(torch.tensor(list(output_ids[row]), dtype=torch.long), minlength=vocab)  # (V,)
        in_output = counts > 0
        x = out[row]
        if r != 1.0:
            seen = in_output.clone()
            seen[torch.tensor(list(prompt_ids[row]), dtype=torch.long)] = True
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if f != 0.0:
            x = x - f * counts.to(x.dtype)
        if p != 0.0:
            x = x - p * in_output.to(x.dtype)
        out[row] = x
    return out


# ----- 5. temperature, min-p, top-k, top-p, the draw -----

def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Set to -inf every logit whose probability is below min_p x the largest probability. (V,)."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), NEG_INF)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Min-p, then top-k, then top-p on logits (V,) already divided by the temperature; -inf outside.

    Top-k keeps every logit equal to the k-th largest (ties at the boundary all stay). Top-p keeps the
    smallest set of most likely tokens whose probabilities reach top_p, including the token that
    crosses it (p = 0.6 over 0.4, 0.3, 0.2, 0.1 keeps 0.4 and 0.3), always at least one token; it is
    taken over the probabilities left after min-p and top-k, renormalized.
    """
    logits = apply_min_p(logits, min_p)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p. The first token always stays,
        # also when top_p rounds to 0 in the logits' dtype: a row of only -inf would be NaN.
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), NEG_INF)
    return logits


def distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0) -> torch.Tensor:
    """The probabilities (V,) a token is drawn from: temperature, then filter_logits, then softmax.
    Greedy (temperature below SAMPLING_EPS) is all the mass on the first largest logit."""
    if temperature < SAMPLING_EPS:
        return torch.zeros(logits.shape[-1], dtype=torch.float32).scatter(0, logits.argmax(-1, keepdim=True), 1.0)
    return filter_logits(logits.float() / temperature, top_k, top_p, min_p).softmax(-1)


def has_token(logits: torch.Tensor) -> torch.Tensor:
    """Whether each row of logits (..., V) leaves some token to sample (not every logit -inf)."""
    return logits.amax(-1) > NEG_INF


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int | None:
    """One token from one row of (already biased and penalized) logits (V,); None if it leaves none."""
    if not has_token(logits):
        return None
    if params.greedy:
        return int(logits.argmax())
    probs = distribution(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    return int(torch.multinomial(probs, 1, generator=generator))


# ----- the whole pipeline -----

def needs_history(p: SamplingParams) -> bool:
    """Whether this request's logits change with what it has generated (or asked for logprobs)."""
    return (p.logit_bias is not None or p.min_tokens > 0 or p.logprobs is not None or p.repetition_penalty != 1.0
            or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.allowed_token_ids is not None
            or bool(p.bad_words))


@dataclass
class SamplingMetadata:
    """What the sampler needs to know of each row of a step's logits, row i of each list for row i
    of the logits (vLLM's `vllm/v1/sample/metadata.py`): its parameters, its generator (None: the
    global one) and its history, the prompt and the output so far (penalties and min_tokens read
    them; left empty, nothing counts as seen)."""

    params: Sequence[SamplingParams]
    generators: Sequence[torch.Generator | None]
    prompt_ids: Sequence[Sequence[int]] | None = None
    output_ids: Sequence[Sequence[int]] | None = None
    eos_token_ids: Sequence[int] = ()  # masked with the stop_token_ids while min_tokens are not out
    bad_words_token_ids: Sequence[Sequence[Sequence[int]]] | None = None  # per row: its bad words' token ids
    grammars: Sequence | None = None  # per row: a structured.Matcher, or None (no structured output)

    @classmethod
    def from_requests(cls, requests: Sequence, eos_token_ids=()) -> "SamplingMetadata":
        """The rows of these requests (anything with sampling_params, generator, prompt_ids, output_ids,
        and optionally bad_words_token_ids)."""
        return cls([r.sampling_params for r in requests], [r.generator for r in requests],
                   [r.prompt_ids for r in requests], [r.output_ids for r in requests], sorted(eos_token_ids),
                   [getattr(r, "bad_words_token_ids", ()) for r in requests],
                   [getattr(r, "grammar", None) for r in requests])


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
    """One token per row of logits (rows, V), each row by its own parameters, generator and history."""
    params, generators, eos_token_ids = metadata.params, metadata.generators, metadata.eos_token_ids
    rows = len(params)
    grammars = any(g is not None for g in metadata.grammars or ())  # one pass over the rows, used twice
    if grammars:  # structured output: what the grammar forbids is gone before anything else
        logits = apply_grammar(logits, metadata.grammars)
    if all(p.greedy and not needs_history(p) for p in params):
        tokens = logits.argmax(-1).tolist()  # one call for the common case
        if grammars:  # only a grammar can leave a row empty here
            tokens = [t if ok else None for t, ok in zip(tokens, has_token(logits).tolist())]
        return SamplerOutput(tokens, [None] * rows)
    prompt_ids = metadata.prompt_ids if metadata.prompt_ids is not None else [()] * rows
    output_ids = metadata.output_ids if metadata.output_ids is not None else [()] * rows
    bad_words = metadata.bad_words_token_ids if metadata.bad_words_token_ids is not None else [()] * rows
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float32 at least; a float64 model stays exact
    tokens, logprobs = [], []
    for i, p in enumerate(params):
        raw = logits[i].to(dtype)  # every step on this row alone, so batches cannot mix
        row = process_row(raw, p, prompt_ids[i], output_ids[i], eos_token_ids, bad_words[i])
        token = sample_one(row, p, generators[i])
        tokens.append(token)
        logprobs.append(None if p.logprobs is None or token is None else token_logprobs(raw, token, p.logprobs))
    return SamplerOutput(tokens, logprobs)


def process_row(raw: torch.Tensor, p: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int],
                eos_token_ids: Sequence[int] = (), bad_words: Sequence[Sequence[int]] = ()) -> torch.Tensor:
    """Steps 2-3 on one row of logits (V,): allowed tokens, bad words, bias, min_tokens, penalties, by
    this request's parameters and the history it is given."""
    row = raw[None]
    if p.allowed_token_ids is not None:
        row = apply_allowed_token_ids(row, p.allowed_token_ids)
    if bad_words:
        row = apply_bad_words(row, bad_words, output_ids)
    if p.logit_bias is not None:
        row = apply_logit_bias(row, [p.logit_bias])
    if p.min_tokens > 0:
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_token_ids))
        row = apply_min_tokens(row, [len(output_ids)], [p.min_tokens], [stops])
    if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        row = apply_penalties(row, [prompt_ids], [output_ids], [p.repetition_penalty],
                              [p.frequency_penalty], [p.presence_penalty])
    return row[0]


# ----- speculative decoding: verify the drafts -----

def rejection_sample(target_probs: torch.Tensor, draft_ids: Sequence[int], uniforms: Sequence[float],
                     sample: Callable[[torch.Tensor], int | None], draft_probs: torch.Tensor | None = None
                     ) -> list[int | None]:
    """vLLM's rejection sampler for one request (`vllm/v1/sample/rejection_sampler.py`), written out.

    target_probs (d + 1, V): the model's distribution p at each draft's position and after the last;
    draft_ids: the d drafts; uniforms: d numbers in [0, 1), one per test; sample(probs): a token
    drawn from a distribution (V,) that sums to 1 (the engine's also takes a row of zeros, where the
    request's constraints leave no token, and returns None: the list then ends in None); draft_probs
    (d, V): the proposer's q, or None for a proposer sure of its drafts (n-gram: q is one-hot on the draft).

    Draft j is kept when uniforms[j] < p(x) / q(x) (so with probability min(1, p(x) / q(x)); a draft
    the model gives probability 0 never is). The first one refused is replaced by a token drawn from
    max(0, p - q), normalised, and nothing after it counts; if all are kept, one more token (the
    bonus) is drawn from the last row. Each position's token is then distributed exactly as p.
    The engine checks n-gram drafts with `verify`, the same rule drawn in another order.
    """
    out = []
    for j, x in enumerate(draft_ids):
        p = target_probs[j]
        q = draft_probs[j] if draft_probs is not None else torch.zeros_like(p).index_fill_(0, torch.tensor([x]), 1.0)
        if q[x] > 0 and uniforms[j] < float(p[x] / q[x]):
            out.append(int(x))
            continue
        residual = (p - q).clamp(min=0)
        total = float(residual.sum())
        # p and q equal but for rounding leave no residual: then p itself (what it stands for)
        out.append(sample(residual / total if total > 0 else p))
        return out
    out.append(sample(target_probs[len(draft_ids)]))
    return out


def verify(logits: torch.Tensor, drafts: Sequence[int], p: SamplingParams, generator: torch.Generator | None,
           prompt_ids: Sequence[int], output_ids: Sequence[int], eos_token_ids: Sequence[int] = (),
           bad_words: Sequence[Sequence[int]] = ()) -> tuple[list[int], list[SampleLogprobs | None]]:
    """The tokens a request keeps from one step with d drafts: logits (d + 1, V), row j the model's
    distribution after the j-th draft (row 0: after the last real token).

    Position by position, with the history of the tokens kept before it (penalties see them), the
    request draws its token exactly as it would without drafts (the same sampler, the same
    generator, one draw per position). A draft is kept when the draw equals it; the first draw
    that differs is kept instead (the correction) and the step ends there; if every draft is kept,
    the last row gives one more token (the bonus).

    This is rejection sampling for a proposer that is sure of its drafts (the n-gram proposer:
    q(x) = 1): a draft x is kept with probability p(x) = min(1, p(x) / q(x)), and a refused one is
    replaced by a token drawn from p without x, renormalised, which is max(0, p - q) normalised
    (vLLM's `vllm/v1/sample/rejection_sampler.py`; greedy: x is kept when it is the argmax). Drawing
    the token first and comparing is one way to run it, and the way that keeps a seeded request's
    tokens what they are without drafts, in any batch: drafts change how many steps the tokens
    take, never which tokens they are.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    history, tokens, logprobs = list(output_ids), [], []
    for j in range(len(drafts) + 1):
        raw = logits[j].to(dtype)
        row = process_row(raw, p, prompt_ids, history, eos_token_ids, bad_words)
        token = sample_one(row, p, generator)
        tokens.append(token)
        logprobs.append(None if p.logprobs is None or token is None else token_logprobs(raw, token, p.logprobs))
        history.append(token)
        if j == len(drafts) or token != drafts[j]:  # a row without a token (None) ends it too
            break
    return tokens, logprobs


def verify_probabilistic(logits: torch.Tensor, drafts: Sequence[int], draft_probs: torch.Tensor, p: SamplingParams,
                         generator: torch.Generator | None, prompt_ids: Sequence[int], output_ids: Sequence[int],
                         eos_token_ids: Sequence[int] = (), bad_words: Sequence[Sequence[int]] = ()
                         ) -> tuple[list[int], list[SampleLogprobs | None]]:
    """`verify` for drafts sampled from a proposer's q (draft_probs (d, V)): rejection sampling
    proper (`rejection_sample`). Row j's p is the request's own distribution after the drafts before
    it (its penalties see them: a kept prefix is exactly those drafts); d uniforms come first from the
    request's generator, then the one draw of the correction or the bonus. Each token is then
    distributed as p, and a seeded request gets the same tokens in any batch, but not the tokens it
    gets without drafts (the generator's stream is used otherwise)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    history, target = list(output_ids), []
    for j in range(len(drafts) + 1):
        row = process_row(logits[j].to(dtype), p, prompt_ids, history, eos_token_ids, bad_words)
        # a row without a token is all zeros: its draft is refused and nothing can replace it (None)
        target.append(distribution(row, p.temperature, p.top_k, p.top_p, p.min_p) if has_token(row)
                      else torch.zeros(row.shape[-1]))
        if j < len(drafts):
            history.append(drafts[j])
    uniforms = torch.rand(len(drafts), generator=generator, dtype=torch.float64).tolist()
    tokens = rejection_sample(torch.stack(target), drafts, uniforms,
                              lambda probs: int(torch.multinomial(probs, 1, generator=generator)) if probs.any() else None,
                              draft_probs.to(torch.float32))
    logprobs = [None if p.logprobs is None or t is None else token_logprobs(logits[j].to(dtype), t, p.logprobs)
                for j, t in enumerate(tokens)]
    return tokens, logprobs

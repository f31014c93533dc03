"""Sampling: greedy, temperature, top-k, top-p in vLLM's order, seeds independent of the batch, and
ties, defaults and the logits' dtype.

The distribution tests draw a few thousand tokens from fixed logits and compare the frequencies
with the distribution computed here, independently, in float64: temperature first, then top-k,
then top-p over the tempered probabilities (vLLM's order). Each case is chosen so that a
plausible bug (temperature ignored, applied after the top-p cut, top_k=1 read as no limit) moves
the distribution by far more than the sampling noise.
"""

import math

import pytest
import torch

from nano_engine import LLMEngine, SamplingParams
from nano_engine.sampling import (SamplingMetadata, apply_penalties, distribution, filter_logits, sample, sample_one,
                                  top_logprobs)

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0, -2.0])
DRAWS = 4000  # standard error of a frequency <= 0.008; total variation noise about 0.01


def expected(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution vLLM samples from, written out independently of nano_engine.sampling."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    if top_k:  # the top-k cut, then the survivors renormalized (vLLM's apply_top_k_top_p)
        probs[order[top_k:]] = 0.0
        probs = probs / probs.sum()
    total = 0.0
    for rank, i in enumerate(order):  # top-p: keep tokens until those before reach top_p
        if rank > 0 and total >= top_p:
            probs[i] = 0.0
        total += float(probs[i])
    return probs / probs.sum()


def frequencies(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = DRAWS) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(len(logits), dtype=torch.float64)
    for _ in range(n):
        counts[sample_one(logits, params, g)] += 1
    return counts / n


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    """Total variation distance."""
    return 0.5 * float((p - q).abs().sum())


def entropy(p: torch.Tensor) -> float:
    return -sum(float(x) * math.log(float(x)) for x in p if x > 0)


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, 0, 0.7)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, 0, 0.5)).tolist() == [False, True, True, True]
    assert torch.isinf(filter_logits(logits, 1, 1.0)).tolist() == [False, True, True, True]
    assert not torch.isinf(filter_logits(logits, 0, 1.0)).any()


def test_temperature_shapes_the_distribution():
    """Frequencies match softmax(logits / T), and the entropy grows with T as it should."""
    entropies = []
    for t in (0.5, 1.0, 2.0, 4.0):
        freq = frequencies(SamplingParams(temperature=t))
        want = expected(LOGITS, t)
        assert tv(freq, want) < 0.035, (t, freq, want)
        assert abs(entropy(freq) - entropy(want)) < 0.07, t
        entropies.append(entropy(freq))
    assert entropies == sorted(entropies) and entropies[-1] - entropies[0] > 1.0
    assert torch.equal(expected(LOGITS, 1.0), LOGITS.double().softmax(-1))  # T = 1: the model's own


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (0.5, 0, 0.8),  # tempered: the top token alone has 0.87 >= 0.8; untempered, two tokens pass
    (2.0, 0, 0.8),  # tempered: four tokens pass; untempered, two
    (2.0, 3, 1.0),  # top-k after temperature: three tokens, tempered
    (2.0, 3, 0.5),  # both filters after temperature: top-p over the renormalized top 3 keeps one
])
def test_filters_come_after_the_temperature(temperature, top_k, top_p):
    want = expected(LOGITS, temperature, top_k, top_p)
    wrong = expected(LOGITS, 1.0, top_k, top_p)  # the cut made before the temperature ...
    wrong = (LOGITS.double() / temperature).softmax(-1) * (wrong > 0)  # ... then tempered
    wrong = wrong / wrong.sum()
    if top_k == 0:
        assert tv(want, wrong) > 0.1  # the case tells the two orders apart
    freq = frequencies(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert tv(freq, want) < 0.035, (freq, want)
    assert set(freq.nonzero().flatten().tolist()) == set(want.nonzero().flatten().tolist())


def test_top_k_1_is_greedy(tiny):
    flat = torch.tensor([1.0, 1.2, 0.9, 1.1])  # nearly uniform: any other sampler varies at once
    assert frequencies(SamplingParams(temperature=1.0, top_k=1), flat, n=500).tolist() == [0, 1, 0, 0]
    assert frequencies(SamplingParams(temperature=100.0, top_k=1, top_p=0.9), flat, n=500).tolist() == [0, 1, 0, 0]
    prompts = [[3, 4, 5], [9, 8]]
    greedy = LLMEngine(tiny).generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    top1 = LLMEngine(tiny).generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, temperature=2.0,
                                                            top_k=1, seed=7))
    assert [r.output_ids for r in top1] == [r.output_ids for r in greedy]


def test_each_seed_is_its_own_stream(tiny):
    """One seed, the same tokens in one batch; another seed, other tokens (alone and in any batch:
    test_sampling_params' test_a_seeded_request_is_the_same_in_any_batch)."""
    params = [SamplingParams(max_tokens=16, temperature=1.5, seed=seed, ignore_eos=True) for seed in (1, 2, 1, 3, 2)]
    out = [r.output_ids for r in LLMEngine(tiny).generate([[3, 4, 5]] * 5, params)]
    assert out[0] == out[2] and out[1] == out[4]
    assert len({tuple(o) for o in out}) == 3  # seeds 1, 2, 3: three different streams


# ----- ties, defaults, dtypes, and each parameter alone -----

def test_ties_keep_the_lower_token_id_first_in_logprobs_and_at_the_top_p_edge():
    flat = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0] * 4)  # 32 values, many ties
    ids, values = top_logprobs(flat, 6)
    assert ids == [1, 2, 4, 5, 7, 9] and values == [1.0] * 6
    # 16 equal leaders among 32 tokens, top_p 0.3: the 7 kept are the 7 lowest ids (a stable sort).
    kept = filter_logits(torch.tensor([1.0, 0.0] * 16), 0, 0.3).isfinite().nonzero().flatten().tolist()
    assert kept == [0, 2, 4, 6, 8, 10, 12]


def test_top_p_of_one_and_the_defaults_filter_nothing_and_temperature_0_is_greedy():
    x = torch.tensor([0.0, -30.0, -40.0, -30.0])  # a tail whose mass rounds to nothing in float32
    assert torch.equal(filter_logits(x, 0, 1.0), x)
    even = torch.tensor([0.0, 0.0, -1.0])
    assert torch.allclose(distribution(even, 1.0), even.softmax(-1))  # no top-p, no min-p by default
    # Greedy: all the mass on the first largest logit
    assert distribution(torch.tensor([1.0, 3.0, 3.0], dtype=torch.float64), 0.0).tolist() == [0.0, 1.0, 0.0]


def test_top_k_minus_one_means_no_limit_as_in_vllm():
    """Code written for vLLM passes -1 for "no limit" (vLLM reads it as 0); below that is refused."""
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="top_k=-2"):
        SamplingParams(top_k=-2)


def test_penalties_are_exact_in_float64_logits():
    x = torch.tensor([[2.0, -1.0, 0.5]], dtype=torch.float64)
    # 0.1 x count is exact in float64, not in float32.
    out = apply_penalties(x, [[2]], [[0, 0, 1]], [1.0], [0.1], [0.3])
    assert out.tolist() == [[2.0 - 0.1 * 2 - 0.3, -1.0 - 0.1 - 0.3, 0.5]]


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=2.0), dict(frequency_penalty=1.0),
                                     dict(presence_penalty=1.0)])
def test_a_greedy_request_with_one_penalty_alone_is_penalized(penalty):
    # Token 0 leads by 0.5 but has been generated twice: each penalty alone must hand the step to token 1.
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    params = SamplingParams(max_tokens=4, **penalty)
    assert sample(logits, SamplingMetadata([params], [None], [[2]], [[0, 0]])).token_ids == [1]
    assert sample(logits, SamplingMetadata([SamplingParams(max_tokens=4)], [None], [[2]], [[0, 0]])).token_ids == [0]


def test_sample_uses_the_history_it_is_given_in_float32_at_least():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    rep = SamplingParams(max_tokens=4, repetition_penalty=3.0)
    assert sample(logits, SamplingMetadata([rep], [None], [[0]], [[]])).token_ids == [1]  # seen in the prompt only
    assert sample(logits, SamplingMetadata([rep], [None])).token_ids == [0]  # no history given: nothing seen
    # bfloat16 logits are penalized in float32: 2.0 - 0.005 stays above 1.9921875 (in bfloat16 they would tie).
    bf = torch.tensor([[1.9921875, 2.0]], dtype=torch.bfloat16)
    freq = SamplingParams(max_tokens=4, frequency_penalty=0.005)
    assert sample(bf, SamplingMetadata([freq], [None], [[0]], [[1]])).token_ids == [1]


def test_allowed_token_ids_and_bad_words_mask_before_the_choice():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0]])
    allowed = SamplingParams(max_tokens=4, allowed_token_ids=(2, 3))
    assert sample(logits, SamplingMetadata([allowed], [None])).token_ids == [2]
    bad = SamplingParams(max_tokens=4, bad_words=("x",))
    # a bad word (1, 0): token 0 is banned only right after a 1; a one-token bad word (2) always
    meta = dict(bad_words_token_ids=[[[1, 0], [2]]])
    assert sample(logits, SamplingMetadata([bad], [None], [[]], [[3, 1]], **meta)).token_ids == [1]
    assert sample(logits, SamplingMetadata([bad], [None], [[]], [[1, 3]], **meta)).token_ids == [0]
    assert sample(logits, SamplingMetadata([bad], [None], [[]], [[0]], bad_words_token_ids=[[[2], [0, 1], [0]]])
                  ).token_ids == [3]
    # logprobs stay the raw model's: the sampled token's, not the masked row's
    both = SamplingParams(max_tokens=4, allowed_token_ids=(3,), logprobs=1)
    out = sample(logits, SamplingMetadata([both], [None]))
    assert out.token_ids == [3] and out.logprobs[0].logprob == pytest.approx(logits[0].log_softmax(-1)[3].item())


def test_verifying_drafts_keeps_every_positions_distribution():
    """Rejection sampling of n-gram drafts: over many seeded draws, the first token is distributed as the
    model's p (chi-square), the draft is kept with probability p(draft), and after a kept draft the next
    token follows the next row's distribution (the bonus)."""
    from nano_engine.sampling import verify

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.3, -1.0, 1.2, 0.0, 0.8]])
    params = SamplingParams(max_tokens=8, temperature=0.8)
    p0, p1 = (logits / 0.8).softmax(-1).double()
    n, draft = 6000, 1
    first, bonus = torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for seed in range(n):
        tokens, _ = verify(logits, [draft], params, torch.Generator().manual_seed(seed), [], [])
        first[tokens[0]] += 1
        assert len(tokens) == (2 if tokens[0] == draft else 1)
        if tokens[0] == draft:
            bonus[tokens[1]] += 1

    def chi2(counts, p):
        return float(((counts - counts.sum() * p) ** 2 / (counts.sum() * p)).sum())

    assert chi2(first, p0) < 18.5  # 4 degrees of freedom: p = 0.001
    assert chi2(bonus, p1) < 18.5
    kept = first[draft] / n
    assert abs(kept - p0[draft]) < 4 * math.sqrt(p0[draft] * (1 - p0[draft]) / n)
    # greedy: a draft is kept exactly when it is the argmax, and the correction is the argmax
    greedy = SamplingParams(max_tokens=8)
    assert verify(logits, [0], greedy, None, [], [])[0] == [0, 2]
    assert verify(logits, [3], greedy, None, [], [])[0] == [0]


def test_rejection_sampling_with_the_drafts_q_keeps_p_and_accepts_the_overlap():
    """Drafts sampled from a draft model's q (not certain): over many seeded draws the first token is
    distributed as p and the bonus after a kept draft as the next row's p (chi-square), and a draft is
    kept with probability sum(min(p, q)), more than the p(draft) that checking it as certain gives."""
    from nano_engine.sampling import verify_probabilistic

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.3, -1.0, 1.2, 0.0, 0.8]])
    params = SamplingParams(max_tokens=8, temperature=0.8)
    p0, p1 = (logits / 0.8).softmax(-1).double()
    q = torch.tensor([0.1, 0.5, 0.2, 0.05, 0.15], dtype=torch.float64)
    n = 6000
    first, bonus, kept = torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64), 0
    for seed in range(n):
        gen = torch.Generator().manual_seed(seed)
        draft = int(torch.multinomial(q, 1, generator=gen))
        tokens, _ = verify_probabilistic(logits, [draft], q[None], params, gen, [], [])
        first[tokens[0]] += 1
        if len(tokens) == 2:
            kept += 1
            bonus[tokens[1]] += 1

    def chi2(counts, p):
        return float(((counts - counts.sum() * p) ** 2 / (counts.sum() * p)).sum())

    assert chi2(first, p0) < 18.5  # 4 degrees of freedom: p = 0.001
    assert chi2(bonus, p1) < 18.5
    overlap = float(torch.minimum(p0, q).sum())
    assert abs(kept / n - overlap) < 4 * math.sqrt(overlap * (1 - overlap) / n)
    assert overlap > float((p0 * q).sum()) + 0.1  # what a one-hot check of the same drafts would keep


class _Forbids:
    """A stand-in for a grammar's matcher that allows the tokens in `allowed` (none: it forbids all)."""

    def __init__(self, vocab: int, allowed=()):
        self.mask = torch.zeros(vocab, dtype=torch.bool)
        self.mask[list(allowed)] = True

    def allowed(self):
        return self.mask


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, temperature=1.0),
                                    SamplingParams(max_tokens=4, min_tokens=2, logprobs=1)],
                         ids=["greedy", "sampled", "with-history"])
def test_a_row_left_without_a_token_samples_none_and_the_other_rows_their_own(params):
    """Every token at -inf (a grammar that allows only what min_tokens masks): that row alone gives None;
    greedy took token 0 from it, and sampling failed inside torch.multinomial for every row."""
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0], [0.5, 3.0, 1.0, 2.0], [0.5, 3.0, 1.0, 2.0]])
    grammars = [None, _Forbids(4), _Forbids(4, allowed=[2, 3])]
    want = sample(logits, SamplingMetadata([params] * 3, [torch.Generator().manual_seed(s) for s in range(3)],
                                           grammars=[None, None, _Forbids(4, allowed=[2, 3])]))
    got = sample(logits, SamplingMetadata([params] * 3, [torch.Generator().manual_seed(s) for s in range(3)],
                                          grammars=grammars))
    assert got.token_ids == [want.token_ids[0], None, want.token_ids[2]]
    assert got.token_ids[2] in (2, 3) and got.logprobs[1] is None
    # min_tokens masks EOS (3), the only token the grammar leaves
    eos_only = SamplingMetadata([params], [None], [[]], [[]], eos_token_ids=[3], grammars=[_Forbids(4, allowed=[3])])
    assert sample(logits[:1], eos_only).token_ids == ([None] if params.min_tokens else [3])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verifying_drafts_stops_at_a_position_that_leaves_no_token(temperature):
    """allowed_token_ids (2,) with the bad word (2, 2): the draft 2 is kept, and after it nothing may come."""
    from nano_engine.sampling import verify, verify_probabilistic

    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5]] * 3)
    p = SamplingParams(max_tokens=8, temperature=temperature, allowed_token_ids=(2,), bad_words=("x",))
    g = torch.Generator().manual_seed(0)
    tokens, logprobs = verify(logits, [2, 2], p, g, [], [], bad_words=[[2, 2]])
    assert tokens == [2, None] and logprobs == [None, None]
    if temperature:
        q = torch.tensor([[0.0, 0.0, 1.0, 0.0]] * 2)
        tokens, _ = verify_probabilistic(logits, [2, 2], q, p, g, [], [], bad_words=[[2, 2]])
        assert tokens == [2, None]
        tokens, _ = verify_probabilistic(logits, [2, 2], q, p, g, [], [2], bad_words=[[2, 2]])
        assert tokens == [None]  # the first draft refused, and nothing to take its place

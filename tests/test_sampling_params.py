"""The sampling parameters beyond temperature / top-k / top-p: logit bias, min_tokens, the three
penalties, min-p and logprobs, in vLLM's order (nano_engine/sampling.py).

Each step is checked on numbers worked out here by hand, then, where the step shapes a distribution,
on the frequencies of a few thousand seeded draws against that distribution computed independently in
float64, then through the engine; and a seeded request must give the same tokens and logprobs alone
and in any batch, under every combination of parameters (hypothesis). Bad values are
test_api_properties.py's and test_errors.py's.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nano_engine import LLMEngine, SamplingParams
from nano_engine.sampling import (SamplingMetadata, apply_min_p, apply_penalties, distribution, filter_logits,
                                  sample, top_logprobs)
from nano_engine.tiny import tiny_model

DRAWS = 4000


def frequencies(logits: torch.Tensor, params: SamplingParams, prompt=(), output=(), eos=(), n: int = DRAWS):
    g = torch.Generator().manual_seed(99)
    counts = torch.zeros(logits.shape[-1], dtype=torch.float64)
    for _ in range(n):
        rows = SamplingMetadata([params], [g], [list(prompt)], [list(output)], eos)
        counts[sample(logits[None], rows).token_ids[0]] += 1
    return counts / n


def tv(p, q) -> float:
    return 0.5 * float((p.double() - q.double()).abs().sum())


# ----- penalties -----

def test_repetition_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5]])
    got = apply_penalties(logits, [[0]], [[1, 1]], [2.0], [0.0], [0.0])
    # token 0 (prompt, positive): 2 / 2; token 1 (output, negative): -2 * 2; others untouched
    assert got.tolist() == [[1.0, -4.0, 3.0, -1.0, 0.5]]
    assert logits.tolist() == [[2.0, -2.0, 3.0, -1.0, 0.5]]  # the input is untouched
    # a penalty below 1 encourages: the other way round
    assert apply_penalties(logits, [[0, 1]], [[]], [0.5], [0.0], [0.0]).tolist() == [[4.0, -1.0, 3.0, -1.0, 0.5]]


def test_frequency_counts_and_presence_occurs_in_the_output_only():
    logits = torch.zeros(2, 5)
    got = apply_penalties(logits, [[4, 4], [4]], [[1, 1, 1, 2], [3]], [1.0, 1.0], [0.5, 0.0], [0.0, 1.5])
    assert got[0].tolist() == [0.0, -1.5, -0.5, 0.0, 0.0]  # 3 x 0.5 and 1 x 0.5; the prompt's 4 is free
    assert got[1].tolist() == [0.0, 0.0, 0.0, -1.5, 0.0]  # once, whatever the count
    both = apply_penalties(torch.full((1, 4), 1.0), [[0]], [[0, 0, 1]], [2.0], [0.25], [1.0])
    # token 0: 1 / 2 - 2 x 0.25 - 1 = -1.0; token 1: 1 / 2 - 0.25 - 1 = -0.75 (repetition first)
    assert both.tolist() == [[-1.0, -0.75, 1.0, 1.0]]


# ----- logit bias, min_tokens -----

def test_a_bias_of_minus_100_never_samples_the_token():
    logits = torch.tensor([3.0, 1.0, 0.0, -1.0])  # token 0 has 0.84 of the mass
    freq = frequencies(logits, SamplingParams(temperature=1.0, logit_bias={0: -100.0}))
    assert freq[0] == 0
    want = logits[1:].double().softmax(-1)
    assert tv(freq[1:], want) < 0.03
    # +100 forces a token, greedy or not
    assert frequencies(logits, SamplingParams(temperature=2.0, logit_bias={3: 100}), n=300)[3] == 1
    assert sample(logits[None], SamplingMetadata([SamplingParams(logit_bias={2: 5.0})], [None])).token_ids == [2]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached(tiny):
    eos = tiny.config.eos_token_id
    force = {eos: 100.0}  # EOS would be picked at once
    sp = SamplingParams(max_tokens=8, logit_bias=force, min_tokens=3)
    out = LLMEngine(tiny).generate([[3, 4, 5]], sp)[0]
    # vLLM's meaning: min_tokens tokens come out before EOS may, so the forced EOS is the 4th
    assert out.output_ids[-1] == eos and len(out.output_ids) == 4 and out.finish_reason == "stop"
    assert eos not in out.output_ids[:3]
    assert LLMEngine(tiny).generate([[3, 4, 5]], SamplingParams(max_tokens=8, logit_bias=force))[0].output_ids == [eos]
    # a stop token id the same way; ignore_eos leaves EOS unmasked (it stops nothing)
    sp = SamplingParams(max_tokens=8, logit_bias={7: 100.0}, stop_token_ids=(7,), min_tokens=4, ignore_eos=True)
    out = LLMEngine(tiny).generate([[3, 4, 5]], sp)[0]
    assert out.output_ids[4] == 7 and len(out.output_ids) == 5 and 7 not in out.output_ids[:4]
    logits = torch.zeros(1, 4)
    logits[0, 0] = 50.0
    got = sample(logits, SamplingMetadata([SamplingParams(min_tokens=2, ignore_eos=True)], [None], [[1]], [[2]], [0]))
    assert got.token_ids == [0]  # ignore_eos: EOS is not a stop token, so min_tokens does not mask it


# ----- min-p and the filters -----

def test_min_p_is_relative_to_the_top_probability():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log()
    assert (~torch.isinf(apply_min_p(logits, 0.19))).tolist() == [True, True, True, False, False]  # >= 0.095
    assert (~torch.isinf(apply_min_p(logits, 0.21))).tolist() == [True, True, False, False, False]  # >= 0.105
    tied = torch.tensor([1.0, 3.0, 3.0, 2.0])
    assert (~torch.isinf(apply_min_p(tied, 1.0))).tolist() == [False, True, True, False]  # equal to the top: kept
    assert torch.equal(apply_min_p(logits, 0.0), logits)
    assert (~torch.isinf(apply_min_p(logits, 1.0))).tolist() == [True, False, False, False, False]
    # min-p before top-p: top-p renormalizes over what min-p left (0.5, 0.3, 0.1 -> 0.556, 0.333, 0.111)
    assert (~torch.isinf(filter_logits(logits, 0, 0.85, 0.19))).tolist() == [True, True, False, False, False]
    assert (~torch.isinf(filter_logits(logits, 0, 0.85))).tolist() == [True, True, True, False, False]
    # and after the temperature: at T = 2 the ratios shrink, so more tokens pass
    assert (distribution(logits, 2.0, min_p=0.19) > 0).tolist() == [True, True, True, True, True]
    freq = frequencies(logits, SamplingParams(temperature=1.0, min_p=0.19))
    assert tv(freq, torch.tensor([0.5, 0.3, 0.1, 0, 0]) / 0.9) < 0.03


# ----- logprobs -----

def test_logprobs_are_the_raw_log_softmax(tiny):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.5, -1.0]])
    sp = SamplingParams(temperature=0.7, logit_bias={4: 10.0}, repetition_penalty=1.3, logprobs=3, seed=1)
    out = sample(logits, SamplingMetadata([sp], [torch.Generator().manual_seed(1)], [[0]], [[1]]))
    lp = out.logprobs[0]
    raw = logits[0].log_softmax(-1)
    assert lp.token_id == out.token_ids[0] == 4  # the bias decides the token ...
    assert lp.logprob == pytest.approx(float(raw[4]), abs=1e-6) and lp.rank == 5  # ... not the logprob
    assert lp.top_ids == [0, 1, 2] and lp.top_logprobs == pytest.approx(raw[[0, 1, 2]].tolist(), abs=1e-6)
    assert top_logprobs(raw, 0) == ([], [])
    # through the engine: each output token's logprob is log_softmax of the model's logits there
    req, plain = LLMEngine(tiny).generate([[3, 4, 5]] * 2, [SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True),
                                                            SamplingParams(max_tokens=4, ignore_eos=True)])
    assert not plain.logprobs  # only a request that asks for logprobs gets them, whatever its batch
    assert [x.token_id for x in req.logprobs] == req.output_ids and len(req.logprobs) == 4
    ids = [3, 4, 5] + req.output_ids[:-1]
    with torch.no_grad():
        model_logits = tiny.compute_logits(tiny(torch.tensor(ids), torch.arange(len(ids))))[2:]  # (4, V)
    want = model_logits.log_softmax(-1)
    for i, x in enumerate(req.logprobs):
        top = want[i].topk(2)
        assert x.rank == 1 and x.top_ids == top.indices.tolist()  # greedy: the top token is the sampled one
        assert x.logprob == pytest.approx(float(want[i, req.output_ids[i]]), abs=1e-5)
        assert x.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)


# ----- batch invariance under every parameter -----

MODEL = tiny_model(seed=5, num_layers=1)
VOCAB = MODEL.config.vocab_size


@st.composite
def any_params(draw, seed=True):
    kw = dict(max_tokens=draw(st.integers(2, 7)), temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
              seed=draw(st.integers(0, 2**32)) if seed else None)
    kw["top_k"] = draw(st.sampled_from([0, 0, 1, 5]))
    kw["top_p"] = draw(st.sampled_from([1.0, 1.0, 0.9, 0.3]))
    kw["min_p"] = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5]))
    kw["repetition_penalty"] = draw(st.sampled_from([1.0, 1.0, 1.3, 0.8]))
    kw["frequency_penalty"] = draw(st.sampled_from([0.0, 0.0, 0.7, -0.5]))
    kw["presence_penalty"] = draw(st.sampled_from([0.0, 0.0, 1.0, -1.0]))
    kw["logit_bias"] = draw(st.one_of(st.none(), st.dictionaries(st.integers(0, VOCAB - 1),
                                                                 st.sampled_from([-100.0, -2.0, 3.0]), max_size=3)))
    kw["min_tokens"] = draw(st.integers(0, kw["max_tokens"]))
    kw["logprobs"] = draw(st.sampled_from([None, 0, 3]))
    kw["ignore_eos"] = draw(st.booleans())
    return SamplingParams(**kw)


def run(prompts, params, **engine_kw):
    reqs = LLMEngine(MODEL, num_blocks=64, block_size=4, **engine_kw).generate(prompts, params)
    return [(r.output_ids, [(x.token_id, x.logprob, x.rank, x.top_ids, x.top_logprobs) for x in r.logprobs])
            for r in reqs]


prompt_st = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_st, any_params(), st.lists(st.tuples(prompt_st, any_params(seed=False)), max_size=3),
       st.integers(0, 3), st.sampled_from([4, 7, 64]))
def test_a_seeded_request_is_the_same_in_any_batch(prompt, sp, others, where, budget):
    alone = run([prompt], [sp])[0]
    prompts = [p for p, _ in others]
    params = [q for _, q in others]
    where = min(where, len(others))
    prompts.insert(where, prompt)
    params.insert(where, sp)
    crowd = run(prompts, params, max_num_batched_tokens=budget)[where]
    assert crowd == alone


def test_a_greedy_row_is_the_argmax_of_its_own_dtype_in_any_batch():
    """Two float64 logits that float32 cannot tell apart: the greedy row must pick as the fast path does."""
    logits = torch.tensor([[1.0, 1.0 + 1e-12, 0.0], [0.0, 1.0, 2.0]], dtype=torch.float64)
    alone = sample(logits[:1], SamplingMetadata([SamplingParams()], [None])).token_ids
    mixed = sample(logits, SamplingMetadata([SamplingParams(), SamplingParams(temperature=1.0, seed=0)],
                                            [None, torch.Generator().manual_seed(0)])).token_ids
    assert alone == [1] and mixed[0] == 1

"""Sampling: greedy, temperature, top-k, top-p, and seeds independent of the batch."""

import torch

from nano_engine import LLMEngine, SamplingParams
from nano_engine.sampling import filter_logits, sample_one


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, 0, 0.7)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, 0, 0.5)).tolist() == [False, True, True, True]
    assert not torch.isinf(filter_logits(logits, 0, 1.0)).any()


def test_sampling_respects_the_filters():
    logits = torch.tensor([3.0, 2.9, 2.8, -1.0])
    g = torch.Generator().manual_seed(0)
    draws = {sample_one(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)}
    assert draws == {0, 1}
    assert sample_one(logits, SamplingParams(), None) == 0  # greedy


def test_seeded_request_is_independent_of_the_batch(tiny):
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=1234)
    alone = LLMEngine(tiny).generate([[3, 4, 5]], sp)[0].output_ids
    crowd = LLMEngine(tiny, max_num_batched_tokens=5).generate(
        [[9, 9, 9, 9], [3, 4, 5], [7, 1]],
        [SamplingParams(max_tokens=8, temperature=0.7), sp, SamplingParams(max_tokens=5, seed=1)])
    assert crowd[1].output_ids == alone
    other_seed = LLMEngine(tiny).generate([[3, 4, 5]], SamplingParams(max_tokens=12, temperature=1.0, seed=99))
    assert other_seed[0].output_ids != alone


def test_stop_tokens_and_ignore_eos(tiny):
    engine = LLMEngine(tiny)
    free = engine.generate([[5, 6]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.output_ids) == 6
    stop = free.output_ids[2]
    first = free.output_ids.index(stop)
    cut = LLMEngine(tiny).generate([[5, 6]], SamplingParams(max_tokens=6, ignore_eos=True,
                                                            stop_token_ids=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.output_ids == free.output_ids[:first + 1]

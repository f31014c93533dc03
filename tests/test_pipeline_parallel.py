"""Pipeline parallelism (nano_engine/pipeline_parallel.py): the layers in stages, one process each;
every step's logits are one process's, bit for bit, under chunked prefill, preemption and prefix
caching; a size the model or the machine cannot run is refused before any process starts; a dead
stage fails the step and leaves no process behind."""

import os
import signal

import pytest
import torch

from nano_engine import LLMEngine, SamplingParams, Transformer
from nano_engine.parallel.workers import WorkerError, max_ranks
from nano_engine.tiny import tiny_model
from test_tensor_parallel import MAX_TOKENS, PROMPTS, check_sizes, no_children, run as run_at, variants


def five_layers(dtype: torch.dtype, **extra) -> Transformer:
    """A tiny model of 5 layers: 2 stages take 2 and 3 of them, 3 stages 1, 2 and 2, 4 stages 1, 1, 1, 2."""
    return tiny_model(seed=4, dtype=dtype, vocab_size=61, num_layers=5, eos_token_id=60, **extra).requires_grad_(False)


def run(model, stages: int, prompts=PROMPTS, **settings):
    return run_at(model, stages, prompts, key="pipeline_parallel_size", **settings)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_number_of_stages_gives_one_process_logits_bit_for_bit(dtype):
    check_sizes(five_layers, dtype, "pipeline_parallel_size", (2, 3, 4))


def test_a_tied_head_and_qk_norm_on_the_last_stage():
    model = five_layers(torch.float32, qk_norm=True).fuse()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    tokens, steps = run(model, 1, num_blocks=64)
    got_tokens, got_steps = run(model, 2, num_blocks=64)
    assert got_tokens == tokens and all(torch.equal(a, b) for a, b in zip(steps, got_steps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_embedded_model_in_two_stages_gives_one_process_bits(dtype):
    from nano_engine.models.loading import chat_prompt_ids, load_tokenizer

    tokenizer = load_tokenizer(None)
    prompts = [chat_prompt_ids(tokenizer, q) for q in ("What is the capital of France?", "Tell me about the moon.",
                                                       "What is 1+1?")]
    prompts.append(prompts[0])  # again: a prefix-cache hit
    settings = dict(max_num_batched_tokens=32, num_blocks=6, block_size=16)  # chunks, and a preemption
    backend, prepack = variants(dtype)[-1]
    model = Transformer.from_pretrained(None, dtype=dtype, prepack=prepack)
    tokens, steps = run(model, 1, prompts, attention_backend=backend, **settings)
    got_tokens, got_steps = run(model, 2, prompts, attention_backend=backend, **settings)
    assert got_tokens == tokens and all(torch.equal(a, b) for a, b in zip(steps, got_steps))


@pytest.mark.parametrize("settings,words", [
    (dict(pipeline_parallel_size=6), r"pipeline_parallel_size=6.*5 layers"),
    (dict(pipeline_parallel_size=2, tensor_parallel_size=2), "one or the other"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
])
def test_a_size_that_cannot_run_is_refused_before_any_process_starts(settings, words):
    with pytest.raises(ValueError, match=words):
        LLMEngine(five_layers(torch.float32), **settings)
    assert no_children() == []


def test_more_stages_than_the_machine_runs_are_refused():
    model = tiny_model(dtype=torch.float32, num_layers=max_ranks() + 1)
    with pytest.raises(ValueError, match=f"pipeline_parallel_size={max_ranks() + 1}.*at most {max_ranks()}"):
        LLMEngine(model, pipeline_parallel_size=max_ranks() + 1)
    assert no_children() == []


def test_a_dead_stage_fails_the_step_and_nothing_is_left():
    engine = LLMEngine(five_layers(torch.float32), pipeline_parallel_size=3, num_blocks=32, block_size=4)
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()
    os.kill(engine.runner.workers.procs[-1].pid, signal.SIGKILL)  # the last stage, mid-generation
    with pytest.raises(WorkerError, match="rank 2"):
        engine.step()
    assert engine.requests[rid].finish_reason == "error"
    assert engine.block_pool.num_free == engine.block_pool.num_blocks and no_children() == []
    engine.close()


def test_one_process_two_ranks_and_two_stages_serve_the_same_tokens_and_logprobs_at_once():
    """Through the server and the openai client, requests sent together: tensor and pipeline
    parallelism answer with one process's tokens and logprobs, to the last bit of the JSON."""
    import asyncio

    import openai
    from in_process import serving

    from nano_engine.models.loading import chat_prompt_ids, load_tokenizer
    from nano_engine.serving.async_llm import AsyncLLM
    from nano_engine.serving.server import build_app

    model = Transformer.from_pretrained(None, dtype=torch.bfloat16)
    tokenizer = load_tokenizer(None)
    prompts = [chat_prompt_ids(tokenizer, q) for q in ("What is the capital of France?", "Tell me about the moon.",
                                                       "What is 1+1?", "Name a color.")]

    async def ask_all(url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        outs = await asyncio.gather(*(client.completions.create(model="smol", prompt=p, max_tokens=12, temperature=0,
                                                                 logprobs=3) for p in prompts))
        return [(o.choices[0].text, o.choices[0].logprobs.model_dump()) for o in outs]

    answers = {}
    for name, sizes in (("one", {}), ("tp2", dict(tensor_parallel_size=2)), ("pp2", dict(pipeline_parallel_size=2))):
        llm = AsyncLLM(lambda: LLMEngine(model, tokenizer, num_blocks=64, max_num_batched_tokens=48, **sizes))
        try:
            with serving(build_app(llm, "smol")) as url:
                answers[name] = asyncio.run(ask_all(url))
        finally:
            llm.shutdown()
    assert no_children() == []
    assert answers["tp2"] == answers["one"] and answers["pp2"] == answers["one"]
    assert all(len(lp["tokens"]) > 3 for _, lp in answers["one"])

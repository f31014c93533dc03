"""Tensor parallelism (nano_engine/tensor_parallel.py): at every degree the engine's logits are one
process's, bit for bit, step by step, under chunked prefill, preemption and prefix caching; a
degree the model or the machine cannot run is refused before any process starts; a dead rank
fails the step, not the engine's process, and leaves no process behind."""

import multiprocessing
import os
import signal

import pytest
import torch

from nano_engine import LLMEngine, SamplingParams, generate
from nano_engine.kernels import paged_attention
from nano_engine.kernels.linear import can_prepack
from nano_engine.mini_llm import Transformer
from nano_engine.parallel.workers import WorkerError, max_ranks
from nano_engine.tiny import tiny_model

# A budget of 16 tokens cuts the prompts into chunks; 14 blocks of 4 make the decodes preempt
# each other; the prompts share a 2-block prefix, and the last two come again (prefix cache hits).
SETTINGS = dict(max_num_batched_tokens=16, num_blocks=14, block_size=4)
PROMPTS = [[5, 9, 2, 7, 11, 3, 8, 4] + [13 + i, 17, 19 + i] * (i + 1) for i in range(5)]
PROMPTS += PROMPTS[-2:]
MAX_TOKENS = 10


def four_kv_heads(dtype: torch.dtype) -> Transformer:
    """A tiny model that tensor parallelism can cut 1, 2, 3 and 4 ways: 4 KV heads of 2 query heads
    each, an MLP of 90 columns (leaves of 22 and 23) and a vocabulary of 61 rows (uneven shares)."""
    return tiny_model(seed=3, dtype=dtype, vocab_size=61, num_attention_heads=8, num_key_value_heads=4,
                      intermediate_size=90, eos_token_id=60).requires_grad_(False)


def run(model: Transformer, size: int, prompts=PROMPTS, key: str = "tensor_parallel_size", **settings):
    """Each request's tokens, and every step's logits, from an engine with `key` (tensor_parallel_size
    or pipeline_parallel_size) at `size`."""
    steps = []
    with LLMEngine(model, **{key: size}, **{**SETTINGS, **settings}) as engine:
        forward = engine.runner.forward
        engine.runner.forward = lambda batch: steps.append(forward(batch)) or steps[-1]
        out = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        # chunked prefill, preemption and prefix-cache hits, unless the caller gave a pool too large for them
        assert (engine.stats.preemptions > 0 and engine.scheduler.prefix_cache_hits > 0) or settings.get(
            "num_blocks", 0) >= 64
    return [r.output_ids for r in out], steps


def check_sizes(model_of, dtype: torch.dtype, key: str, sizes) -> None:
    """At every size, on every path this machine runs for dtype: generate's tokens, and every step's
    logits equal to one process's, bit for bit."""
    for backend, prepack in variants(dtype):
        model = model_of(dtype).fuse()
        if prepack:
            model.prepack()
        reference = [generate(model, p, MAX_TOKENS, eos_token_id=60, attention_backend=backend) for p in PROMPTS]
        tokens, steps = run(model, 1, key=key, attention_backend=backend)
        assert tokens == reference
        for size in sizes:
            got_tokens, got_steps = run(model, size, key=key, attention_backend=backend)
            assert got_tokens == reference and len(got_steps) == len(steps), (backend, prepack, size)
            for i, (a, b) in enumerate(zip(steps, got_steps)):
                assert torch.equal(a, b), f"{backend=} {prepack=} {key}={size}: step {i} differs by {(a - b).abs().max()}"


def variants(dtype):
    """(attention backend, prepacked) pairs this machine runs for dtype."""
    out = [("torch", False)]
    if dtype in paged_attention.DTYPES:
        out.append(("c", can_prepack(dtype)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_degree_gives_one_process_logits_bit_for_bit(dtype):
    check_sizes(four_kv_heads, dtype, "tensor_parallel_size", (2, 4))


def test_uneven_shares_of_heads_give_the_same_bits():
    """3 ranks over 4 KV heads: 2, 1 and 1 of them (the tree's (0 + 1) + (2 + 3), cut at its left child)."""
    model = four_kv_heads(torch.float32).fuse()
    tokens, steps = run(model, 1)
    got_tokens, got_steps = run(model, 3)
    assert got_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(steps, got_steps))


def test_tied_embeddings_and_qk_norm_are_cut_too():
    model = tiny_model(seed=1, dtype=torch.float32, vocab_size=50, qk_norm=True).fuse()
    model.config.tie_word_embeddings = True
    with torch.no_grad():
        model.lm_head.weight = model.model.embed_tokens.weight
    tokens, steps = run(model, 1, num_blocks=64)
    got_tokens, got_steps = run(model, 2, num_blocks=64)
    assert got_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(steps, got_steps))


def no_children():
    return [p for p in multiprocessing.active_children() if p.name.startswith("nano_engine-rank")]


@pytest.mark.parametrize("degree,words", [(3, r"tensor_parallel_size=3.*2 KV heads"),
                                          (0, "tensor_parallel_size"),
                                          (max_ranks() + 1, "ranks|KV heads")])
def test_a_degree_the_model_or_machine_cannot_run_is_refused_before_any_process_starts(degree, words):
    model = tiny_model(dtype=torch.float32, num_key_value_heads=2 if degree == 3 else 8, num_attention_heads=8)
    with pytest.raises(ValueError, match=words):
        LLMEngine(model, tensor_parallel_size=degree)
    assert no_children() == []


def test_a_kv_pool_larger_than_memory_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"num_blocks=1000000000.*all ranks together"):
        LLMEngine(four_kv_heads(torch.float32), tensor_parallel_size=2, num_blocks=10**9)
    assert no_children() == []


def test_a_dead_rank_fails_the_step_and_the_engine_says_so_after():
    model = four_kv_heads(torch.float32)
    engine = LLMEngine(model, tensor_parallel_size=2, num_blocks=32, block_size=4)
    [worker] = engine.runner.workers.procs
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match="rank 1"):
        engine.step()
    assert engine.requests[rid].finish_reason == "error"
    assert engine.block_pool.num_free == engine.block_pool.num_blocks  # nothing leaked
    assert no_children() == []
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=2))
    with pytest.raises(WorkerError, match="stopped"):  # refused at once, not after a timeout
        engine.step()
    engine.close()


def test_close_stops_every_worker_and_restores_the_threads():
    threads = torch.get_num_threads()
    engine = LLMEngine(four_kv_heads(torch.float64), tensor_parallel_size=4, num_blocks=8)
    assert len(no_children()) == 3
    engine.close()
    assert no_children() == []
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_embedded_model_gives_one_process_bits_at_two_and_three_ranks(dtype):
    from nano_engine.models.loading import chat_prompt_ids, load_tokenizer

    tokenizer = load_tokenizer(None)
    prompts = [chat_prompt_ids(tokenizer, q) for q in ("What is the capital of France?", "Tell me about the moon.",
                                                       "What is 1+1?")]
    prompts.append(prompts[0])  # again: a prefix-cache hit
    settings = dict(max_num_batched_tokens=32, num_blocks=6, block_size=16)  # chunks, and a preemption
    for backend, prepack in variants(dtype):
        model = Transformer.from_pretrained(None, dtype=dtype, prepack=prepack)
        eos = model.config.eos_token_id
        reference = [generate(model, p, MAX_TOKENS, eos_token_id=eos, attention_backend=backend) for p in prompts]
        tokens, steps = run(model, 1, prompts, attention_backend=backend, **settings)
        assert tokens == reference
        for degree in (2, 3) if backend == "c" else (2,):
            got_tokens, got_steps = run(model, degree, prompts, attention_backend=backend, **settings)
            assert got_tokens == reference
            assert all(torch.equal(a, b) for a, b in zip(steps, got_steps)), (backend, degree)


def test_the_server_at_two_ranks_answers_the_openai_client_with_generate_tokens_and_503_once_a_rank_dies():
    import openai
    from in_process import serving

    from nano_engine.models.loading import chat_prompt_ids, load_tokenizer
    from nano_engine.serving.async_llm import AsyncLLM
    from nano_engine.serving.server import build_app

    model = Transformer.from_pretrained(None, dtype=torch.bfloat16)
    tokenizer = load_tokenizer(None)
    llm = AsyncLLM(lambda: LLMEngine(model, tokenizer, tensor_parallel_size=2, num_blocks=64))
    try:
        with serving(build_app(llm, "smol")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            prompt = chat_prompt_ids(tokenizer, "What is the capital of France?")
            out = client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0)
            expected = generate(model, prompt, 8, model.config.eos_token_id)
            assert out.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True) and len(expected) > 4
            [worker] = llm.engine.runner.workers.procs
            os.kill(worker.pid, signal.SIGKILL)
            with pytest.raises(openai.APIStatusError) as failed:
                client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0)
            assert failed.value.status_code == 503
            with pytest.raises(openai.APIStatusError) as refused:  # the next one too, at once
                client.completions.create(model="smol", prompt=prompt, max_tokens=2, temperature=0)
            assert refused.value.status_code == 503
            assert no_children() == []
    finally:
        llm.shutdown()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _spawned_children(pid: int) -> list[int]:
    """The processes `pid` started with multiprocessing's spawn (its tensor-parallel workers)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                spawned = "spawn_main" in f.read()
        except OSError:
            continue
        if parent == pid and spawned and _alive(int(entry)):
            out.append(int(entry))
    return out


def test_ctrl_c_on_serve_at_two_ranks_stops_every_worker():
    """`python -m nano_engine serve --tensor-parallel-size 2`, a real process: it answers, then
    Ctrl-C (SIGINT) ends it (status 130, as for every command here) and its worker with it."""
    import time

    import openai

    from nano_engine.serving.launcher import ServerProcess

    server = ServerProcess("--tensor-parallel-size", "2", "--dtype", "bfloat16", "--max-num-seqs", "4").start()
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        out = client.completions.create(model=client.models.list().data[0].id, prompt=[1, 2, 3], max_tokens=3,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        workers = _spawned_children(server.proc.pid)
        assert len(workers) == 1, workers
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(60) in (0, 130)
        deadline = time.monotonic() + 20
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, workers))
    finally:
        server.stop()

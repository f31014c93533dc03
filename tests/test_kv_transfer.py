"""Disaggregated prefill (nano_engine/kv_transfer.py): a producer engine computes the prompts, a
consumer engine of another block size loads their KV through the connector and decodes, with one
engine's tokens and logprobs, computing only what it could not load."""

import pytest
import torch

from nano_engine import LLMEngine, SamplingParams, generate
from nano_engine.kv_transfer import KVTransferConfig
from nano_engine.tiny import tiny_model
from test_tensor_parallel import variants

PROMPTS = [[5, 9, 2, 7, 11, 3, 8, 4] + [13 + i, 17, 19 + i] * (3 * i + 2) for i in range(4)]


def config(role, folder):
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(folder)}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_consumer_of_another_block_size_decodes_one_engines_tokens_and_logprobs(tmp_path, dtype):
    """On the batch-invariant path (the packed kernels and the attention kernel where the CPU has
    them; float64 everywhere), the logprobs too, to the last bit."""
    backend, prepack = variants(dtype)[-1]
    model = tiny_model(seed=2, dtype=dtype, vocab_size=61, eos_token_id=60).fuse()
    if prepack:
        model.prepack()
    params = SamplingParams(max_tokens=12, logprobs=2)
    alone = LLMEngine(model, block_size=4, num_blocks=128, attention_backend=backend).generate(PROMPTS, params)
    producer = LLMEngine(model, block_size=16, num_blocks=32, max_num_batched_tokens=24, attention_backend=backend,
                         kv_transfer_config=config("kv_producer", tmp_path))
    producer.generate(PROMPTS, SamplingParams(max_tokens=1))  # the prefill instance: one token each
    assert producer.kv_connector.num_saved == len(PROMPTS)
    consumer = LLMEngine(model, block_size=4, num_blocks=128, attention_backend=backend,
                         kv_transfer_config=config("kv_consumer", tmp_path))
    got = consumer.generate(PROMPTS, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in alone]
    assert [r.output_ids for r in got] == [generate(model, p, 12, eos_token_id=60, attention_backend=backend)
                                           for p in PROMPTS]
    assert [r.logprobs for r in got] == [r.logprobs for r in alone]
    # It loaded every whole block of each prompt but the one holding its last token, and computed the rest.
    loaded = sum((len(p) - 1) // 4 * 4 for p in PROMPTS)
    assert consumer.kv_connector.num_loaded_tokens == loaded
    assert consumer.stats.tokens == sum(len(p) for p in PROMPTS) - loaded + sum(len(r.output_ids) - 1 for r in got)


def test_a_consumer_without_the_prompts_kv_computes_it(tmp_path):
    model = tiny_model(seed=2, dtype=torch.float64)
    consumer = LLMEngine(model, block_size=4, kv_transfer_config=config("kv_consumer", tmp_path))
    out = consumer.generate(PROMPTS[:2], SamplingParams(max_tokens=4))
    assert consumer.kv_connector.num_loaded_tokens == 0
    assert [r.output_ids for r in out] == [generate(model, p, 4, eos_token_id=0) for p in PROMPTS[:2]]


def test_kv_of_another_dtype_is_refused_by_name_and_the_engine_goes_on(tmp_path):
    producer = LLMEngine(tiny_model(seed=2, dtype=torch.float64), kv_transfer_config=config("kv_producer", tmp_path))
    producer.generate(PROMPTS[:1], SamplingParams(max_tokens=1))
    consumer = LLMEngine(tiny_model(seed=2, dtype=torch.float32), block_size=4,
                         kv_transfer_config=config("kv_consumer", tmp_path))
    with pytest.raises(ValueError, match="float64"):
        consumer.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
    assert consumer.block_pool.num_free == consumer.block_pool.num_blocks and not consumer.has_unfinished()


@pytest.mark.parametrize("bad, words", [
    ({"kv_role": "kv_sender", "kv_connector_extra_config": {"shared_storage_path": "/tmp"}}, "kv_role"),
    ({"kv_role": "kv_consumer"}, "shared_storage_path"),
    ({"kv_connector": "NixlConnector", "kv_connector_extra_config": {"shared_storage_path": "/tmp"}}, "kv_connector"),
    ({"kv_rol": "kv_consumer"}, "unknown fields"),
])
def test_a_bad_transfer_config_is_refused_by_its_field(bad, words):
    with pytest.raises(ValueError, match=words):
        KVTransferConfig.of(bad)


def test_prefill_and_decode_servers_behind_the_proxy_answer_the_openai_client_as_one_server(tmp_path):
    """Three servers on 127.0.0.1: the prefill one (producer), the decode one (consumer), the
    proxy in front; the client's answers, streamed and not, equal generate's, and the decode
    server computed only the prompts' last block."""
    import openai
    from in_process import serving

    from nano_engine import Transformer
    from nano_engine.models.loading import chat_prompt_ids, load_tokenizer
    from nano_engine.serving.async_llm import AsyncLLM
    from nano_engine.serving.disagg_proxy import build_proxy
    from nano_engine.serving.server import build_app

    model = Transformer.from_pretrained(None, dtype=torch.bfloat16)
    tokenizer = load_tokenizer(None)
    prefill = AsyncLLM(lambda: LLMEngine(model, tokenizer, block_size=32, kv_transfer_config=config("kv_producer", tmp_path)))
    decode = AsyncLLM(lambda: LLMEngine(model, tokenizer, block_size=16, kv_transfer_config=config("kv_consumer", tmp_path)))
    prompt = chat_prompt_ids(tokenizer, "Write one sentence about the sea, and one about the moon.")
    expected = tokenizer.decode(generate(model, prompt, 12, model.config.eos_token_id), skip_special_tokens=True)
    try:
        with serving(build_app(prefill, "smol")) as p_url, serving(build_app(decode, "smol")) as d_url, \
                serving(build_proxy(p_url, d_url)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            out = client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0)
            assert out.choices[0].text == expected and out.usage.completion_tokens == 12
            stream = client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == expected
            with pytest.raises(openai.BadRequestError):  # the prefill server's refusal is the answer
                client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=-1)
    finally:
        prefill.shutdown()
        decode.shutdown()
    # The first request loaded the prompt's whole blocks; the second found them in the prefix cache.
    assert decode.engine.kv_connector.num_loaded_tokens == (len(prompt) - 1) // 16 * 16
    assert decode.engine.scheduler.prefix_cache_hits == (len(prompt) - 1) // 16 * 16

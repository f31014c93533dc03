"""mini_llm against Hugging Face transformers on tiny random Llama, Qwen2 and Qwen3 checkpoints."""

import pytest
import torch
import transformers

from nano_engine.mini_llm import Transformer, generate

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, rope_theta=10000.0, tie_word_embeddings=True),
    "llama3-rope": lambda: transformers.LlamaConfig(
        **COMMON, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    with torch.no_grad():  # larger weights than the default init, so greedy tokens vary
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf = hf.to(torch.float64).eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    ours = Transformer.from_pretrained(folder, dtype=torch.float64)
    return hf, ours


def test_logits_match_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    mine = ours.compute_logits(ours(ids, torch.arange(40)))
    # cos/sin are computed in float32 on both sides, so agreement is ~1e-7, not 1e-15.
    assert torch.allclose(mine, ref, rtol=1e-5, atol=1e-5), (mine - ref).abs().max()


def test_greedy_tokens_match_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(2))
    ref = hf.generate(ids[None], attention_mask=torch.ones(1, 11, dtype=torch.long), max_new_tokens=16,
                      do_sample=False, eos_token_id=None, pad_token_id=0)[0, 11:]
    assert torch.equal(torch.tensor(generate(ours, ids, 16)), ref)


def test_kv_cache_decode_equals_full_recompute(tiny):
    """generate's cached decode gives the logits of a full forward pass over the whole sequence."""
    ids = torch.randint(1, 64, (9,), generator=torch.Generator().manual_seed(3))
    out = generate(tiny, ids, 6)
    full = torch.cat((ids, torch.tensor(out[:-1])))
    logits = tiny.compute_logits(tiny(full, torch.arange(len(full))))
    assert logits[len(ids) - 1:].argmax(-1).tolist() == out


def test_generate_stops_at_eos(tiny):
    ids = [5, 6, 7]
    first = generate(tiny, ids, 1)[0]
    assert generate(tiny, ids, 10, eos_token_id=first) == [first]
    with pytest.raises(ValueError, match="empty"):
        generate(tiny, [], 4)


@pytest.mark.parametrize("shape", [(576, 576), (576, 1536), (1536, 576), (1152, 576)])
def test_bfloat16_linear_gives_each_row_the_bits_it_gets_alone(shape):
    """The property the engine's bfloat16 identity rests on: a row's product does not depend on
    how many rows share the call (oneDNN's one-row kernel rounds differently, so mini_llm.linear
    never calls it)."""
    from nano_engine.mini_llm import linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=gen).bfloat16()
    x = torch.randn(100, shape[1], generator=gen).bfloat16()
    alone = torch.cat([linear(x[i:i + 1], w) for i in range(len(x))])
    for rows in (2, 3, 17, 32, 33, 40, 65, 100):
        assert torch.equal(linear(x[:rows], w), alone[:rows]), rows

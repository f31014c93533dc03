"""The engine's one-call decoder (kernels/decoder.py): every layer of a step in one compiled call,
with the bits of the layer-by-layer path, and never with a weight it no longer matches."""

import pytest
import torch

from nano_engine import LLMEngine, SamplingParams
from nano_engine.kernels import decoder
from nano_engine.kernels.linear import packed_kind
from nano_engine.mini_llm import ModelConfig, Transformer
from nano_engine.paged import BlockPool
from nano_engine.runner import ModelRunner, SeqChunk, build_batch
from nano_engine.tiny import tiny_model

# The dtypes whose matmuls run on a kernel of ours here (the decoder calls only those).
OURS = [dt for dt in (torch.float32, torch.bfloat16) if packed_kind(dt) in ("f32", "bf16_dot", "amx")]


def biased_model(dtype) -> Transformer:
    """A tiny Qwen2-shaped model: a bias on q, k and v (the one bias the decoder adds). Each part of
    o_proj and down_proj is 32 or 64 deep, so that AMX's packs need no padding (the decoder takes none)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                      model_type="qwen2")
    gen = torch.Generator().manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.to(dtype).eval().fuse().prepack()


def two_steps(model, seed=0):
    """Logits of a step holding a fresh prompt, the rest of a prompt over its cached part and a
    decode, after a first step that cached their beginnings; and the K and V caches after it."""
    bs, pool = 16, BlockPool(40)
    runner = ModelRunner(model, 40, bs, attention_backend="c")
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    seqs = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (37, 45, 21)]
    tables = [pool.allocate(4) for _ in seqs]
    runner.forward(build_batch([SeqChunk(seqs[1][:30], 0, tables[1], False),
                                SeqChunk(seqs[2][:20], 0, tables[2], False)], bs))
    logits = runner.forward(build_batch([SeqChunk(seqs[0], 0, tables[0], True),
                                         SeqChunk(seqs[1][30:], 30, tables[1], True),
                                         SeqChunk(seqs[2][20:], 20, tables[2], True)], bs))
    return logits, [k.clone() for k in runner.kv_cache.k] + [v.clone() for v in runner.kv_cache.v]


def layer_by_layer(model, monkeypatch, seed=0):
    with monkeypatch.context() as m:
        m.setattr(decoder, "make_plan", lambda model: None)
        model._decoder = None
        out = two_steps(model, seed)
    model._decoder = None
    return out


@pytest.fixture(scope="module")
def embedded():
    return {dt: Transformer.from_pretrained(dtype=dt, prepack=True) for dt in OURS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_gives_every_bit_of_the_layer_by_layer_path(dtype, embedded, monkeypatch):
    """The same logits and the same K and V in the cache, on the embedded model, on a model with a
    q/k/v bias (Qwen2) and on one with a norm on each q and k head (Qwen3); where this CPU has no kernel of ours for the dtype, the model has no plan."""
    if dtype not in OURS:
        model = biased_model(torch.float32) if dtype == torch.float32 else None
        assert model is None or decoder.make_plan(model) is None
        return
    qwen3 = tiny_model(seed=4, dtype=dtype, qk_norm=True, num_key_value_heads=1)  # (one part of 32: see above)
    for model in (embedded[dtype], biased_model(dtype), qwen3.fuse().prepack()):
        fast, fast_cache = two_steps(model)
        assert isinstance(model._decoder, decoder.Plan)  # it ran
        slow, slow_cache = layer_by_layer(model, monkeypatch)
        assert torch.equal(fast, slow)
        assert all(torch.equal(a, b) for a, b in zip(fast_cache, slow_cache))


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_on_quantized_weights_gives_every_bit_of_the_layer_by_layer_path(dtype, method, monkeypatch):
    """Quantized weights (quantization.py) in the one call: the q/k/v bias (Qwen2), a norm on each q
    and k head (Qwen3), o_proj and down_proj in parts; where the CPU has no kernel of ours, no plan."""
    models = [biased_model(dtype).quantize(method), tiny_model(seed=5, dtype=dtype, qk_norm=True).fuse().quantize(method)]
    for model in models:
        fast, fast_cache = two_steps(model)
        assert isinstance(model._decoder, decoder.Plan) == (dtype in OURS)  # it ran, where it can
        slow, slow_cache = layer_by_layer(model, monkeypatch)
        assert torch.equal(fast, slow)
        assert all(torch.equal(a, b) for a, b in zip(fast_cache, slow_cache))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_changed_in_place_is_read_at_the_next_step(dtype, monkeypatch):
    if dtype not in OURS:  # no plan here (the first test checks it)
        return
    model = biased_model(dtype)
    before, _ = two_steps(model)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight.mul_(1.5)  # read by the decoder as it is
    after, _ = two_steps(model)
    assert isinstance(model._decoder, decoder.Plan)
    assert not torch.equal(before, after)
    assert torch.equal(after, layer_by_layer(model, monkeypatch)[0])
    with torch.no_grad():
        model.model.layers[2].self_attn.k_proj.bias.add_(0.5)  # a bias, widened to float32 for bfloat16
    biased, _ = two_steps(model)
    assert isinstance(model._decoder, decoder.Plan)
    assert not torch.equal(biased, after)
    assert torch.equal(biased, layer_by_layer(model, monkeypatch)[0])
    two_steps(model)
    assert isinstance(model._decoder, decoder.Plan)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0)  # its pack is stale: no plan, the plain matmul
    changed, _ = two_steps(model)
    assert model._decoder is False
    assert torch.equal(changed, layer_by_layer(model, monkeypatch)[0])
    model.prepack()  # packed again: the decoder again
    repacked = two_steps(model)[0]
    assert isinstance(model._decoder, decoder.Plan)
    assert torch.equal(repacked, layer_by_layer(model, monkeypatch)[0])
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    model.to(other)  # new tensors, their packs stale: the layer-by-layer path
    two_steps(model)
    assert model.dtype == other and model._decoder is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_profiler_sees_each_kernel(dtype):
    """Under torch.profiler the layers run one by one, so bench/breakdown.py can split a step."""
    if dtype not in OURS:  # no plan here: the layers run one by one anyway
        return
    model = biased_model(dtype)
    engine = LLMEngine(model, attention_backend="c")
    with torch.profiler.profile() as prof:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    names = {e.key for e in prof.key_averages()}
    assert {"nano_engine::paged_attention", "nano_engine::add_rms_norm"} <= names
    assert any(n.startswith("nano_engine::gemm") for n in names)


def test_without_a_matmul_of_ours_the_layers_run_one_by_one(monkeypatch):
    """Where float32 packs for oneDNN (a CPU without AVX-512), there is no plan, and the engine's
    step equals the layer-by-layer path, as everywhere."""
    from nano_engine.kernels import linear as linear_module

    monkeypatch.setattr(linear_module, "packed_kind", lambda dtype: "onednn" if linear_module.ONEDNN_FP32 else None)
    if not linear_module.ONEDNN_FP32:
        return
    model = biased_model(torch.float32)
    assert model.prepacked and decoder.make_plan(model) is None
    logits, _ = two_steps(model)
    assert model._decoder is False
    assert torch.equal(logits, layer_by_layer(model, monkeypatch)[0])


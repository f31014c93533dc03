"""Weight-only quantization (nano_engine/quantization.py, Transformer.quantize, --quantization): the
stored format, the kernel's bits against the dequantized weights, and the engine's tokens against
generate on the same quantized model."""

import multiprocessing
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from nano_engine import LLMEngine, SamplingParams, Transformer, generate
from nano_engine.kernels import linear as linear_kernels
from nano_engine.kernels.linear import PackedLeaves, PackedWeight, chain_library, packed_kind
from nano_engine.lab.experiments import identity_check
from nano_engine.models.loading import chat_prompt_ids, load_tokenizer
from nano_engine.parallel.split import Tree, bounds
from nano_engine.quantization import (QuantizedWeight, dequantize, int_values, pack_int4, quantize,
                                      unpack_int4)
from nano_engine.serving.launcher import ServerProcess
from nano_engine.tiny import tiny_model



def kernel(dtype) -> bool:  # csrc/gemm_f32.cpp's gemm_quant_* runs here; else F.linear on the dequantized weight
    return chain_library(dtype) is not None


def test_int8_has_a_scale_per_row_that_takes_its_largest_magnitude_to_127():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, 37, generator=gen) * torch.tensor([1.0, 10.0, 0.01, 3.0, 0.0])[:, None]
    qt = quantize(w, "int8")
    q, scales = int_values(qt), qt.scales[:, 0]
    assert qt.data.dtype == torch.int8 and qt.scales.shape == (5, 1)
    assert torch.equal(q[:4].abs().amax(1), torch.full((4,), 127, dtype=torch.int8))
    assert (q[4] == 0).all() and torch.equal(dequantize(qt)[4], torch.zeros(37))  # a row of zeros stays zeros
    err = (dequantize(qt) - w).abs()
    assert (err <= scales[:, None] / 2 * (1 + 1e-6)).all()  # round to nearest: within half a step


def test_int4_has_a_scale_per_group_of_a_row_and_stores_two_values_a_byte():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 10, generator=gen)
    w[:, 4:8] *= 100  # one loud group must not coarsen the others
    qt = quantize(w, "int4", group_size=4)  # groups of columns 0-3, 4-7, 8-9
    q = int_values(qt)
    assert qt.data.shape == (3, 5) and qt.data.dtype == torch.uint8 and qt.scales.shape == (3, 3)
    assert q.min() >= -8 and q.max() <= 7
    for g, cols in enumerate((slice(0, 4), slice(4, 8), slice(8, 10))):
        assert torch.equal(q[:, cols].abs().amax(1), torch.full((3,), 7, dtype=torch.int8)), g
        assert ((dequantize(qt)[:, cols] - w[:, cols]).abs() <= qt.scales[:, g:g + 1] / 2 * (1 + 1e-6)).all(), g
    assert (dequantize(qt)[:, :4] - w[:, :4]).abs().max() < 0.5  # the quiet groups keep their own small steps


def test_int4_packing_round_trips_every_value_and_an_odd_width():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(2, 1)[:, :15]  # 15 columns
    data = pack_int4(q)
    assert data.shape == (2, 8) and data.dtype == torch.uint8
    assert data[0, 0] == (-8 + 8) | ((-7 + 8) << 4)  # column 0 in the low nibble, column 1 in the high, as q + 8
    assert data[0, 7] == (6 + 8) | (8 << 4)  # the odd column's partner: a zero
    assert torch.equal(unpack_int4(data, 15), q)


def by_chain(x: torch.Tensor, w: torch.Tensor, leaves) -> torch.Tensor:
    """What the quantized product must be, from the float32 dequantized weight w: the packed
    product of x's dtype (PackedWeight, PackedLeaves: gemm_f32.cpp's, AMX's tiles set aside where the
    CPU has them) on w as a model of that dtype stores it."""
    w = w.to(x.dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear_kernels, "amx_library", lambda: None)
        return PackedWeight(w).gemm(x, None) if leaves is None else PackedLeaves(w, leaves).gemm(x)


@pytest.mark.parametrize("method,group", [("int8", 128), ("int4", 128), ("int4", 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,num_leaves", [(40, 300, 1), (33, 101, 3), (17, 576, 3)])
def test_the_quantized_product_is_the_chain_over_the_dequantized_weight_at_every_row_count(method, group, dtype, n, k,
                                                                                          num_leaves):
    """Where the kernel runs, its bits are the dtype's packed product over fl(q * scale) as that dtype
    stores it, to the bit (odd widths, groups that straddle leaves, an odd int4 leaf, an odd group
    that straddles a pair of columns); elsewhere PyTorch's product of the same weight.
    Either way a row gets the same bits alone as in any batch."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    qt = quantize(w, method, group)
    leaves = tuple(bounds(k, num_leaves)) if num_leaves > 1 else None
    qw = QuantizedWeight(qt, w, leaves)
    x = torch.randn(13, k, generator=gen).to(dtype)
    got = qw.gemm(x)
    if kernel(dtype):
        assert torch.equal(got, by_chain(x, dequantize(qt), leaves))
    else:
        assert torch.allclose(got.float(), x.float() @ dequantize(qt).T, rtol=2e-2, atol=1e-2)
    assert all(torch.equal(qw.gemm(x[:m]), got[:m]) for m in (1, 2, 6, 7, 12))
    if leaves is None:
        bias = torch.randn(n, generator=gen)
        with_bias = qw.gemm(x, bias.to(dtype))
        assert torch.allclose(with_bias.float(), got.float() + bias.to(dtype).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_on_a_quantized_model_gives_generates_tokens(method, dtype):
    """Under chunked prefill, preemption and prefix caching (identity_check's configs), on a model
    with leaves (2 KV heads) and fused q/k/v and gate/up."""
    model = tiny_model(seed=3, dtype=dtype, eos_token_id=63).fuse().quantize(method)
    assert model.quantization == method and model.prepacked
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 20, 21], [30, 31]]
    configs = {"budget 4": {"max_num_batched_tokens": 4},
               "6 blocks of 4": {"max_num_batched_tokens": 8, "num_blocks": 6, "block_size": 4}}
    result = identity_check(model, prompts, max_tokens=10, configs=configs)
    assert [r.identical for r in result.rows] == [True] * len(result.rows)
    assert any(r.preemptions for r in result.rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_model_computes_what_its_dequantized_weights_give(dtype):
    """The quantized model is the prepacked model on the weights it stores (fl(q * scale) in the
    dtype), to the bit, where the kernels run; in float32 it also generates the plain path's tokens
    on them (exact weights; the plain bfloat16 path rounds otherwise than the packed kernels)."""
    model = tiny_model(seed=4, dtype=dtype).quantize("int4")
    same = tiny_model(seed=4, dtype=dtype)
    same.load_state_dict(model.state_dict())  # the dequantized weights, in the dtype
    ids = torch.tensor([3, 4, 5, 6, 7])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, torch.arange(5)))
        if kernel(dtype) and packed_kind(dtype) in ("f32", "bf16_dot"):  # (not AMX's tiles: other sums)
            same.prepack()
            assert same.prepacked and not same.quantization
            assert torch.equal(logits, same.compute_logits(same(ids, torch.arange(5))))
    if dtype == torch.float32:
        assert generate(model, [3, 4, 5], 8) == generate(same.unpack(), [3, 4, 5], 8)


def test_quantized_weights_read_a_quarter_and_an_eighth_of_float32s_bytes():
    model = tiny_model(seed=5, dtype=torch.float32, intermediate_size=512).quantize("int8")
    site = model.model.layers[0].mlp.down_proj
    assert site.packed.nbytes < site.weight.numel() * 4 / 4 * 1.01
    model = tiny_model(seed=5, dtype=torch.float32, intermediate_size=512).quantize("int4")
    site = model.model.layers[0].mlp.down_proj
    assert site.packed.nbytes < site.weight.numel() * 4 / 8 * 1.1  # plus a scale per 128 values


def test_bad_quantization_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="int3"):
        tiny_model(dtype=torch.float32).quantize("int3")
    with pytest.raises(ValueError, match="float64"):
        tiny_model(dtype=torch.float64).quantize("int8")
    model = tiny_model(dtype=torch.float32).quantize("int8")
    with pytest.raises(ValueError, match="already quantized"):
        model.quantize("int4")
    with pytest.raises(ValueError, match="group_size"):
        tiny_model(dtype=torch.float32).quantize("int4", group_size=0)


def test_the_embedded_model_in_int8_serves_generates_tokens_through_the_engine():
    model = Transformer.from_pretrained(dtype="bfloat16").quantize("int8")
    prompts = [[1, 9690, 198, 2683, 314, 253, 5356, 30], [1, 4093, 198, 19556, 30]]
    engine = LLMEngine(model, max_num_batched_tokens=16)
    out = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert [r.output_ids for r in out] == [generate(model, p, 12) for p in prompts]


def test_serve_with_quantization_answers_the_openai_client_with_generates_tokens():
    """A real `serve --quantization int4` process in bfloat16: two concurrent greedy chats through the
    openai client get, streamed and not, the text generate gives on the same quantized model."""
    model = Transformer.from_pretrained(dtype="bfloat16").quantize("int4")
    tokenizer = load_tokenizer(None)
    texts = ("Name three colours.", "What is the capital of France?")
    # (the server's attention is its default, "auto": generate runs the same)
    want = [tokenizer.decode(generate(model, chat_prompt_ids(tokenizer, t), 16, model.config.eos_token_id, "auto"),
                             skip_special_tokens=True) for t in texts]
    with ServerProcess("--quantization", "int4", "--dtype", "bfloat16", "--served-model-name", "smol-int4") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)

        def ask(text, stream=False):
            kw = dict(model="smol-int4", messages=[{"role": "user", "content": text}], max_tokens=16, temperature=0)
            if stream:
                return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True))
            return client.chat.completions.create(**kw).choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            plain = list(pool.map(ask, texts))
            streamed = list(pool.map(lambda t: ask(t, stream=True), texts))
    assert plain == want and streamed == want


def test_a_quantized_model_on_several_processes_is_refused_before_any_starts():
    model = tiny_model(seed=7, dtype=torch.float32).quantize("int8")
    for sizes in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        with pytest.raises(ValueError, match="int8 weights runs on one process"):
            LLMEngine(model, **sizes)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("nano_engine-rank")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_the_kernel_pytorchs_product_runs_and_the_engine_still_equals_generate(dtype, monkeypatch):
    """A CPU without AVX-512 (an AVX2-only EPYC): F.linear on the dequantized weights, the leaves
    each rounded and summed in the tree, as the kernel would; the tokens stay generate's."""
    import nano_engine.quantization as quantization

    monkeypatch.setattr(quantization, "chain_library", lambda dtype: None)
    model = tiny_model(seed=8, dtype=dtype, eos_token_id=63).quantize("int4")
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(5, layer.in_features).to(dtype)
    w = dequantize(layer.packed.qt)
    parts = [torch.nn.functional.linear(x[:, a:b].float(), w[:, a:b]).to(dtype)
             for a, b in zip(layer.leaves, layer.leaves[1:])]
    with torch.inference_mode():
        assert torch.equal(layer(x), Tree(0, len(parts)).sum({(i, i + 1): p.float() for i, p in enumerate(parts)}).to(dtype))
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    out = LLMEngine(model, max_num_batched_tokens=4).generate(prompts, SamplingParams(max_tokens=8))
    assert [r.output_ids for r in out] == [generate(model, p, 8) for p in prompts]

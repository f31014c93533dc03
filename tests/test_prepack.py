"""The float32 fast path (Transformer.prepack): weights packed once at load time, for our AVX-512
kernel where the CPU has it, else for oneDNN
(our kernels, bfloat16 on AMX and float32 on AVX-512: tests/test_linear_kernels.py).

It is a setting; the plain path stays the reference. What it must keep: every row gets the bits
it gets alone (the engine's identity rests on it), the same greedy tokens as the plain path, and
no stale weights when the model changes under it.
"""

import pytest
import torch

from nano_engine import mini_llm
from nano_engine.kernels import linear as linear_module
from nano_engine.lab.experiments import CHAT_PROMPTS, identity_check
from nano_engine.models.loading import chat_prompt_ids, load_tokenizer
from nano_engine.mini_llm import PackedLeaves, PackedWeight, Transformer, generate, linear
from nano_engine.tiny import tiny_model


@pytest.fixture(scope="module")
def embedded():
    return Transformer.from_pretrained(prepack=True)


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer()
    return [chat_prompt_ids(tok, text) for text in CHAT_PROMPTS]


# The embedded model's matmuls (q/k/v fused, o, gate/up fused, down, the head) and Qwen3-0.6B's.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (4096, 1024), (1024, 2048)]


@pytest.mark.parametrize("shape", SHAPES)
def test_packed_linear_gives_each_row_the_same_bits_in_any_batch(shape):
    """From 2 rows to 520, a row gets the bits it gets in a pair: one kernel for every batch.
    A row alone may take oneDNN's one-row path, and whether that rounds alike depends on the CPU:
    on an AVX2-only EPYC it did for every shape; on an AVX-512 EPYC (2026-12-02) it differs in
    the last bits where the inner dimension is 1536 or more (the down projection, Qwen3's).
    So alone it must agree to float32 rounding, and the engine's identity is checked on tokens."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=gen)
    x = torch.randn(520, shape[1], generator=gen)
    packed = PackedWeight(w)
    pairs = torch.cat([linear(x[i:i + 2], w, packed=packed)[:1] for i in range(48)])
    for rows in (2, 3, 16, 17, 33, 48, 100, 520):
        assert torch.equal(linear(x[:rows], w, packed=packed)[:48], pairs[:rows]), rows
    tail = torch.cat([linear(x[i:i + 2], w, packed=packed)[:1] for i in range(500, 519)])
    assert torch.equal(linear(x, w, packed=packed)[500:519], tail)
    alone = torch.cat([linear(x[i:i + 1], w, packed=packed) for i in range(48)])
    assert torch.allclose(alone, pairs, rtol=1e-5, atol=1e-3)
    # The same products as the plain call, to float32 rounding.
    assert torch.allclose(linear(x[:64], w, packed=packed), torch.nn.functional.linear(x[:64], w),
                          rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("fused", [False, True])
def test_every_matmul_reads_a_packed_weight_and_the_tokens_stay(fused, monkeypatch):
    model = tiny_model(seed=1, dtype=torch.float32)
    if fused:
        model.fuse()
    plain = generate(model, [5, 6, 7, 8], 12)
    assert model.prepack() is model and model.prepacked
    calls = []
    real = mini_llm.linear

    def spy(x, weight, bias=None, packed=None):
        calls.append(packed is not None and packed.matches(weight))
        return real(x, weight, bias, packed)

    one_calls = []  # o and down with all their leaves in one kernel call (where the kernel has it)
    real_leaves = PackedLeaves.gemm

    def spy_leaves(self, x):
        y = real_leaves(self, x)
        one_calls.append(y is not None)
        return y

    monkeypatch.setattr(mini_llm, "linear", spy)
    monkeypatch.setattr(PackedLeaves, "gemm", spy_leaves)
    with torch.inference_mode():
        model.compute_logits(model(torch.tensor([3, 4, 5]), torch.arange(3)))
    # q, k, v, gate, up in each layer (q/k/v and gate/up one each when fused), the head; o and down
    # (mini_llm.Linear) in one call each, or one per leaf where the kernel takes one leaf at a time
    block, layers = model.model.layers[0], model.config.num_hidden_layers
    leaves = sum(len(m.leaves) - 1 for m in (block.self_attn.o_proj, block.mlp.down_proj))
    assert len(one_calls) == 2 * layers and len(set(one_calls)) == 1
    per_leaf = 0 if one_calls[0] else leaves * layers
    assert len(calls) == (2 if fused else 5) * layers + 1 + per_leaf and all(calls)
    assert generate(model, [5, 6, 7, 8], 12) == plain
    monkeypatch.undo()
    assert model.unpack() is model and not model.prepacked  # back to the plain path
    assert generate(model, [5, 6, 7, 8], 12) == plain


def test_packed_and_plain_give_the_same_greedy_tokens(embedded, prompts):
    plain = Transformer.from_pretrained()
    assert not plain.prepacked
    for ids in prompts[:3]:
        assert generate(embedded, ids, 16) == generate(plain, ids, 16)


def test_the_engine_on_packed_weights_equals_generate_on_them(embedded, prompts):
    """generate decodes one row at a time, the engine many: the same tokens mean every row got the
    bits it gets alone (on some CPUs the plain float32 path's one-row kernel rounds differently)."""
    result = identity_check(embedded, prompts, max_tokens=16)
    assert [r.identical for r in result.rows] == [True] * len(result.rows)
    assert embedded.prepacked  # the engine did not drop or replace them


def test_a_changed_weight_is_never_read_from_a_stale_pack():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(24, 16, generator=gen), torch.randn(3, 16, generator=gen)
    packed = PackedWeight(w)
    assert linear(x, w[:12], packed=packed).shape == (3, 12)  # another view of the same storage
    w.mul_(2)  # in place: same storage and shape, a new version
    assert torch.allclose(linear(x, w, packed=packed), x @ w.T, rtol=1e-5, atol=1e-5)  # the stale one is not read
    model = tiny_model(seed=2, dtype=torch.float32).prepack()
    x = torch.tensor([1, 2, 3])
    with torch.inference_mode():
        model.lm_head.weight.mul_(2.0)  # one stale site is enough
        assert not model.prepacked
        hidden = model(x, torch.arange(3))
        assert torch.equal(model.compute_logits(hidden), linear(hidden, model.lm_head.weight))  # the plain path
    model.prepack()
    assert model.prepacked
    model.to(torch.float64)  # new storage: the packs are stale, the plain float64 path runs
    assert not model.prepacked
    assert model(x, torch.arange(3)).dtype == torch.float64


def test_prepack_refuses_dtypes_without_a_kernel_non_flags_and_a_torch_without_onednn(monkeypatch):
    with pytest.raises(ValueError, match="float16"):
        tiny_model(dtype=torch.float16).prepack()
    with pytest.raises(TypeError, match="prepack='yes'"):
        Transformer.from_pretrained(prepack="yes")
    with pytest.raises(ValueError, match="prepack=True .*float16"):
        Transformer.from_pretrained(dtype="float16", prepack=True)
    monkeypatch.setattr(linear_module, "ONEDNN_FP32", False)
    monkeypatch.setattr(linear_module, "f32_library", lambda: None)  # neither oneDNN nor AVX-512
    model = tiny_model(dtype=torch.float32)
    with pytest.raises(ValueError, match="float32 .*AVX-512 or PyTorch's oneDNN"):
        model.prepack()
    assert not model.prepacked

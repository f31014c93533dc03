"""bfloat16 on AMX (kernels/csrc/gemm_amx.cpp, through Transformer.prepack): a row gets the same bits
at every row count, thread count and position in the batch, the products are the matmul's, and the
engine on packed bfloat16 weights equals `generate` on them. On a CPU without AMX, prepack refuses
a bfloat16 model, naming what is missing, and the plain path runs."""

import pytest
import torch

from nano_engine.kernels import linear as linear_module
from nano_engine.kernels.linear import PackedWeight, can_prepack, linear
from nano_engine.lab.experiments import CHAT_PROMPTS, identity_check
from nano_engine.mini_llm import Transformer, generate
from nano_engine.models.loading import chat_prompt_ids, load_tokenizer
from nano_engine.tiny import tiny_model

AMX = can_prepack(torch.bfloat16)
# The embedded model's matmuls (q/k/v fused, o, gate/up fused, down, the head), Qwen3-0.6B's, and
# shapes whose N and K are not multiples of the 32 the kernel packs by.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (4096, 1024), (1024, 2048),
          (100, 70), (33, 31)]
ROWS = (1, 2, 15, 16, 17, 32, 33, 64, 100, 512, 600)


def _refused(dtype):
    with pytest.raises(ValueError, match="AMX"):
        PackedWeight(torch.ones(4, 4, dtype=dtype))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_gets_the_same_bits_at_every_row_count(shape, threads):
    if not AMX:
        return _refused(torch.bfloat16)
    gen = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(*shape, generator=gen) * 0.05).bfloat16()
    x = torch.randn(700, shape[1], generator=gen).bfloat16()
    packed = PackedWeight(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = [0, 1, 14, 15, 16, 31, 32, 63, 99, 299, 599]  # where each row sits in a batch
        alone = torch.cat([linear(x[r:r + 1], w, packed=packed) for r in rows])
        for m in ROWS:
            for start in (0, 3):  # the rows at other positions of the batch
                y = linear(x[start:start + m], w, packed=packed)
                for i, r in enumerate(rows):
                    if start <= r < start + m:
                        assert torch.equal(y[r - start], alone[i]), (m, start, r)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(960, 576), (100, 70)])
def test_the_products_are_the_matmul_rounded_once(shape):
    """Each output is the float32 sum of bfloat16 products, plus the bias, rounded once to bfloat16:
    within one bfloat16 rounding (and float32's summation order) of the exact matmul."""
    if not AMX:
        return _refused(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(*shape, generator=gen) * 0.05).bfloat16()
    x = torch.randn(40, shape[1], generator=gen).bfloat16()
    bias = torch.randn(shape[0], generator=gen).bfloat16()
    for b in (None, bias):
        exact = x.double() @ w.double().T + (0 if b is None else b.double())
        got = linear(x, w, b, packed=PackedWeight(w))
        assert got.dtype == torch.bfloat16 and got.shape == (40, shape[0])
        assert torch.allclose(got.double(), exact, rtol=2 ** -8, atol=1e-4)
    strided = x[::2]  # rows that are not contiguous in memory
    assert torch.equal(linear(strided, w, packed=PackedWeight(w)), linear(strided.contiguous(), w, packed=PackedWeight(w)))


def test_a_bfloat16_model_prepacks_where_the_cpu_has_amx_and_refuses_elsewhere(monkeypatch):
    model = tiny_model(seed=3, dtype=torch.bfloat16)
    ids, positions = torch.tensor([5, 6, 7, 8]), torch.arange(4)
    plain = generate(model, [5, 6, 7, 8], 12)
    if AMX:
        with torch.inference_mode():
            plain_logits = model.compute_logits(model(ids, positions)).float()
            assert model.prepack().prepacked
            packed_logits = model.compute_logits(model(ids, positions)).float()
        # The same model on another kernel: other roundings, the same logits to bfloat16 precision.
        assert torch.allclose(packed_logits, plain_logits, rtol=0.05, atol=0.05)
        model.unpack()
        assert generate(model, [5, 6, 7, 8], 12) == plain  # unpack brings the plain path back
    monkeypatch.setattr(linear_module, "amx_library", lambda: None)  # a CPU without AMX
    with pytest.raises(ValueError, match="bfloat16 .*AMX"):
        model.prepack()
    assert not model.prepacked
    with pytest.raises(ValueError, match="bfloat16 .*AMX"):
        Transformer.from_pretrained(dtype="bf16", prepack=True)
    with pytest.raises(ValueError, match="float16"):
        tiny_model(seed=3, dtype=torch.float16).prepack()


def test_the_engine_on_packed_bfloat16_weights_equals_generate_on_them():
    """generate runs one row at a time, the engine chunks and decode batches under every setting of
    the identity check: the same tokens for every chat prompt, in bfloat16, on the AMX kernel."""
    if not AMX:
        return _refused(torch.bfloat16)
    model = Transformer.from_pretrained(dtype=torch.bfloat16, prepack=True)
    tok = load_tokenizer()
    prompts = [chat_prompt_ids(tok, text) for text in CHAT_PROMPTS]
    for backend in ("torch", "c"):  # every scheduling setting of the identity check, both attentions
        result = identity_check(model, prompts, max_tokens=16, attention_backend=backend)
        assert [r.identical for r in result.rows] == [True] * len(result.rows), backend
    assert model.prepacked

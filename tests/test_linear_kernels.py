"""Our matmul kernels behind Transformer.prepack: bfloat16 on AMX (kernels/csrc/gemm_amx.cpp) or,
without AMX, on AVX512_BF16 (gemm_f32.cpp's bfloat16 twin), and float32 on AVX-512 (kernels/csrc/gemm_f32.cpp).
A row gets the same bits at every row count, thread count and position in the batch, the products
are the matmul's, and the engine on packed weights equals `generate` on them. On a CPU without
AVX-512, prepack refuses a bfloat16 model (without AVX512_BF16 and AMX), naming what is missing,
and float32 prepacks for oneDNN instead. Where the CPU has AMX, the AVX-512 bfloat16 kernel is
tested too (forced)."""

import pytest
import torch

from nano_engine import LLMEngine, SamplingParams
from nano_engine.kernels import linear as linear_module
from nano_engine.kernels.linear import PackedWeight, can_prepack, linear
from nano_engine.lab.experiments import CHAT_PROMPTS, identity_check
from nano_engine.mini_llm import Transformer, generate
from nano_engine.models.loading import chat_prompt_ids, load_tokenizer
from nano_engine.tiny import tiny_model

AMX = linear_module.amx_library() is not None
AVX512 = linear_module.f32_library() is not None
BF16_DOT = linear_module.bf16_dot_library() is not None
OURS = {torch.bfloat16: can_prepack(torch.bfloat16), torch.float32: AVX512}  # which dtypes run a kernel of ours here
# Every kernel of ours this CPU runs, by dtype (the AVX-512 bfloat16 one also where AMX is preferred).
KINDS = [(torch.bfloat16, k) for k, ok in (("amx", AMX), ("bf16_dot", BF16_DOT)) if ok] + [(torch.float32, "f32")]
# The embedded model's matmuls (q/k/v fused, o, gate/up fused, down, the head), Qwen3-0.6B's, and
# shapes whose N and K are not multiples of the 32 the kernel packs by.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (4096, 1024), (1024, 2048),
          (100, 70), (33, 31)]
ROWS = (1, 2, 15, 16, 17, 32, 33, 64, 100, 512, 600)


def _not_ours(dtype):
    """Where this CPU lacks the instructions: bfloat16 is refused, float32 packs for oneDNN."""
    if dtype == torch.bfloat16:
        with pytest.raises(ValueError, match="bfloat16 .*AVX512_BF16"):
            PackedWeight(torch.ones(4, 4, dtype=dtype))
    else:
        assert not PackedWeight(torch.ones(4, 4)).own


@pytest.fixture
def force_kind(monkeypatch):
    """force_kind(kind): PackedWeight packs for that kernel of ours from now on in this test."""
    return lambda kind: monkeypatch.setattr(linear_module, "packed_kind", lambda dtype: kind)


@pytest.mark.parametrize("dtype,kind", KINDS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_gets_the_same_bits_at_every_row_count(shape, threads, dtype, kind, force_kind):
    if not OURS[dtype]:
        return _not_ours(dtype)
    force_kind(kind)
    gen = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(*shape, generator=gen) * 0.05).to(dtype)
    x = torch.randn(700, shape[1], generator=gen).to(dtype)
    packed = PackedWeight(w)
    assert packed.own and packed.kind == kind
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = [0, 1, 14, 15, 16, 31, 32, 63, 99, 299, 599]  # where each row sits in a batch
        bias = torch.randn(shape[0], generator=gen).to(dtype)
        alone = torch.cat([linear(x[r:r + 1], w, bias, packed=packed) for r in rows])
        for m in ROWS:
            for start in (0, 3):  # the rows at other positions of the batch
                y = linear(x[start:start + m], w, bias, packed=packed)
                for i, r in enumerate(rows):
                    if start <= r < start + m:
                        assert torch.equal(y[r - start], alone[i]), (m, start, r)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(960, 576), (100, 70)])
def test_the_float32_products_are_the_matmul(shape):
    """Each output is one chain of float32 fused multiply-adds, then the bias: within float32
    rounding of the exact matmul."""
    if not AVX512:
        return _not_ours(torch.float32)
    gen = torch.Generator().manual_seed(2)
    w, x, bias = torch.randn(*shape, generator=gen) * 0.05, torch.randn(40, shape[1], generator=gen), torch.randn(shape[0], generator=gen)
    for b in (None, bias):
        exact = x.double() @ w.double().T + (0 if b is None else b.double())
        got = linear(x, w, b, packed=PackedWeight(w))
        assert got.dtype == torch.float32 and got.shape == (40, shape[0])
        assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)
    strided = x[::2]
    assert torch.equal(linear(strided, w, packed=PackedWeight(w)), linear(strided.contiguous(), w, packed=PackedWeight(w)))


@pytest.mark.parametrize("kind", [k for _, k in KINDS[:-1]] or ["amx"])
@pytest.mark.parametrize("shape", [(960, 576), (100, 70)])
def test_the_products_are_the_matmul_rounded_once(shape, kind, force_kind):
    """Each output is the float32 sum of bfloat16 products, plus the bias, rounded once to bfloat16:
    within one bfloat16 rounding (and float32's summation order) of the exact matmul."""
    if not OURS[torch.bfloat16]:
        return _not_ours(torch.bfloat16)
    force_kind(kind)
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
    shifted = torch.cat((x, x[:, :1]), 1)[:, 1:]  # rows at an odd address, one element apart from a pair
    assert torch.equal(linear(shifted, w, packed=PackedWeight(w)), linear(shifted.contiguous(), w, packed=PackedWeight(w)))


def dot_chain(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What gemm_bf16_dot computes, in PyTorch: per output one float32 chain over K in pairs, each
    vdpbf16ps adding x[k + 1] w[k + 1], then x[k] w[k] (the products of bfloat16 numbers are exact in
    float32), the bias, then one rounding to bfloat16."""
    xf, wf = x.float(), w.float()
    if x.shape[1] % 2:
        xf, wf = torch.nn.functional.pad(xf, (0, 1)), torch.nn.functional.pad(wf, (0, 1))
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(0, xf.shape[1], 2):
        acc = acc + xf[:, k + 1:k + 2] * wf[:, k + 1]
        acc = acc + xf[:, k:k + 1] * wf[:, k]
    return (acc if bias is None else acc + bias.float()).bfloat16()


@pytest.mark.parametrize("shape", [(576, 1536), (33, 31), (100, 71)])
def test_the_avx512_bfloat16_kernel_is_one_chain_of_pairs_rounded_once(shape, force_kind):
    """gemm_bf16_dot's outputs are `dot_chain`'s to the last bit (odd K too, and sums that overflow
    to infinity); a NaN stays a NaN (its payload is nobody's concern)."""
    if not BF16_DOT:
        return _not_ours(torch.bfloat16) if not OURS[torch.bfloat16] else None
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(*shape, generator=gen) * 0.05).bfloat16()
    x = torch.randn(37, shape[1], generator=gen).bfloat16()
    bias = torch.randn(shape[0], generator=gen).bfloat16()
    x[0, :2], w[:, :2] = 3e38, 2.0  # a row whose sums overflow
    x[1, 2] = float("nan")  # and one of NaNs
    force_kind("bf16_dot")
    packed = PackedWeight(w)
    for b in (None, bias):
        want = dot_chain(x, w, b)
        got = linear(x, w, b, packed=packed)
        assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any() and got.isinf().any()
        assert torch.equal(got.nan_to_num(0).view(torch.int16), want.nan_to_num(0).view(torch.int16))


def test_a_bfloat16_model_prepacks_where_the_cpu_has_avx512_and_refuses_elsewhere(monkeypatch):
    model = tiny_model(seed=3, dtype=torch.bfloat16)
    ids, positions = torch.tensor([5, 6, 7, 8]), torch.arange(4)
    plain = generate(model, [5, 6, 7, 8], 12)
    if OURS[torch.bfloat16]:
        with torch.inference_mode():
            plain_logits = model.compute_logits(model(ids, positions)).float()
            assert model.prepack().prepacked
            packed_logits = model.compute_logits(model(ids, positions)).float()
        # The same model on another kernel: other roundings, the same logits to bfloat16 precision.
        assert torch.allclose(packed_logits, plain_logits, rtol=0.05, atol=0.05)
        model.unpack()
        assert generate(model, [5, 6, 7, 8], 12) == plain  # unpack brings the plain path back
    monkeypatch.setattr(linear_module, "amx_library", lambda: None)  # a CPU without AMX or AVX-512
    monkeypatch.setattr(linear_module, "bf16_dot_library", lambda: None)
    with pytest.raises(ValueError, match="bfloat16 .*AVX512_BF16"):
        model.prepack()
    assert not model.prepacked
    with pytest.raises(ValueError, match="bfloat16 .*AVX512_BF16"):
        Transformer.from_pretrained(dtype="bf16", prepack=True)
    with pytest.raises(ValueError, match="float16"):
        tiny_model(seed=3, dtype=torch.float16).prepack()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_engine_on_packed_weights_equals_generate_on_them(dtype):
    """generate runs one row at a time, the engine chunks and decode batches under every setting of
    the identity check: the same tokens for every chat prompt, on our kernel."""
    if not OURS[dtype]:
        return _not_ours(dtype)
    model = Transformer.from_pretrained(dtype=dtype, prepack=True)
    tok = load_tokenizer()
    prompts = [chat_prompt_ids(tok, text) for text in CHAT_PROMPTS]
    for backend in ("torch", "c"):  # every scheduling setting of the identity check, both attentions
        result = identity_check(model, prompts, max_tokens=16, attention_backend=backend)
        assert [r.identical for r in result.rows] == [True] * len(result.rows), backend
    assert model.prepacked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_logprobs_keep_every_bit_under_any_scheduling(dtype):
    """With our matmul kernels and the C attention every operation of a row is computed the same way
    in any batch, so the logprob of each token, not only the token, is the same to the last bit
    whether a prompt comes whole or in chunks of 7, alone or among others, preempted or not."""
    if not OURS[dtype]:
        return _not_ours(dtype)
    model = Transformer.from_pretrained(dtype=dtype, prepack=True)
    tok = load_tokenizer()
    prompts = [chat_prompt_ids(tok, text) for text in CHAT_PROMPTS]
    settings = [{}, {"max_num_batched_tokens": 7}, {"max_num_batched_tokens": 64, "num_blocks": 10},
                {"block_size": 1, "max_num_seqs": 2}]
    seen = []
    for cfg in settings:
        engine = LLMEngine(model, attention_backend="c", **cfg)
        done = engine.generate(prompts, SamplingParams(max_tokens=24, logprobs=2))
        seen.append([(r.output_ids, [(lp.logprob, lp.top_logprobs) for lp in r.logprobs]) for r in done])
        if cfg.get("num_blocks") == 10:
            assert engine.stats.preemptions > 0
    assert all(s == seen[0] for s in seen[1:])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_float64_output_has_the_same_bits_in_any_call(threads):
    """float64 (the tiny models): a row's outputs and a column's, whatever rows and columns share the
    call, where they sit, and the threads (tensor parallelism cuts the columns between ranks)."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((9, 70), (101, 70), (101,)))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = linear(x, w, b)
        for rows, cols in ((slice(0, 1), slice(0, 101)), (slice(2, 9), slice(37, 101)), (slice(3, 6), slice(5, 6))):
            assert torch.equal(linear(x[rows], w[cols], b[cols]), whole[rows, cols])
    finally:
        torch.set_num_threads(old)
    assert torch.allclose(whole, x @ w.T + b, rtol=1e-13, atol=1e-13)

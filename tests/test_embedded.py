"""The embedded SmolLM2-135M-Instruct: logits against transformers' own GGUF load, and the
scheduler chapter's identity check (three configs, token for token)."""

import pytest
import torch
import transformers

from nano_engine import Transformer
from nano_engine.lab.experiments import CHAT_PROMPTS, identity_check
from nano_engine.models.loading import chat_prompt_ids, embedded_model_path, load_tokenizer


@pytest.fixture(scope="module")
def model():
    return Transformer.from_pretrained()


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer()
    return [chat_prompt_ids(tok, text) for text in CHAT_PROMPTS]


def test_logits_match_transformers_gguf_load(model, prompts):
    path = embedded_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    ids = torch.tensor(prompts[0])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = model.compute_logits(model(ids, torch.arange(len(ids))))
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-3), (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_identity_check_three_configs(model, prompts):
    result = identity_check(model, prompts, max_tokens=24)
    assert [r.identical for r in result.rows] == [True, True, True]
    rows = {r.name: r for r in result.rows}
    assert rows["budget 64, 10 blocks"].preemptions >= 1
    assert rows["budget 32"].steps > rows["defaults"].steps
    # 32 tokens per step cannot hold 6 prompts of 37-40 tokens: the budget forced chunks.
    log = result.engines["budget 32"].step_log
    assert any(rec.num_prefill_tokens and rec.num_prefill_tokens < rec.num_tokens for rec in log)


def test_identity_check_in_bfloat16(prompts):
    """bfloat16 keeps the identity too, against generate in bfloat16: every kernel the engine
    batches gives each request the bits it gets alone (see mini_llm.linear and attention)."""
    bf16 = Transformer.from_pretrained(dtype="bf16")  # a name works as well as torch.bfloat16
    result = identity_check(bf16, prompts, max_tokens=24)
    assert [r.identical for r in result.rows] == [True, True, True]


def test_the_embedded_model_gives_the_same_tokens_with_the_attention_kernel(prompts):
    """attention_backend="c" (nano_engine/kernels/paged_attention.py) against generate with it, in both dtypes."""
    for dtype in (torch.bfloat16, torch.float32):
        model = Transformer.from_pretrained(dtype=dtype)
        result = identity_check(model, prompts, max_tokens=16, attention_backend="c")
        assert [r.identical for r in result.rows] == [True] * len(result.rows), dtype
        assert all(e.runner.attention_backend == "c" for e in result.engines.values())

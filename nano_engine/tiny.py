"""Tiny random models for the tests, the judge and quick notebook demos: the real code path in
milliseconds. Float64 by default, so that exact token identity never hinges on rounding."""

from __future__ import annotations

import copy

import torch

from . import checks
from .mini_llm import ModelConfig, Transformer
from .request import SEED_MAX, SEED_MIN


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float64, vocab_size: int = 64,
               num_layers: int = 2, qk_norm: bool = False, eos_token_id: int = 0, num_attention_heads: int = 4,
               num_key_value_heads: int = 2, intermediate_size: int = 64) -> Transformer:
    """A 2-layer Llama-style model (Qwen3-style with qk_norm) with random weights."""
    seed = checks.integer("seed", seed, minimum=SEED_MIN, maximum=SEED_MAX)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype={dtype!r} must be a floating-point torch.dtype, e.g. torch.float64")
    vocab_size = checks.integer("vocab_size", vocab_size, minimum=2)
    num_layers = checks.integer("num_layers", num_layers, minimum=1)
    qk_norm = checks.flag("qk_norm", qk_norm)
    eos_token_id = checks.integer("eos_token_id", eos_token_id, minimum=0, maximum=vocab_size - 1)
    num_key_value_heads = checks.integer("num_key_value_heads", num_key_value_heads, minimum=1)
    num_attention_heads = checks.integer("num_attention_heads", num_attention_heads, minimum=1)
    if num_attention_heads % num_key_value_heads:
        raise ValueError(f"num_attention_heads={num_attention_heads} is not a multiple of "
                         f"num_key_value_heads={num_key_value_heads}")
    intermediate_size = checks.integer("intermediate_size", intermediate_size, minimum=1)
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=intermediate_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_attention_heads,
                      num_key_value_heads=num_key_value_heads,
                      head_dim=8, qk_norm=qk_norm, eos_token_id=eos_token_id,
                      max_position_embeddings=4096, model_type="qwen3" if qk_norm else "llama")
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            # Larger than nn.Linear's default init, so that greedy outputs vary from token to token.
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.to(dtype).eval()


def perturbed(model: Transformer, scale: float, seed: int = 0) -> Transformer:
    """A copy of `model` with Gaussian noise of standard deviation `scale` added to every weight:
    a draft model that agrees with it often but not always (speculative decoding's tests and 8.2)."""
    seed = checks.integer("seed", seed, minimum=SEED_MIN, maximum=SEED_MAX)
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * scale)
    return draft

"""Mutant of exercise 135: top-p always runs, vectorized in the logits' float32, so at top_p = 1 a
cumulative sum that rounds to 1.0 drops the tokens of tiny probability after it."""

from pathlib import Path

import torch

_MODEL = Path(__file__).with_name("model_135.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "top_p = 1 turns top-p off"

_model_filter = filter_logits


def filter_logits(logits, top_k, top_p, min_p=0.0):  # noqa: F811
    out = _model_filter(logits, top_k, 1.0, min_p)
    sorted_logits, order = torch.sort(out.float(), descending=True, stable=True)
    probs = sorted_logits.softmax(-1)
    drop = (probs.cumsum(-1) - probs) >= top_p  # MUTANT: no `if top_p < 1`: 0.99999999 rounds to 1.0 >= 1.0
    drop[0] = False
    return out.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), NEG_INF)

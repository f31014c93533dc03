"""Mutant of exercise 135: min-p runs after top-k and top-p, so top-p adds up probabilities min-p would have dropped."""

from pathlib import Path

import torch

_MODEL = Path(__file__).with_name("model_135.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "the order is min-p, then top-k, then top-p"

_model_filter = filter_logits


def filter_logits(logits, top_k, top_p, min_p=0.0):  # noqa: F811
    out = _model_filter(logits, top_k, top_p, 0.0)
    if min_p > 0:  # MUTANT: last instead of first
        probs = torch.softmax(out.double(), -1)
        out[probs < min_p * probs.max()] = NEG_INF
    return out

"""Mutant of exercise 135: min-p compares each probability with min_p itself, not with min_p x the top probability."""

from pathlib import Path

import torch

_MODEL = Path(__file__).with_name("model_135.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "below min_p x the LARGEST probability"

_model_filter = filter_logits


def filter_logits(logits, top_k, top_p, min_p=0.0):  # noqa: F811
    out = logits.clone()
    if min_p > 0:
        probs = torch.softmax(out.double(), -1)
        out[probs < min_p] = NEG_INF  # MUTANT: absolute threshold
    return _model_filter(out, top_k, top_p, 0.0)

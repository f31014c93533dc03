"""Mutant of exercise 135: the distribution keeps every probability at least 1e-12 (to keep multinomial
and log safe), so a dropped token can still be drawn; within 1e-6 of the right probabilities."""

from pathlib import Path

import torch

_MODEL = Path(__file__).with_name("model_135.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "all the probability on it"

_model_distribution = distribution


def distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):  # noqa: F811
    probs = _model_distribution(logits, temperature, top_k, top_p, min_p).clamp_min(1e-12)  # MUTANT
    return probs / probs.sum()

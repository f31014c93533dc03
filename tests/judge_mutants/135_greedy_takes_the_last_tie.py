"""Mutant of exercise 135: greedy puts the probability on the last of the tied largest logits."""

from pathlib import Path

import torch

_MODEL = Path(__file__).with_name("model_135.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "the first one if several tie"


def distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):  # noqa: F811
    if temperature < 1e-5:
        probs = torch.zeros(len(logits))
        values = logits.tolist()
        probs[len(values) - 1 - values[::-1].index(max(values))] = 1.0  # MUTANT: the last maximum
        return probs
    return torch.softmax(filter_logits(logits.double() / temperature, top_k, top_p, min_p), -1)

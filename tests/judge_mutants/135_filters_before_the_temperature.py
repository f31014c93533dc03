"""Mutant of exercise 135: the filters see the raw logits; the temperature is applied after them."""

from pathlib import Path

import torch

_MODEL = Path(__file__).with_name("model_135.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "divide by the temperature first"


def distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):  # noqa: F811
    if temperature < 1e-5:
        probs = torch.zeros(len(logits))
        probs[int(torch.argmax(logits))] = 1.0
        return probs
    return torch.softmax(filter_logits(logits.double(), top_k, top_p, min_p) / temperature, -1)  # MUTANT

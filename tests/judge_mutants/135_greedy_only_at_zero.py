"""Mutant of exercise 135: only temperature == 0 is greedy; a temperature of 1e-6 divides the logits."""

from pathlib import Path

import torch

_MODEL = Path(__file__).with_name("model_135.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "below 1e-5 (SAMPLING_EPS) are greedy too"


def distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):  # noqa: F811
    if temperature == 0:  # MUTANT: not temperature < 1e-5
        probs = torch.zeros(len(logits))
        probs[int(torch.argmax(logits))] = 1.0
        return probs
    return torch.softmax(filter_logits(logits.double() / temperature, top_k, top_p, min_p), -1)

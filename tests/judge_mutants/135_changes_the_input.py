"""Mutant of exercise 135: the filters write -inf into the tensor they are given."""

from pathlib import Path

import torch

_MODEL = Path(__file__).with_name("model_135.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "do not change the logits you are given"

_model_filter = filter_logits


def filter_logits(logits, top_k, top_p, min_p=0.0):  # noqa: F811
    out = _model_filter(logits, top_k, top_p, min_p)
    logits.copy_(out)  # MUTANT: the caller's tensor is overwritten
    return logits

"""Argument checks for the public surface: strict, early, and named.

Every public entry (SamplingParams, EngineConfig, LLMEngine.add_request, ...) checks its arguments
when it is called, so that a wrong value fails at once with a message naming the field, the value
and what is allowed, instead of deep inside torch several steps later. The rules:

- a `bool` is not a number (`max_tokens=True` is a mistake, not 1), and a number is not a flag
  (`enable_prefix_caching="no"` would otherwise mean *on*);
- integers may be Python ints or NumPy / torch integer scalars (anything with `__index__`);
- real numbers must be finite (NaN compares false with every bound, so it would slip through);
- a wrong type raises TypeError, a value out of range raises ValueError.

vLLM does the same in `vllm/sampling_params.py` (SamplingParams._verify_args) and in
`vllm/config/` (pydantic dataclasses that validate on construction).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Iterable

import numpy as np
import torch


def _type_name(value: Any) -> str:
    return type(value).__name__


def integer(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as a Python int, refusing bools, floats and strings; ValueError outside [minimum, maximum]."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name}={value!r} must be an integer, not a bool")
    if isinstance(value, torch.Tensor) and (value.ndim != 0 or value.is_floating_point()):
        raise TypeError(f"{name}={value!r} must be an integer, got a tensor of shape "
                        f"{tuple(value.shape)} and dtype {value.dtype}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} must be an integer, got {_type_name(value)}") from None
    _check_range(name, v, minimum, maximum)
    return v


def number(name: str, value: Any, minimum: float | None = None, maximum: float | None = None,
           exclusive_minimum: bool = False) -> float:
    """`value` as a finite float, refusing bools and strings; ValueError outside the bounds."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        kind = "a bool" if isinstance(value, (bool, np.bool_)) else _type_name(value)
        raise TypeError(f"{name}={value!r} must be a real number, got {kind}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if exclusive_minimum and minimum is not None and v <= minimum:
        raise ValueError(f"{name}={value!r} must be > {minimum}")
    _check_range(name, v, None if exclusive_minimum else minimum, maximum)
    return v


def flag(name: str, value: Any) -> bool:
    """`value` as a bool; only True and False (or NumPy's) are flags."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be True or False, got {_type_name(value)}")
    return bool(value)


def choice(name: str, value: Any, allowed: Iterable[Any]) -> Any:
    allowed = tuple(allowed)
    if not isinstance(value, type(allowed[0])) or value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}")
    return value


def token_ids(name: str, value: Any, vocab_size: int | None = None) -> list[int]:
    """A list of ints from a sequence, or a 1-D integer tensor or array, checked against the vocabulary."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name} must be a sequence of token ids (ints) or a 1-D integer tensor, "
                        f"got {_type_name(value)}")
    if isinstance(value, (torch.Tensor, np.ndarray)):
        is_int = (not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
                  if isinstance(value, torch.Tensor) else np.issubdtype(value.dtype, np.integer))
        if value.ndim != 1 or not is_int:
            raise TypeError(f"{name} must be a 1-D integer tensor or array, got shape {tuple(value.shape)} "
                            f"and dtype {value.dtype}")
        ids = [int(t) for t in value.tolist()]
    else:
        try:
            items = list(value)
        except TypeError:
            raise TypeError(f"{name} must be a sequence of token ids (ints) or a 1-D integer tensor, "
                            f"got {_type_name(value)}") from None
        ids = [integer(f"{name}[{i}]", t) for i, t in enumerate(items)]
    if vocab_size is not None:
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise ValueError(f"{name}[{i}]={t} is outside the vocabulary [0, {vocab_size})")
    return ids


def _check_range(name: str, v: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and maximum is not None and not minimum <= v <= maximum:
        raise ValueError(f"{name}={v!r} must be in [{minimum}, {maximum}]")
    if minimum is not None and v < minimum:
        raise ValueError(f"{name}={v!r} must be >= {minimum}")
    if maximum is not None and v > maximum:
        raise ValueError(f"{name}={v!r} must be <= {maximum}")

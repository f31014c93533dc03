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
import os
from typing import Any, Iterable, Sequence

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
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        raise ValueError(f"{name}={value!r} must be an integer {_allowed(minimum, maximum)}")
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
    below = minimum is not None and (v <= minimum if exclusive_minimum else v < minimum)
    if below or (maximum is not None and v > maximum):
        raise ValueError(f"{name}={value!r} must be a number {_allowed(minimum, maximum, exclusive_minimum)}")
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


def instance(name: str, value: Any, cls: type | tuple[type, ...], allowed: str) -> Any:
    """`value` if it is an instance of `cls`; else TypeError saying what is `allowed`."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {allowed}, got {_type_name(value)}")
    return value


def request_id(value: Any) -> str:
    """A request id: a non-empty str (vLLM's ids are strings; an int is refused, not converted)."""
    if not isinstance(value, str):
        raise TypeError(f"request_id={value!r} must be a str (request ids are strings, as in vLLM), "
                        f"got {_type_name(value)}")
    if not value:
        raise ValueError("request_id='' must be a non-empty string")
    return value


def cache_salt(value: Any) -> str | None:
    """A prefix-cache salt: None or a non-empty str (vLLM's cache_salt)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"cache_salt={value!r} must be a str or None, got {_type_name(value)}")
    if not value:
        raise ValueError("cache_salt='' must be a non-empty string (or None: no salt)")
    return value


def prompt_batch(prompts: Any, sampling_params: Any, params_cls: type) -> list:
    """Check generate()'s arguments; returns one sampling params (or None) per prompt."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, torch.Tensor, np.ndarray)):
        raise TypeError(f"prompts must be a list of prompts (each a list of token ids or a 1-D integer "
                        f"tensor), got {_type_name(prompts)}")
    if isinstance(prompts, (torch.Tensor, np.ndarray)) and prompts.ndim != 2:
        raise TypeError(f"prompts as a tensor must be 2-D (one prompt per row), got shape {tuple(prompts.shape)}")
    if len(prompts) and all(isinstance(p, (int, np.integer)) for p in prompts):
        raise TypeError("prompts must be a list of prompts, got a list of ints: for one prompt, pass [prompt_ids]")
    if sampling_params is None or isinstance(sampling_params, params_cls):
        return [sampling_params] * len(prompts)
    if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, (str, bytes)):
        raise TypeError(f"sampling_params must be a SamplingParams, a list of them (one per prompt) or None, "
                        f"got {_type_name(sampling_params)}")
    if len(sampling_params) != len(prompts):
        raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
    for i, sp in enumerate(sampling_params):
        if sp is not None:
            instance(f"sampling_params[{i}]", sp, params_cls, "a SamplingParams")
    return list(sampling_params)


def memory_available() -> int | None:
    """Bytes of memory the machine can give a new allocation now (Linux MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def fits_in_memory(name: str, num_bytes: int, fraction: float = 0.9) -> None:
    """Refuse (ValueError) an allocation of `num_bytes` above `fraction` of the available memory.

    Checked before allocating: torch.zeros of more than the machine has is not an exception, it
    is the kernel killing the process.
    """
    available = memory_available()
    if available is not None and num_bytes > fraction * available:
        raise ValueError(f"{name} needs {num_bytes:,} bytes ({num_bytes / 2**30:.2f} GiB), more than "
                         f"{fraction:.0%} of the {available:,} bytes ({available / 2**30:.2f} GiB) this "
                         f"machine has available")


def _allowed(minimum, maximum, exclusive_minimum: bool = False) -> str:
    """The allowed range in words: 'in (0, 1]', '>= 1', '<= 5'."""
    if minimum is not None and maximum is not None:
        return f"in {'(' if exclusive_minimum else '['}{minimum}, {maximum}]"
    if minimum is not None:
        return f"{'>' if exclusive_minimum else '>='} {minimum}"
    return f"<= {maximum}"

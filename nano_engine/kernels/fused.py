"""RMSNorm (alone, or with the residual add before it), SwiGLU's silu(gate) * up, the rotary
embedding (alone, or after Qwen3's norm of each q and k head) and the tree sum of a row-parallel
layer's leaves (parallel/split.py), each one compiled pass
(csrc/fused.cpp) instead of five to eight PyTorch operators, with the same bits for a row in any
batch. `Transformer.prepack` turns them on with the packed matmuls (the model's fast path; the
plain path stays the reference the chapters build). float32 and bfloat16.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import build as _build

SOURCE = _build.CSRC / "fused.cpp"
DTYPES = (torch.float32, torch.bfloat16)
_NAME = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _declare(lib: ctypes.CDLL) -> None:
    P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    for name in _NAME.values():
        getattr(lib, f"rms_norm_{name}").argtypes = [P, L, P, P, L, I, I, F, I]
        getattr(lib, f"add_rms_norm_{name}").argtypes = [P, L, P, L, P, P, L, P, L, I, I, F, I]
        getattr(lib, f"silu_mul_{name}").argtypes = [P, L, P, L, I, I, I]
        getattr(lib, f"rope_{name}").argtypes = [P, L, P, P, I, I, I, I]
        getattr(lib, f"qk_norm_rope_{name}").argtypes = [P, L, P, P, P, P, I, I, I, I, F, I]
        getattr(lib, f"leaf_sum_{name}").argtypes = [P, L, I, P, L, I, I, I]
        for fn in ("rms_norm", "add_rms_norm", "silu_mul", "rope", "qk_norm_rope", "leaf_sum"):
            getattr(lib, f"{fn}_{name}").restype = None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels, built for this CPU; None where they cannot be built (the plain path runs)."""
    return _build.load_if(SOURCE, (), _declare)


def available(dtype: torch.dtype) -> bool:
    return dtype in DTYPES and library() is not None


def _rows(x: torch.Tensor) -> bool:
    """2-D with contiguous rows, in a dtype the kernels run: what they read."""
    return x.dim() == 2 and x.stride(1) == 1 and x.dtype in DTYPES


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension; None for a layout it does not take."""
    if not _rows(x) or weight.dtype != x.dtype or not weight.is_contiguous():
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    with _build.profiled("nano_engine::rms_norm"):
        getattr(library(), f"rms_norm_{_NAME[x.dtype]}")(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                                                        out.stride(0), x.shape[0], x.shape[1], eps,
                                                        torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + delta, rms_norm of it) in one pass, with the bits of the add and the norm apart (the
    residual stream and the next sublayer's input, vLLM's fused_add_rms_norm); None for a layout
    it does not take."""
    if (not _rows(x) or not _rows(delta) or delta.dtype != x.dtype or delta.shape != x.shape
            or weight.dtype != x.dtype or not weight.is_contiguous()):
        return None
    res, out = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    with _build.profiled("nano_engine::add_rms_norm"):
        getattr(library(), f"add_rms_norm_{_NAME[x.dtype]}")(
            x.data_ptr(), x.stride(0), delta.data_ptr(), delta.stride(0), weight.data_ptr(), res.data_ptr(),
            res.stride(0), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return res, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up, where gate_up is (T, 2 I): gate then up; None for a layout it does not take."""
    if not _rows(gate_up) or gate_up.shape[1] % 2:
        return None
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
    with _build.profiled("nano_engine::silu_mul"):
        getattr(library(), f"silu_mul_{_NAME[gate_up.dtype]}")(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(),
                                                               out.stride(0), gate_up.shape[0], inter,
                                                               torch.get_num_threads())
    return out


def _heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x (T, heads, hd) with contiguous heads, and cos, sin (T, hd) to rotate it by: what rope_ takes."""
    return not (x.dim() != 3 or x.dtype not in DTYPES or x.stride(2) != 1 or x.stride(1) != x.shape[2]
                or x.shape[2] % 2 or cos.dtype != x.dtype or sin.dtype != x.dtype or not cos.is_contiguous()
                or not sin.is_contiguous() or cos.shape != (x.shape[0], x.shape[2]) or sin.shape != cos.shape)


def qk_norm_rope_(qk: torch.Tensor, nh: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Qwen3's q and k: qk (T, nh + nkv, hd), nh query heads then the key heads, each head
    RMS-normalised in place (by q_weight or k_weight, hd values each), then rotated by cos, sin
    (T, hd), as rope_; False (untouched) for a layout it does not take."""
    if not _heads(qk, cos, sin) or not 0 <= nh <= qk.shape[1]:
        return False
    hd = qk.shape[2]
    if any(w.dtype != qk.dtype or not w.is_contiguous() or w.shape != (hd,) for w in (q_weight, k_weight)):
        return False
    with _build.profiled("nano_engine::qk_norm_rope"):
        getattr(library(), f"qk_norm_rope_{_NAME[qk.dtype]}")(
            qk.data_ptr(), qk.stride(0), q_weight.data_ptr(), k_weight.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            qk.shape[0], nh, qk.shape[1] - nh, hd, eps, torch.get_num_threads())
    return True


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate x (T, heads, hd) in place by cos, sin (T, hd); False (untouched) for a layout it does not take."""
    if not _heads(x, cos, sin):
        return False
    with _build.profiled("nano_engine::rope"):
        getattr(library(), f"rope_{_NAME[x.dtype]}")(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                                                    x.shape[0], x.shape[1], x.shape[2], torch.get_num_threads())
    return True


def leaf_sum(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The row-parallel sum of `parts` (the leaves' products, (T, N) each, one dtype and row stride)
    in parallel/split.py's tree, in float32, rounded once to their dtype: the bits of
    Tree(0, len(parts)).sum over the parts widened to float32, then .to(dtype). None for a layout
    it does not take."""
    first = parts[0]
    if (not _rows(first) or any(p.dtype != first.dtype or p.shape != first.shape or p.stride() != first.stride()
                                for p in parts)):
        return None
    out = torch.empty(first.shape, dtype=first.dtype)
    addresses = (ctypes.c_void_p * len(parts))(*(p.data_ptr() for p in parts))
    with _build.profiled("nano_engine::leaf_sum"):
        getattr(library(), f"leaf_sum_{_NAME[first.dtype]}")(addresses, first.stride(0), len(parts), out.data_ptr(),
                                                            out.stride(0), first.shape[0], first.shape[1],
                                                            torch.get_num_threads())
    return out

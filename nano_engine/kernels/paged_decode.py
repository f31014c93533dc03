"""The compiled fast path: decode attention that reads the paged cache in place (csrc/paged_decode.cpp).

The chapters' attention (attention.py) gathers each decode's K and V out of the blocks into one
padded tensor per layer (a copy; for bfloat16 a second one, into float64), then runs two
batched matmuls over it. The kernel walks each sequence's block table instead and reads every K
and V row where it lies, with no padding and no copy: scores in one pass, PyTorch's softmax,
probabilities x V in a second pass. It is a setting (`EngineConfig(attention_backend="c")`,
`serve --attention-backend c`); the default stays the PyTorch code that the chapters teach, and
the tests check that both give the same tokens (in bfloat16 the same bits: see the source).

The kernel is built on first use for this CPU (kernels/build.py: about 2 s, once per CPU) and runs
on PyTorch's OpenMP threads, as many as torch.get_num_threads().
"""

from __future__ import annotations

import ctypes

import torch

from . import build as _build
from .build import KernelBuildError  # noqa: F401  (raised by library() when the kernel cannot be built)

SOURCE = _build.CSRC / "paged_decode.cpp"
DTYPES = (torch.float32, torch.bfloat16)
INSTEAD = 'use attention_backend="torch"'


def library_path():
    return _build.library_path(SOURCE)


def build():
    """Compile the kernel unless this CPU already has it; returns the library's path."""
    return _build.build(SOURCE, INSTEAD)


def _declare(lib: ctypes.CDLL) -> None:
    P, I = ctypes.c_void_p, ctypes.c_int
    for name in ("f32", "bf16"):
        getattr(lib, f"paged_scores_{name}").argtypes = [P] * 5 + [I] * 7 + [ctypes.c_double, I]
        getattr(lib, f"paged_values_{name}").argtypes = [P] * 5 + [I] * 8
        getattr(lib, f"paged_scores_{name}").restype = getattr(lib, f"paged_values_{name}").restype = None


def library() -> ctypes.CDLL:
    return _build.load(SOURCE, INSTEAD, _declare)


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in DTYPES:
        raise ValueError(f'attention_backend="c" runs {" and ".join(str(d).removeprefix("torch.") for d in DTYPES)} '
                         f'models; this one is {str(dtype).removeprefix("torch.")} (use attention_backend="torch")')


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, width: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its context, read from the blocks in place.

    q: (D, nh, hd); k_cache, v_cache: (slots, nkv, hd), one layer's cache, with the new tokens'
    K and V already written; block_tables: (D, max_blocks) int32; context_lens: (D,) int32, the
    tokens each query sees (its own included), at least 1. width: the longest context, when the
    caller knows it (attention.plan_attention works it out once per step, for every layer);
    otherwise it is read from context_lens here, and every length is checked against the tables.
    Returns (D, nh, hd) in q's dtype.
    The same steps as attention.decode_attention: scores (float32, -inf past each context), the
    softmax in float32, the probabilities rounded to the model's dtype, times V.
    """
    check_dtype(q.dtype)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("context_lens", context_lens)):
        if not t.is_contiguous():
            raise ValueError(f"paged_decode needs contiguous tensors; {name} is not")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"q is {q.dtype} but {name} is {t.dtype}")
    D, nh, hd = q.shape
    nkv = k_cache.shape[1]
    if width is None:
        width, shortest = int(context_lens.max()), int(context_lens.min())
        if shortest < 1:
            raise ValueError(f"every context length must be at least 1; the shortest is {shortest}")
    if width > block_tables.shape[1] * block_size:
        raise ValueError(f"a context of {width} tokens does not fit block tables of "
                         f"{block_tables.shape[1]} blocks of {block_size}")
    lib, name, threads = library(), "f32" if q.dtype == torch.float32 else "bf16", torch.get_num_threads()
    shape = (D, nh, nkv, hd, block_size, block_tables.shape[1], width)
    scores = torch.empty(D, nh, width)
    getattr(lib, f"paged_scores_{name}")(q.data_ptr(), k_cache.data_ptr(), block_tables.data_ptr(),
                                         context_lens.data_ptr(), scores.data_ptr(), *shape, hd ** -0.5, threads)
    probs = scores.softmax(dim=-1).to(q.dtype)
    out = torch.empty_like(q)
    getattr(lib, f"paged_values_{name}")(probs.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                                         context_lens.data_ptr(), out.data_ptr(), *shape, threads)
    return out

"""The compiled attention: every row of a step, chunks and decodes alike, in one call per layer
(csrc/paged_attention.cpp), reading K and V where they lie in the paged cache.

The chapters' attention (attention.py) gathers each sequence's context out of the blocks, pads
decodes into groups and, for bfloat16, computes in float64 so that a row's bits do not depend on
the rows it shares a matmul with. The kernel gets the same guarantee another way: it computes
every score, weight and output of a row by one fixed chain of float32 operations (the order is
in the source's header), whatever the batch, the chunking, the block size or the thread count.
Where the CPU has AMX (Sapphire Rapids and later), bfloat16 runs on its tiles instead, and where it
has AVX512_BF16 without AMX (AMD Zen 4 and 5), on its dot products, with the weights rounded to
bfloat16 before they multiply V (`bfloat16_path`): other bits than the vector code's, as invariant.
So `generate(..., attention_backend="c")`, which calls it over one contiguous context, and the
engine with `attention_backend="c"` give the same bits, row for row, by construction.

It is a setting (`EngineConfig(attention_backend="c")`, `serve --attention-backend c`). The
engine's default stays the PyTorch code that the chapters teach; `serve`, the main job and the
benchmarks run "auto", which is this kernel wherever it builds (`resolve_backend`). The kernel is built on first use for this
CPU (kernels/build.py: a few seconds, once per CPU) and runs on PyTorch's OpenMP threads, as many
as torch.get_num_threads().
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch

from . import build as _build
from .build import KernelBuildError  # noqa: F401  (raised by library() when the kernel cannot be built)

SOURCE = _build.CSRC / "paged_attention.cpp"
DTYPES = (torch.float32, torch.bfloat16)
INSTEAD = 'use attention_backend="torch"'
MAX_HEAD_DIM = 256


def library_path():
    return _build.library_path(SOURCE)


def build():
    """Compile the kernel unless this CPU already has it; returns the library's path."""
    return _build.build(SOURCE, INSTEAD)


def _declare(lib: ctypes.CDLL) -> None:
    P, I = ctypes.c_void_p, ctypes.c_int
    for name in ("f32", "bf16", "bf16_wide"):
        fn = getattr(lib, f"paged_attention_{name}")
        fn.argtypes = [P] * 7 + [I] * 6 + [ctypes.c_float, I]
        fn.restype = None
    lib.paged_attention_bf16_path.restype = I


def library() -> ctypes.CDLL:
    return _build.load(SOURCE, INSTEAD, _declare)


def bfloat16_path() -> str:
    """Where bfloat16 attention runs here: "amx" (tiles, Sapphire Rapids and later), "dot"
    (AVX512_BF16 dot products, AMD Zen 4 and 5), or "vector" (the float32 vector code, its inputs
    widened). The first two round the weights to bfloat16 before they multiply V, so each has other
    bits than the vector code's (all three batch-invariant). An odd head_dim takes the vector code."""
    return {2: "amx", 1: "dot", 0: "vector"}[library().paged_attention_bf16_path()]


def resolve_backend(name: str, dtype: torch.dtype) -> str:
    """The attention backend a command line's "auto" means: "c" where the kernel runs this dtype and
    builds on this machine (it is faster at every size measured, docs/benchmarks.md), else
    "torch". Any other name is returned as it is, for EngineConfig to check."""
    if name != "auto":
        return name
    if dtype not in DTYPES:
        return "torch"
    try:
        build()
    except KernelBuildError:
        return "torch"
    return "c"


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in DTYPES:
        raise ValueError(f'attention_backend="c" runs {" and ".join(str(d).removeprefix("torch.") for d in DTYPES)} '
                         f'models; this one is {str(dtype).removeprefix("torch.")} (use attention_backend="torch")')


@dataclass(frozen=True)
class KernelBatch:
    """A step's sequences as the kernel reads them, built and checked once for every layer."""

    query_start: torch.Tensor  # (B + 1,) int32: sequence s owns query rows query_start[s]:query_start[s + 1]
    num_cached: torch.Tensor  # (B,) int32: tokens before them in the cache
    block_tables: torch.Tensor  # (B, max_blocks) int32, short tables padded with block 0 (never read)
    block_size: int
    num_blocks: int  # the cache's size in blocks: every table entry is below it
    num_tokens: int  # query_start[-1]: the step's new tokens, q's rows


def kernel_batch(query_start: Sequence[int], num_cached: Sequence[int], block_tables: Sequence[Sequence[int]],
                 block_size: int, num_blocks: int) -> KernelBatch:
    """Check a step once and lay it out for the kernel.

    Every sequence needs at least one new token, and a table long enough for its context, of
    block ids inside the cache: the C code trusts them and would read other memory otherwise."""
    B = len(num_cached)
    if len(query_start) != B + 1 or len(block_tables) != B:
        raise ValueError(f"query_start needs {B + 1} entries and block_tables {B} for {B} sequences; "
                         f"got {len(query_start)} and {len(block_tables)}")
    rows = []  # each sequence's table, cut to the blocks its context fills
    for s in range(B):
        n, c = query_start[s + 1] - query_start[s], num_cached[s]
        if n < 1 or c < 0:
            raise ValueError(f"sequence {s} has {n} new tokens and {c} cached; it needs at least 1 new, 0 cached")
        need = -(-(c + n) // block_size)
        if len(block_tables[s]) < need:
            raise ValueError(f"sequence {s}: a context of {c + n} tokens does not fit its block table of "
                             f"{len(block_tables[s])} blocks of {block_size}")
        rows.append(list(block_tables[s][:need]))
        bad = [b for b in rows[-1] if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(f"sequence {s}: block {bad[0]} is outside the cache's {num_blocks} blocks")
    width = max((len(r) for r in rows), default=1)
    tables = torch.tensor([r + [0] * (width - len(r)) for r in rows] or [[0]], dtype=torch.int32)
    return KernelBatch(torch.tensor(list(query_start), dtype=torch.int32),
                       torch.tensor(list(num_cached), dtype=torch.int32), tables, block_size, num_blocks,
                       int(query_start[-1]))


def check_call(q_shape: Sequence[int], dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor,
               batch: KernelBatch) -> None:
    """What the C code trusts of a call (the batch itself was checked by kernel_batch): q of shape
    (T, nh, hd) and dtype `dtype` for the batch's T tokens, over contiguous caches of that dtype,
    (slots, nkv, hd) each, that hold the batch's blocks."""
    check_dtype(dtype)
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must be the same (slots, nkv, hd); got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != dtype:
            raise ValueError(f"q is {dtype} but {name} is {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"paged_attention needs contiguous caches; {name} is not")
    T, nh, hd = q_shape
    nkv = k_cache.shape[1]
    if k_cache.shape[2] != hd or nh % nkv:
        raise ValueError(f"{nh} query heads of {hd} cannot attend over {nkv} KV heads of {k_cache.shape[2]}")
    if hd > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {hd} is over the kernel's {MAX_HEAD_DIM}")
    if T != batch.num_tokens:
        raise ValueError(f"q has {T} rows but the batch has {batch.num_tokens} new tokens")
    if k_cache.shape[0] < batch.num_blocks * batch.block_size:
        raise ValueError(f"the cache holds {k_cache.shape[0]} slots, fewer than the batch's "
                         f"{batch.num_blocks} blocks of {batch.block_size}")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: KernelBatch,
                    wide: bool = False) -> torch.Tensor:
    """Causal attention of every new token of a step over its sequence's context in the cache.

    q: (T, nh, hd); k_cache, v_cache: (slots, nkv, hd), one layer's cache, with the new tokens'
    K and V already written; batch: kernel_batch() of the step. Returns (T, nh, hd) in q's dtype,
    or, with `wide` and bfloat16, in float32 as each output is before its one rounding (for the
    tests: every bit of a row's float32 chains shows there, where bfloat16 hides most of them).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be (T, nh, hd); got {tuple(q.shape)}")
    check_call(q.shape, q.dtype, k_cache, v_cache, batch)
    (_, nh, hd), nkv = q.shape, k_cache.shape[1]
    q = q.contiguous()
    wide = wide and q.dtype == torch.bfloat16
    out = torch.empty(q.shape, dtype=torch.float32 if wide else q.dtype)
    fn = getattr(library(), "paged_attention_f32" if q.dtype == torch.float32 else
                 "paged_attention_bf16_wide" if wide else "paged_attention_bf16")
    with _build.profiled("nano_engine::paged_attention"):
        fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), batch.query_start.data_ptr(),
           batch.num_cached.data_ptr(), batch.block_tables.data_ptr(), len(batch.num_cached),
           batch.block_tables.shape[1], nh, nkv, hd, batch.block_size, hd ** -0.5, torch.get_num_threads())
    return out


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int) -> torch.Tensor:
    """mini_llm.attention's contract through the kernel: q (T, nh, hd) at positions num_cached..,
    over k, v (num_cached + T, nkv, hd) held in one piece (one block of the whole length)."""
    L = k.shape[0]
    if L != num_cached + q.shape[0]:
        raise ValueError(f"k and v hold {L} tokens; {num_cached} cached + {q.shape[0]} new expected")
    batch = kernel_batch([0, q.shape[0]], [num_cached], [[0]], L, 1)
    return paged_attention(q, k.contiguous(), v.contiguous(), batch)

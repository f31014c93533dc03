"""The compiled fast path: decode attention that reads the paged cache in place (csrc/paged_decode.cpp).

The chapters' attention (attention.py) gathers each decode's K and V out of the blocks into one
padded tensor per layer (a copy; for bfloat16 a second one, into float64), then runs two
batched matmuls over it. The kernel walks each sequence's block table instead and reads every K
and V row where it lies, with no padding and no copy: scores in one pass, PyTorch's softmax,
probabilities x V in a second pass. It is a setting (`EngineConfig(attention_backend="c")`,
`serve --attention-backend c`); the default stays the PyTorch code that the chapters teach, and
the tests check that both give the same tokens (in bfloat16 the same bits: see the source).

The kernel is built on first use with the system's C++ compiler (`c++`/`g++`, or $CXX) for this
CPU (-march=native), into the cache folder, keyed by the source, the flags and the CPU; later
processes load the built file (about 2 s to build). It runs on PyTorch's OpenMP threads (the
libgomp.so.1 that torch has already loaded), as many as torch.get_num_threads().
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import torch

SOURCE = pathlib.Path(__file__).with_name("csrc") / "paged_decode.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
DTYPES = (torch.float32, torch.bfloat16)
_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled (no C++ compiler, or it failed): use attention_backend="torch"."""


def cpu_flags(cpuinfo: str) -> str | None:
    """The line of /proc/cpuinfo that lists the CPU's features: "flags" on x86, "Features" on ARM."""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return line
    return None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = cpu_flags(f.read())
    except OSError:
        line = None
    return line or platform.processor()


def library_path() -> pathlib.Path:
    """Where the built kernel lives: the cache folder, one file per source x flags x CPU."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_id().encode()
                         + platform.machine().encode()).hexdigest()[:16]
    root = pathlib.Path(os.environ.get("NANO_ENGINE_CACHE") or "~/.cache/nano_engine").expanduser()
    return root / "kernels" / f"paged_decode-{key}.so"


def build() -> pathlib.Path:
    """Compile the kernel unless this CPU already has it; returns the library's path."""
    path = library_path()
    if path.exists():
        return path
    cc = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cc is None:
        raise KernelBuildError('attention_backend="c" needs a C++ compiler (c++ or g++, or $CXX) to build '
                               f'{SOURCE.name}; none is on PATH. Install one, or use attention_backend="torch"')
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = pathlib.Path(tmp) / path.name
        try:
            run = subprocess.run([cc, *FLAGS, "-o", str(out), str(SOURCE)], capture_output=True, text=True)
        except OSError as e:
            raise KernelBuildError(f"cannot run the C++ compiler {cc}: {e}. Install one (or set $CXX), "
                                   'or use attention_backend="torch"') from None
        if run.returncode != 0:
            raise KernelBuildError(f"building {SOURCE.name} with {cc} failed (exit {run.returncode}); use "
                                   f'attention_backend="torch" meanwhile. The compiler said:\n{run.stderr.strip()}')
        os.replace(out, path)  # atomic: a second process sees the whole file or none
    return path


def library() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            # torch (imported above) has loaded its libgomp.so.1: the kernel's libgomp.so.1 resolves to it.
            lib = ctypes.CDLL(str(build()))
            P, I = ctypes.c_void_p, ctypes.c_int
            for name in ("f32", "bf16"):
                getattr(lib, f"paged_scores_{name}").argtypes = [P] * 5 + [I] * 7 + [ctypes.c_double, I]
                getattr(lib, f"paged_values_{name}").argtypes = [P] * 5 + [I] * 8
                getattr(lib, f"paged_scores_{name}").restype = getattr(lib, f"paged_values_{name}").restype = None
            _lib = lib
    return _lib


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

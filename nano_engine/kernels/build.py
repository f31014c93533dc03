"""Compile a kernel of csrc/ for this CPU on first use, and load it with ctypes.

Each source is built with the system's C++ compiler ($CXX, else `c++`, else `g++`) for the CPU at
hand (-march=native, so AVX-512 and AMX instructions are there only where the CPU has them), into
the cache folder ($NANO_ENGINE_CACHE, else ~/.cache/nano_engine), one file per source x flags x
CPU: a later process loads the built file. The library links against the OpenMP runtime that
PyTorch has already loaded (libgomp.so.1), so its parallel loops run on PyTorch's threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import torch  # loads libgomp.so.1 before any kernel does

CSRC = pathlib.Path(__file__).with_name("csrc")
# -ffp-contract=off: a multiply and an add stay two roundings unless the source asks for a fused
# multiply-add, so the kernels' arithmetic is what their source says on every instruction set.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# NANO_ENGINE_EMULATE_AMX=1, for the tests on a CPU with AVX512_BF16 and no AMX: the AMX kernels are
# built and run on a software model of the tiles (csrc/amx.h), as if the CPU had them. Read once,
# at import; slow, and its bits are the model's, not a CPU's: never for serving.
EMULATE_AMX = os.environ.get("NANO_ENGINE_EMULATE_AMX") == "1"
AMX_FEATURES = {"amx_tile", "amx_bf16"}  # what the AMX kernels need of /proc/cpuinfo, besides avx512_bf16
if EMULATE_AMX:
    FLAGS = [*FLAGS, "-DNANO_AMX_EMULATE"]
_loaded: dict[pathlib.Path, ctypes.CDLL] = {}
_lock = threading.Lock()


def profiled(name: str):
    """A label for torch.profiler around a kernel call (ctypes calls are invisible to it otherwise);
    nothing at all while no profiler runs."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class KernelBuildError(RuntimeError):
    """A kernel could not be compiled (no C++ compiler, or it failed)."""


def cpu_flags(cpuinfo: str) -> str | None:
    """The line of /proc/cpuinfo that lists the CPU's features: "flags" on x86, "Features" on ARM."""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return line
    return None


def _flags_line() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_flags(f.read())
    except OSError:  # not Linux
        return None


def cpu_features() -> set[str]:
    """The CPU's feature names as /proc/cpuinfo lists them (amx_tile, avx512f, ...); empty elsewhere.
    With EMULATE_AMX, a CPU with AVX512_BF16 also has AMX's."""
    features = set((_flags_line() or "").split()[2:])
    if EMULATE_AMX and "avx512_bf16" in features:
        features |= AMX_FEATURES
    return features


def _cpu_id() -> str:
    return _flags_line() or platform.processor()


def library_path(source: pathlib.Path) -> pathlib.Path:
    """Where the built kernel lives: the cache folder, one file per source x flags x CPU."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what it may include
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(FLAGS).encode() + _cpu_id().encode()
                         + platform.machine().encode()).hexdigest()[:16]
    root = pathlib.Path(os.environ.get("NANO_ENGINE_CACHE") or "~/.cache/nano_engine").expanduser()
    return root / "kernels" / f"{source.stem}-{key}.so"


def build(source: pathlib.Path, instead: str) -> pathlib.Path:
    """Compile source unless this CPU already has it; returns the library's path.

    `instead`: what the user can do when it cannot be built, ending each error message."""
    path = library_path(source)
    if path.exists():
        return path
    cc = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cc is None:
        raise KernelBuildError(f"{source.name} needs a C++ compiler (c++ or g++, or $CXX) to be built; none is "
                               f"on PATH. Install one, or {instead}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = pathlib.Path(tmp) / path.name
        try:
            run = subprocess.run([cc, *FLAGS, "-o", str(out), str(source)], capture_output=True, text=True)
        except OSError as e:
            raise KernelBuildError(f"cannot run the C++ compiler {cc}: {e}. Install one (or set $CXX), "
                                   f"or {instead}") from None
        if run.returncode != 0:
            raise KernelBuildError(f"building {source.name} with {cc} failed (exit {run.returncode}); "
                                   f"{instead} meanwhile. The compiler said:\n{run.stderr.strip()}")
        os.replace(out, path)  # atomic: a second process sees the whole file or none
    return path


def load_if(source: pathlib.Path, features, declare) -> ctypes.CDLL | None:
    """The built library, or None where the CPU lacks one of `features` (cpu_features() names) or
    it cannot be built: for a fast path whose caller keeps its plain one."""
    if not set(features) <= cpu_features():
        return None
    try:
        return load(source, "the plain path runs instead", declare)
    except KernelBuildError:
        return None


def load(source: pathlib.Path, instead: str, declare) -> ctypes.CDLL:
    """The built library, loaded once per process; declare(lib) sets its functions' argtypes."""
    with _lock:
        if source not in _loaded:
            lib = ctypes.CDLL(str(build(source, instead)))
            declare(lib)
            _loaded[source] = lib
    return _loaded[source]

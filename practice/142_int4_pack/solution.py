"""Exercise 142: int4 weights with a scale per group, two to a byte, and the matmul that dequantizes
them. Edit this file, then run

    python practice/judge.py 142

The statement is in README.md. w is a float32 weight (N, K): N output rows, K input columns. A row's
columns are cut into groups of group_size (the last may be shorter), each with its own scale. Leave
the arguments unchanged.
"""

import torch
import torch.nn.functional as F  # noqa: F401  (int4_linear's product is F.linear)

QMAX = 7  # int4 holds -8 .. 7; the scale maps the largest magnitude to +-7
MIN_SCALE = 1e-12  # the smallest scale (a group of zeros)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): q int8 (N, K) in [-8, 7], scales float32 (N, ceil(K / group_size)); scale = the
    group's largest |w| / 7 (at least 1e-12), q = round(w / scale) (halves to even), clamped."""
    raise NotImplementedError


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 (N, K) in [-8, 7] -> uint8 (N, ceil(K / 2)): column 2j in the low nibble, 2j + 1 in the
    high one, each as q + 8; an odd K's last high nibble is 8."""
    raise NotImplementedError


def unpack_int4(data: torch.Tensor, k: int) -> torch.Tensor:
    """pack_int4's inverse: uint8 (N, ceil(k / 2)) -> int8 (N, k)."""
    raise NotImplementedError


def dequantize(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 weight (N, K): q * its group's scale, one float32 multiplication each."""
    raise NotImplementedError


def int4_linear(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """x (M, K) float32 times the stored weight, transposed: (M, N) float32. Unpack, dequantize, then
    F.linear(x, w)."""
    raise NotImplementedError

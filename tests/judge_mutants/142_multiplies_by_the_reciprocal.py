"""Mutant of exercise 142: q = round(w * (1 / scale)), a multiplication by the reciprocal instead of the division."""

EXPECTED_HINT = "q is w * (1 / scale)"

import torch
import torch.nn.functional as F


def quantize_int4(w, group_size):
    n, k = w.shape
    groups = -(-k // group_size)
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, groups)
    for g in range(groups):
        cols = slice(g * group_size, min((g + 1) * group_size, k))
        scale = (w[:, cols].abs().amax(dim=1) / 7).clamp(min=1e-12)
        scales[:, g] = scale
        q[:, cols] = torch.round(w[:, cols] * (1 / scale[:, None])).clamp(-8, 7).to(torch.int8)  # MUTANT: times the reciprocal
    return q, scales


def pack_int4(q):
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.shape[1] % 2:
        u = torch.cat([u, torch.full((u.shape[0], 1), 8, dtype=torch.uint8)], dim=1)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(data, k):
    low = (data & 15).to(torch.int8) - 8
    high = (data >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=2).reshape(data.shape[0], -1)[:, :k]


def dequantize(q, scales, group_size):
    groups = torch.arange(q.shape[1]) // group_size
    return q.float() * scales[:, groups]


def int4_linear(x, data, scales, group_size, k):
    return F.linear(x, dequantize(unpack_int4(data, k), scales, group_size))

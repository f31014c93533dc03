"""Mutant of exercise 142: q = round(w / scale) with the division in float64."""

EXPECTED_HINT = "divided in float64"

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
        q[:, cols] = torch.round(w[:, cols].double() / scale[:, None].double()).clamp(-8, 7).to(torch.int8)  # MUTANT: float64
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

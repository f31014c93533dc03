"""What this CPU allows, measured in the same process as the benchmark.

* The matmul floor of a forward step: the time of the model's own linear layers (7 per layer,
  the same `Linear` modules and kernels the engine calls) on T rows, plus the LM head on the S
  rows that sample. No engine can run a step faster without faster matmuls; attention, norms
  and Python come on top. `FloorReplay` replays an engine run's own steps through these matmuls
  alone, so that the benchmark can time it in turn with the engine; `measure` takes a few T
  for the curves of the scaling study.
* The matmul peak: the best FLOP/s of those products (at the largest T).
* The memory bandwidth: reading a 1 GiB tensor. Decoding one request reads every weight once per
  token, so weight bytes / bandwidth is the least a batch-1 decode step can take.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from nano_engine import Transformer
from nano_engine.kernels.linear import PackedLeaves
from nano_engine.mini_llm import linear
from nano_engine.quantization import QuantizedWeight

POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def median_time(fn, reps: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class _Product:
    """One matmul of a decoder layer, called the way the model calls it (on its packed weight, if any)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, packed=None):
        self.weight, self.bias, self.packed = weight, bias, packed
        self.in_features = weight.shape[1]

    def __call__(self, x):
        return linear(x, self.weight, self.bias, self.packed)


def leaf_products(layer) -> list[_Product]:
    """A row-parallel layer's products (mini_llm.Linear.leaves: one per KV head), on the weights and
    kernels the model's own call reads; their tree sum is an addition, not a matmul, and stays out
    of the floor. A layer without leaves: its one product."""
    if layer.leaves is None or isinstance(layer.packed, QuantizedWeight):  # (quantized: its parts in one call)
        return [_Product(layer.weight, None, layer.packed)]
    ranges = list(zip(layer.leaves, layer.leaves[1:]))
    packs = layer._leaf_packs()  # the packs or copies the model's own call reads
    if isinstance(packs, PackedLeaves):
        return [_Product(layer.weight[:, a:b], None, p) for (a, b), p in zip(ranges, packs.packs)]
    return [_Product(w, None, None) for w in packs]


def layer_linears(model: Transformer) -> list[_Product]:
    """Every matmul of the decoder blocks, in call order (fused q/k/v and gate/up when the model is),
    each on the kernel the model's own call takes (Transformer.prepack's packed weights included;
    o_proj and down_proj leaf by leaf, as the model calls them: see leaf_products)."""
    out = []
    for block in model.model.layers:
        a, m = block.self_attn, block.mlp
        if getattr(a, "qkv_weight", None) is not None:
            out.append(_Product(a.qkv_weight, a.qkv_bias, getattr(a, "qkv_packed", None)))
        else:
            out += [_Product(p.weight, p.bias, p.packed) for p in (a.q_proj, a.k_proj, a.v_proj)]
        out += leaf_products(a.o_proj)
        if getattr(m, "gate_up_weight", None) is not None:
            out.append(_Product(m.gate_up_weight, None, getattr(m, "gate_up_packed", None)))
        else:
            out += [_Product(p.weight, None, p.packed) for p in (m.gate_proj, m.up_proj)]
        out += leaf_products(m.down_proj)
    return out


@dataclass
class Roofline:
    dtype: str
    threads: int
    linear_s: dict[int, float]  # T rows -> seconds for all decoder linears
    lm_head_s: dict[int, float]  # S rows -> seconds for the LM head
    linear_params: int  # weights in the decoder's linear layers
    lm_head_params: int
    weight_bytes: int  # everything a batch-1 decode step must read
    bandwidth: float  # bytes/s

    @staticmethod
    def _interp(table: dict[int, float], n: int) -> float:
        if n <= 0:
            return 0.0
        xs = sorted(table)
        if n >= xs[-1]:
            return table[xs[-1]] * n / xs[-1]
        for lo, hi in zip(xs, xs[1:]):
            if lo <= n <= hi:
                return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)
        return table[xs[0]]

    def step_floor(self, tokens: int, sampled: int) -> float:
        """Seconds of matmuls in a step of `tokens` rows of which `sampled` need logits."""
        return self._interp(self.linear_s, tokens) + self._interp(self.lm_head_s, sampled)

    def matmul_flops(self, tokens: int, sampled: int) -> float:
        return 2.0 * (self.linear_params * tokens + self.lm_head_params * sampled)

    @property
    def peak_flops(self) -> float:
        """Best measured FLOP/s of the decoder's linear layers."""
        return max(2.0 * self.linear_params * t / s for t, s in self.linear_s.items())

    @property
    def decode_bound_s(self) -> float:
        return self.weight_bytes / self.bandwidth


@torch.inference_mode()
def measure(model: Transformer, points=POINTS, reps: int = 5) -> Roofline:
    linears = layer_linears(model)
    dt = model.dtype
    linear_s = {t: median_time(FloorReplay(model, [(t, 0)], "").run, reps) for t in points}
    head = model.lm_head
    lm_head_s = {}
    for s in (1, 8, 64):
        x = torch.randn(s, head.in_features, dtype=dt)
        lm_head_s[s] = median_time(lambda: head(x), reps)
    linear_params = sum(lin.weight.numel() for lin in linears)
    return Roofline(str(dt).removeprefix("torch."), torch.get_num_threads(), linear_s, lm_head_s,
                    linear_params, head.weight.numel(), weight_bytes(model), read_bandwidth(reps))


def read_bandwidth(reps: int = 5) -> float:
    """Bytes a second this machine reads now: a reduction over 1 GiB of float32, median of reps."""
    big = torch.ones(256 * 2**20, dtype=torch.float32)
    return big.numel() * 4 / median_time(lambda: big.sum(), reps)


def weight_bytes(model: Transformer) -> int:
    """What a batch-1 decode step reads of the matmul weights: the integers and scales of a
    quantized layer, the dtype's bytes of any other (the LM head included)."""
    total = 0
    for owner, attr, weight in model.linear_sites():
        packed = getattr(owner, attr, None)
        if isinstance(packed, QuantizedWeight) and packed.matches(weight):
            total += packed.nbytes
        else:
            total += weight.numel() * weight.element_size()
    return total


class PseudoSystem:
    """Timed in turn with the systems, like one, but serves no requests."""

    dtype = "-"

    def prepare(self, workload):
        pass

    def finish(self):
        pass

    def close(self):
        pass


class FloorReplay(PseudoSystem):
    """An engine run's steps, (T, S) each, through the matmuls only."""

    def __init__(self, model: Transformer, steps: list[tuple[int, int]], name: str):
        self.model, self.steps, self.name = model, steps, name
        self.linears = layer_linears(model)
        top = max(t for t, _ in steps)
        self.x = {n: torch.randn(top, n, dtype=model.dtype) for n in {lin.in_features for lin in self.linears}}
        self.h = torch.randn(max(s for _, s in steps) + 1, model.lm_head.in_features, dtype=model.dtype)

    @torch.inference_mode()
    def run(self, workload=None):
        for t, s in self.steps:
            for lin in self.linears:
                lin(self.x[lin.in_features][:t])
            if s:
                self.model.lm_head(self.h[:s])
        return None


class WeightRead(PseudoSystem):
    """Reading `nbytes` from memory `times` times (a reduction over a float32
    buffer as large as the weights), the least a batch-1 decode of `times` tokens can cost."""

    def __init__(self, nbytes: int, times: int):
        self.buf, self.times = torch.ones(nbytes // 4), times
        self.name = f"read the weights ({nbytes / 1e6:.0f} MB) x{times}"

    def run(self, workload=None):
        for _ in range(self.times):
            self.buf.sum()
        return None


def attention_flops(model: Transformer, lengths) -> float:
    """FLOPs of causal attention (QK^T and PV) for sequences of these lengths, all layers."""
    cfg = model.config
    per_pair = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return float(sum(per_pair * n * (n + 1) / 2 for n in lengths))

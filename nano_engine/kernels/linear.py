"""The matmul of every layer: x @ weight.T + bias on the fastest oneDNN kernel that keeps a row's
result independent of the batch it runs in (see `linear`), and weights prepacked once into
oneDNN's blocked layout (`PackedWeight`), as vLLM's CPU backend does
(`dispatch_cpu_unquantized_gemm`, vllm/model_executor/layers/utils.py).

mini_llm's `Linear` layers call `linear`; `Transformer.prepack` hands each one a `PackedWeight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _has_onednn_linear() -> bool:
    try:
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        return torch.equal(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w))
    except (AttributeError, RuntimeError):
        return False


ONEDNN_FP32 = torch.backends.mkldnn.is_available() and _has_onednn_linear()


HALF_ROWS = 32  # the most rows oneDNN's bfloat16 / float16 matmul takes in one call here (see linear)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: "PackedWeight | None" = None) -> torch.Tensor:
    """x @ weight.T + bias, on the fastest kernel that gives every row what it would get alone.

    * float32 goes to oneDNN when no gradient is wanted: PyTorch gives float32 products to MKL's
      sgemm, which takes an AVX2 code path on AMD CPUs; oneDNN (PyTorch's own bfloat16 path) uses
      AVX-512 and is 1.5-1.9x faster from 2 rows up on this project's machine. It has no backward.
      With `packed` (Transformer.prepack), oneDNN reads the weight in its own blocked layout,
      reordered once at load time, as vLLM's CPU backend does: faster still, and on CPUs where the
      plain call's one-row kernel rounds differently, the packed kernel does not.
    * bfloat16 and float16: oneDNN computes a single row with another kernel than two or more
      rows, and for some shapes (576 x 1536 here) the two round differently. A batched step must
      give each request the bits that request would get alone, so one row goes in as two.
      On CPUs with AMX (Intel Sapphire Rapids and later), oneDNN takes an AMX kernel from 33 rows
      up, which rounds differently again: more rows go in as chunks of HALF_ROWS.
      tests/test_mini_llm.py checks the invariance this relies on.
    """
    if x.dim() == 2 and not (torch.is_grad_enabled() and weight.requires_grad):
        if x.dtype == torch.float32 and ONEDNN_FP32:
            if packed is not None and packed.matches(weight):
                weight = packed.tensor
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        if x.dtype in (torch.bfloat16, torch.float16):
            if x.shape[0] == 1:
                return F.linear(x.expand(2, -1), weight, bias)[:1]
            if x.shape[0] > HALF_ROWS:
                return torch.cat([linear(part, weight, bias) for part in x.split(HALF_ROWS)])
    return F.linear(x, weight, bias)


class PackedWeight:
    """A float32 weight reordered once into oneDNN's blocked layout (vLLM's CPU backend does the
    same at load time: `dispatch_cpu_unquantized_gemm` in vllm/model_executor/layers/utils.py).
    `linear` uses it only while the weight it was made from is unchanged: the same storage, dtype
    and version counter (an in-place edit or `.to()` makes it stale, and the plain path runs)."""

    def __init__(self, weight: torch.Tensor):
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)  # None: any row count
        self._key = self._key_of(weight)

    @staticmethod
    def _key_of(weight: torch.Tensor):
        return weight.data_ptr(), weight.dtype, tuple(weight.shape), weight._version

    def matches(self, weight: torch.Tensor) -> bool:
        return self._key == self._key_of(weight)

"""Where an engine run's time goes: torch.profiler's operator times, grouped, against the wall.

    .venv/bin/python bench/breakdown.py                       # W2[:16] in bfloat16 and float32
    .venv/bin/python bench/breakdown.py --workload W1 --dtypes float32 --top 25

Groups: the matmuls of the linear layers (the floor), o_proj's and down_proj's parts and their
fixed sum apart from the other matmuls, attention (the C kernel; or the gathers of K and V from the
paged blocks, its batched matmuls, softmax, masks), dtype conversions, the other element-wise
ops (norms, rotary embedding, SwiGLU, residuals), the rest; "Python and dispatch" is the wall time
that no operator accounts for (module calls, the scheduler, building the batch).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from nano_engine import Transformer  # noqa: E402
from nano_engine.kernels import decoder  # noqa: E402
from nano_engine.kernels.linear import can_prepack  # noqa: E402

import systems as S  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

GROUPS = {
    "matmuls of the linear layers": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "aten::linear",
                                     "nano_engine::gemm_amx", "nano_engine::gemm_f32", "nano_engine::gemm_bf16_dot",
                                     "nano_engine::gemm_quant_f32", "nano_engine::gemm_quant_bf16"),
    # o_proj and down_proj: their K parts (one per KV head) and the parts' fixed tree sum (parallel/split.py)
    "matmuls: row-parallel parts and their sum": ("nano_engine::gemm_leaves_f32", "nano_engine::gemm_leaves_bf16_dot",
                                                  "nano_engine::leaf_sum"),
    "attention: the C kernel": ("nano_engine::paged_attention",),
    "attention: gather K, V from blocks": ("aten::index_select", "aten::index"),
    "attention: batched matmuls": ("aten::bmm",),
    "attention: softmax and masks": ("aten::_softmax", "aten::masked_fill_", "aten::masked_fill"),
    "KV cache writes": ("aten::index_copy_", "aten::index_put_"),
    "dtype conversions and copies": ("aten::copy_", "aten::_to_copy", "aten::clone"),
    "element-wise (norms, rope, SwiGLU, residual)": ("nano_engine::rms_norm", "nano_engine::add_rms_norm",
                                                     "nano_engine::silu_mul", "nano_engine::rope",
                                                     "nano_engine::qk_norm_rope",
                                                     "aten::mul", "aten::add", "aten::silu", "aten::_fused_rms_norm",
                                                     "aten::rms_norm", "aten::pow", "aten::sum", "aten::div_",
                                                     "aten::neg", "aten::cat", "aten::add_", "aten::mean",
                                                     "aten::rsqrt"),
    "sampling (argmax)": ("aten::argmax", "aten::max"),
}


def group_of(name: str) -> str:
    for group, names in GROUPS.items():
        if name in names:
            return group
    return "other operators"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="W2[:16]", help="W1, W2, W3, or W2[:N]")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--top", type=int, default=0, help="also print the N most expensive operators")
    ap.add_argument("--prepack", action="store_true",
                    help="packed weights where this CPU has a kernel for them (Transformer.prepack)")
    ap.add_argument("--attention-backend", choices=["auto", "torch", "c"], default="auto",
                    help="c where it builds (auto, the default), or torch, the chapters' attention")
    args = ap.parse_args(argv)
    name, _, head = args.workload.partition("[:")
    w = WORKLOADS[name]()
    if head:
        w = w.head(int(head.rstrip("]")))
    for dt in args.dtypes.split(","):
        model = Transformer.from_pretrained(dtype=getattr(torch, dt), prepack=args.prepack and can_prepack(getattr(torch, dt)))
        system = S.NanoEngine(dt, model, args.attention_backend)
        system.run(w)  # warm-up
        t = time.perf_counter()
        system.run(w)
        unprofiled = time.perf_counter() - t
        one_call = isinstance(model._decoder, decoder.Plan)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            system.run(w)
            wall = time.perf_counter() - t
        totals: dict[str, float] = defaultdict(float)
        events = prof.key_averages()
        for ev in events:
            totals[group_of(ev.key)] += ev.self_cpu_time_total / 1e6
        ops = sum(totals.values())
        totals["Python and dispatch (wall minus operators)"] = max(wall - ops, 0.0)
        steps = system.last_engine.stats.steps
        print(f"\n{dt}{' prepacked' if model.prepacked else ''}, attention {args.attention_backend}, {w.name}: "
              f"{steps} steps in {wall:.2f} s under the profiler", flush=True)
        for group, secs in sorted(totals.items(), key=lambda kv: -kv[1]):
            print(f"  {group:<46} {secs:6.2f} s {secs / wall:6.1%}  {secs / steps * 1e3:6.1f} ms/step")
        print(f"  without the profiler: {unprofiled:.2f} s" + (
            " (there, every layer of a step runs in one compiled call, kernels/decoder.py; under the profiler "
            "layer by layer, so that it sees each kernel: the same kernels, more Python)" if one_call else ""))
        if args.top:
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tensor parallelism on this machine: the engine at 1, 2, 3 ranks on the same workload, interleaved
and repeated, with what a step's collectives cost.

    .venv/bin/python bench/tensor_parallel.py                     # W1, float32 and bfloat16, 3 reps
    .venv/bin/python bench/tensor_parallel.py --workload W2 --head 16 --dtypes bfloat16

On a CPU the ranks share one memory bus and one machine's cores: tensor parallelism cannot make a
step faster than one process using all the cores; it costs the collectives (2 per layer + 2 a
step) on top. What it buys is a model larger than one process's memory, which this machine does
not need; this script measures what it costs here. Every run's tokens are checked against the
single-process run's (the logits are the same bits, tests/test_tensor_parallel.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from nano_engine import LLMEngine, SamplingParams, Transformer  # noqa: E402
from nano_engine.parallel.workers import Group  # noqa: E402
from workloads import WORKLOADS  # noqa: E402


def run_once(model, w, degree: int, backend: str) -> tuple[float, list[list[int]], int, dict]:
    """Seconds for the whole workload (workers started before the clock), tokens, steps, collective counts."""
    counts = {"all_gather": 0, "gather": 0, "broadcast": 0}
    originals = {name: getattr(Group, name) for name in counts}

    def counted(name):
        def call(self, *a, **k):
            if self.rank == 0:
                counts[name] += 1
            return originals[name](self, *a, **k)
        return call

    for name in counts:
        setattr(Group, name, counted(name))
    try:
        with LLMEngine(model, tensor_parallel_size=degree, attention_backend=backend, num_blocks=1024) as engine:
            params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=r.ignore_eos) for r in w.requests]
            t = time.perf_counter()
            out = engine.generate([list(r.prompt_ids) for r in w.requests], params)
            seconds = time.perf_counter() - t
            steps = engine.stats.steps
    finally:
        for name, fn in originals.items():
            setattr(Group, name, fn)
    return seconds, [r.output_ids for r in out], steps, counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="W1", choices=sorted(WORKLOADS))
    ap.add_argument("--head", type=int, help="the first N requests only")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--degrees", default="1,2,3")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--attention-backend", default="c", choices=["c", "torch"])
    ap.add_argument("--prepack", action="store_true", help="the packed kernels (the fast path)")
    args = ap.parse_args(argv)
    w = WORKLOADS[args.workload]()
    if args.head:
        w = w.head(args.head)
    degrees = [int(d) for d in args.degrees.split(",")]
    print(f"{w.name}: {len(w.requests)} requests, {w.prompt_tokens} prompt tokens; {torch.get_num_threads()} threads; "
          f"attention {args.attention_backend}{', prepacked' if args.prepack else ''}")
    for dtype in args.dtypes.split(","):
        model = Transformer.from_pretrained(None, dtype=dtype, prepack=args.prepack)
        times = {d: [] for d in degrees}
        reference, info = None, {}
        for _ in range(args.reps):
            for d in degrees:  # interleaved: the machine's drift hits every degree alike
                seconds, tokens, steps, counts = run_once(model, w, d, args.attention_backend)
                times[d].append(seconds)
                reference = reference or tokens
                info[d] = (steps, counts, tokens == reference)
        base = statistics.median(times[degrees[0]])
        print(f"\n{dtype}")
        print(f"{'ranks':>5} {'median s':>9} {'min-max s':>14} {'vs 1':>6} {'steps':>6} {'collectives/step':>17} "
              f"{'ms/step':>8} {'same tokens':>12}")
        for d in degrees:
            steps, counts, same = info[d]
            med = statistics.median(times[d])
            per_step = sum(counts.values()) / steps if d > 1 else 0
            print(f"{d:>5} {med:>9.2f} {min(times[d]):>6.2f}-{max(times[d]):<7.2f} {med / base:>5.2f}x {steps:>6} "
                  f"{per_step:>17.1f} {1000 * med / steps:>8.1f} {str(same):>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

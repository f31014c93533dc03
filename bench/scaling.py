"""Scaling study: nano_engine's step time and throughput against concurrency and tokens per step,
with this CPU's roofline drawn in.

    .venv/bin/python bench/scaling.py            # both dtypes, about 4 minutes; writes bench/scaling.png
    .venv/bin/python bench/scaling.py --dtypes float32 --out /tmp/scaling.png

Left: decode steps of 1 to 64 concurrent requests (each with a 64-token prompt already in the
cache). Right: one prefill step of T tokens (a single request's prompt of T tokens). Each point
is timed in turn with the matmul floor of the same step (the model's linear layers alone on the
same rows), medians of a few repetitions. The roofline: a step must read every weight once
(weight bytes / memory bandwidth) and do its matmul FLOPs (2 x parameters per token, the LM head
only for rows that sample) at the matmul peak, so it takes at least the larger of the two; the
bandwidth and peak are the best this run saw (a read of 1 GiB, the matmul floors).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from nano_engine import LLMEngine, SamplingParams, Transformer  # noqa: E402

import roofline  # noqa: E402
from workloads import w2  # noqa: E402

CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
STEP_TOKENS = (1, 8, 32, 64, 128, 256, 512)


def prompts(n: int, length: int) -> list[list[int]]:
    pool = [t for r in w2().requests for t in r.prompt_ids]
    return [pool[i * length:(i + 1) * length] for i in range(n)]


def floor_fn(model, tokens: int, sampled: int):
    """The matmuls alone of one step of `tokens` rows, `sampled` of them through the LM head."""
    return roofline.FloorReplay(model, [(tokens, sampled)], "floor").run


def decode_point(model, n: int, reps: int) -> tuple[float, float]:
    """Median decode step with n running requests, and the median of its matmul floor, in turn."""
    engine = LLMEngine(model, max_num_batched_tokens=max(512, n * 64), max_num_seqs=n, num_blocks=n * 16 + 16)
    for p in prompts(n, 64):
        engine.add_request(p, SamplingParams(max_tokens=4 * reps + 4, ignore_eos=True))
    engine.step()  # every prompt in one step
    engine.step()
    floor = floor_fn(model, n, n)
    steps, floors = [], []
    for _ in range(reps):
        for _ in range(3):
            engine.step()
            steps.append(engine.step_log[-1].duration)
        t = time.perf_counter()
        floor()
        floors.append(time.perf_counter() - t)
    return statistics.median(steps), statistics.median(floors)


def prefill_point(model, t: int, reps: int) -> tuple[float, float]:
    """Median step that prefills one t-token prompt (and samples its first token), and its floor."""
    prompt = prompts(1, t)[0]
    floor = floor_fn(model, t, 1)
    steps, floors = [], []
    for _ in range(reps):
        engine = LLMEngine(model, max_num_batched_tokens=max(t, 16), num_blocks=t // 16 + 4)
        engine.generate([prompt], SamplingParams(max_tokens=1))
        steps.append(engine.step_log[0].duration)
        s = time.perf_counter()
        floor()
        floors.append(time.perf_counter() - s)
    return statistics.median(steps), statistics.median(floors)


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    colors = {"float32": "tab:blue", "bfloat16": "tab:orange"}
    for dt, r in results.items():
        c = colors.get(dt, "k")
        roof = r["roof"]
        for col, key, xs in ((0, "decode", CONCURRENCY), (1, "prefill", STEP_TOKENS)):
            xs = [x for x in xs if str(x) in r[key]]
            step = [r[key][str(x)]["step_ms"] for x in xs]
            floor = [r[key][str(x)]["floor_ms"] for x in xs]
            ax = axes[0][col]
            ax.plot(xs, step, "o-", color=c, label=f"nano_engine {dt}")
            ax.plot(xs, floor, "s--", color=c, alpha=0.6, label=f"matmul floor {dt}")
            bound = [roof["bound_ms"](x, x if col == 0 else 1) for x in xs]
            ax.plot(xs, bound, ":", color=c, label=f"roofline {dt}")
            ax = axes[1][col]
            ax.plot(xs, [x / s * 1e3 for x, s in zip(xs, step)], "o-", color=c, label=f"nano_engine {dt}")
            ax.plot(xs, [x / f * 1e3 for x, f in zip(xs, floor)], "s--", color=c, alpha=0.6,
                    label=f"matmul floor {dt}")
            ax.plot(xs, [x / b * 1e3 for x, b in zip(xs, bound)], ":", color=c, label=f"roofline {dt}")
    titles = ("decode: concurrent requests, one token each", "prefill: tokens of one prompt in one step")
    for col in range(2):
        for row, ylabel in ((0, "step time (ms)"), (1, "tokens per second")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("requests per step" if col == 0 else "tokens per step")
            ax.set_ylabel(ylabel)
            ax.set_title(titles[col])
            ax.grid(True, which="both", alpha=0.3)
        axes[1][col].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M on this CPU: nano_engine against its matmul floor and the roofline")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "scaling.png")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for dt in args.dtypes.split(","):
        model = Transformer.from_pretrained(dtype=getattr(torch, dt))
        roof = roofline.measure(model, points=(1, 64, 512), reps=3)
        r = results[dt] = {"decode": {}, "prefill": {}}
        print(f"{dt}:")
        print(f"{'requests':>9}{'step ms':>9}{'floor ms':>10}{'tok/s':>8}{'at floor':>9}")
        for n in CONCURRENCY:
            step, floor = decode_point(model, n, args.reps)
            r["decode"][str(n)] = dict(step_ms=step * 1e3, floor_ms=floor * 1e3)
            print(f"{n:>9}{step * 1e3:>9.1f}{floor * 1e3:>10.1f}{n / step:>8.0f}{floor / step:>9.0%}")
        print(f"{'tokens':>9}{'step ms':>9}{'floor ms':>10}{'tok/s':>8}{'at floor':>9}")
        for t in STEP_TOKENS:
            step, floor = prefill_point(model, t, args.reps)
            r["prefill"][str(t)] = dict(step_ms=step * 1e3, floor_ms=floor * 1e3)
            print(f"{t:>9}{step * 1e3:>9.1f}{floor * 1e3:>10.1f}{t / step:>8.0f}{floor / step:>9.0%}")
        # The roofline must bound what was measured: take the best bandwidth and FLOP/s seen.
        bandwidth = max(roof.bandwidth, roof.weight_bytes / (r["decode"]["1"]["floor_ms"] / 1e3))
        peak = max([roof.peak_flops] + [2 * roof.linear_params * t / (p["floor_ms"] / 1e3)
                                        for t, p in ((int(t), p) for t, p in r["prefill"].items())])
        r["roof"] = {"bandwidth_gbs": bandwidth / 1e9, "peak_gflops": peak / 1e9, "weight_mb": roof.weight_bytes / 1e6}
        print(f"roofline: memory {bandwidth / 1e9:.1f} GB/s for {roof.weight_bytes / 1e6:.0f} MB of weights, "
              f"matmul peak {peak / 1e9:.0f} GFLOP/s")

        def bound_ms(tokens, sampled, roof=roof, bandwidth=bandwidth, peak=peak):
            return 1e3 * max(roof.weight_bytes / bandwidth, roof.matmul_flops(tokens, sampled) / peak)
        r["roof"]["bound_ms"] = bound_ms
    plot(results, args.out)
    for r in results.values():
        r["roof"].pop("bound_ms")
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

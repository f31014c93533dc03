"""A sweep of request rates, read as a table and as a latency-throughput plot.

One `run_benchmark` per offered rate, the same requests each time. As the rate grows, achieved
throughput grows with it until the server saturates; past that knee, throughput stays flat and
only the queue, so the latency, grows. The plot puts achieved output throughput on x and
latency (median and a high percentile) on y, one panel per metric, each point labelled with the
rate that was offered. The role of vLLM's `vllm/benchmarks/sweep/plot.py`, in one figure.
"""

from __future__ import annotations

from typing import Sequence

from .metrics import METRIC_NAMES

_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def sweep(requests, rates: Sequence[float], base_url: str = "http://127.0.0.1:8000", **kwargs) -> list[dict]:
    """One `serve.benchmark` per rate (same requests, same seed), in the order given."""
    from .serve import benchmark

    return [benchmark(requests, base_url, request_rate=rate, **kwargs) for rate in rates]


def parse_rates(text: str) -> list[float]:
    """'1,2,4,inf' -> [1.0, 2.0, 4.0, inf]; each rate > 0."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not a number of requests/s (or inf)") from None
        if not rate > 0:
            raise ValueError(f"{part.strip()!r}: a request rate must be > 0 (or inf)")
        rates.append(rate)
    return rates


def _rate(result: dict) -> float:
    return float(result["request_rate"])  # a number, or "inf" as vLLM saves an unbounded rate


def _top_percentile(result: dict, metric: str) -> str | None:
    """The key of the highest percentile stored for `metric` (p99_ttft_ms, ...)."""
    keys = [k for k in result if k.startswith("p") and k.endswith(f"_{metric}_ms")]
    return max(keys, key=lambda k: float(k[1:].split("_")[0]), default=None)


def _metrics(result: dict) -> list[str]:
    return [m for m in METRIC_NAMES if f"median_{m}_ms" in result]


def sweep_table(results: Sequence[dict]) -> str:
    """A Markdown table: offered rate, achieved throughput, median / top percentile of each metric."""
    metrics = _metrics(results[0])
    head = ["rate (req/s)", "done", "failed", "req/s", "output tok/s"]
    for m in metrics:
        top = _top_percentile(results[0], m)
        head.append(f"{_LABELS[m]} median{' / ' + top.split('_')[0] if top else ''} (ms)")
    has_goodput = results[0].get("request_goodput") is not None
    if has_goodput:
        head.append("goodput (req/s)")
    rows = []
    for r in results:
        row = [f"{_rate(r):g}", str(r["completed"]), str(r["failed"]), f"{r['request_throughput']:.2f}",
               f"{r['output_throughput']:.1f}"]
        for m in metrics:
            top = _top_percentile(r, m)
            row.append(f"{r[f'median_{m}_ms']:.1f}" + (f" / {r[top]:.1f}" if top else ""))
        if has_goodput:
            row.append(f"{r['request_goodput']:.2f}")
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def plot_sweep(results: Sequence[dict], path=None, title: str | None = None):
    """The latency-throughput figure (a matplotlib Figure; saved as PNG when `path` is given).
    No pyplot: the figure draws with Agg anywhere, and a notebook displays it as returned."""
    from matplotlib.figure import Figure

    metrics = _metrics(results[0])
    fig = Figure(figsize=(4.2 * len(metrics), 3.6), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    x = [r["output_throughput"] for r in results]
    for ax, m in zip(axes, metrics):
        ax.plot(x, [r[f"median_{m}_ms"] for r in results], "o-", label="median")
        top = _top_percentile(results[0], m)
        if top:
            ax.plot(x, [r[top] for r in results], "s--", label=top.split("_")[0])
        for xi, r in zip(x, results):
            ax.annotate(f"{_rate(r):g}/s", (xi, r[f"median_{m}_ms"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        ax.set_xlabel("achieved output throughput (tokens/s)")
        ax.set_ylabel(f"{_LABELS[m]} (ms)")
        ax.set_title(_LABELS[m])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "latency vs throughput (labels: offered request rate)")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig

"""Serving-benchmark metrics with vLLM's definitions: TTFT, TPOT, ITL, E2EL, throughput, goodput.

Why: a latency figure means something only with its definition. "Time per output token" can be
measured in three different ways, percentiles interpolated in five, and a failed request counted or
not; two load generators that differ in any of these print numbers that cannot be compared. This
module takes vLLM's definitions one for one, so that what our load generator reports reads the same
as `vllm bench serve` run against the same server.

Mirrors `calculate_metrics` and `BenchmarkMetrics` in `vllm/benchmarks/serve.py`, and the timing of
`async_request_openai_completions` in `vllm/benchmarks/lib/endpoint_request_func.py` (its
`RequestFuncOutput` holds ttft, itl, latency; a `RequestRecord` here holds the raw timestamps they
come from). Per successful request, in seconds:

- TTFT = first output chunk - start;
- ITL  = every gap between consecutive output chunks (a chunk may carry several tokens: the gap is
  per chunk, not per token); vLLM pools the gaps of all requests into one list, so a long request
  weighs more in the ITL percentiles than a short one;
- E2EL = end - start (vLLM's `latency`; its client sets end to the last output chunk);
- TPOT = (E2EL - TTFT) / (output_tokens - 1), only when output_tokens > 1: a one-token request has no
  TPOT in the statistics, and counts as TPOT 0 against a TPOT SLO.

Statistics are numpy's: mean, median, population std, `np.percentile` with its default linear
interpolation, computed in seconds then multiplied by 1000; an empty list reads as 0 (vLLM's
`np.mean(x or 0)`). Failed requests are counted and left out of every other figure. Throughputs
divide by the duration the caller measured, not by the span of the records. Goodput counts the
requests whose every SLO holds with value <= SLO (ms), per second of duration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

SLO_NAMES = ("ttft", "tpot", "e2el")
METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
# (attribute, short name, header) in the order `vllm bench serve` prints them.
_SECTIONS = (("ttft", "TTFT", "Time to First Token"),
             ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl", "ITL", "Inter-token Latency"),
             ("e2el", "E2EL", "End-to-end Latency"))


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool)


@dataclass
class RequestRecord:
    """The client's timestamps of one streamed request (any one monotonic clock, in seconds)."""
    start: float                 # when the request was sent
    chunk_times: list[float]     # arrival of each streamed chunk that carried output text/tokens
    end: float                   # when the response was complete
    prompt_tokens: int
    output_tokens: int
    success: bool = True
    error: str = ""

    def __post_init__(self):
        check_record(self, "RequestRecord")


def check_record(r: RequestRecord, where: str) -> None:
    """Raise ValueError/TypeError naming the first field of `r` that cannot be a real request."""
    for name in ("start", "end"):
        v = getattr(r, name)
        if not _is_number(v) or not math.isfinite(v):
            raise ValueError(f"{where}.{name} must be a finite number of seconds, got {v!r}")
    if r.end < r.start:
        raise ValueError(f"{where}.end must be >= start, got end={r.end!r} < start={r.start!r}")
    if not isinstance(r.chunk_times, (list, tuple)):
        raise TypeError(f"{where}.chunk_times must be a list of floats, got {type(r.chunk_times).__name__}")
    prev = r.start
    for i, t in enumerate(r.chunk_times):
        if not _is_number(t) or not math.isfinite(t):
            raise ValueError(f"{where}.chunk_times[{i}] must be a finite number, got {t!r}")
        if t < prev:
            what = "start" if i == 0 else f"chunk_times[{i - 1}]={prev!r}"
            raise ValueError(f"{where}.chunk_times must be sorted and >= start: chunk_times[{i}]={t!r} < {what}")
        prev = t
    if r.chunk_times and r.chunk_times[-1] > r.end:
        raise ValueError(f"{where}.chunk_times[-1]={r.chunk_times[-1]!r} is after end={r.end!r}")
    for name in ("prompt_tokens", "output_tokens"):
        v = getattr(r, name)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{where}.{name} must be an int >= 0, got {v!r}")
    if not isinstance(r.success, bool):
        raise TypeError(f"{where}.success must be a bool, got {r.success!r}")
    if r.success and not r.chunk_times:
        # vLLM marks such a response failed: "Never received a valid chunk to calculate TTFT".
        raise ValueError(f"{where}: a successful request needs at least one chunk time (its TTFT), got none")


def ttft(r: RequestRecord) -> float:
    """Time to first token, seconds: the first output chunk's arrival - start."""
    return r.chunk_times[0] - r.start


def itls(r: RequestRecord) -> list[float]:
    """Inter-token latencies, seconds: the gaps between consecutive output chunks (TTFT is not one)."""
    return [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]


def e2el(r: RequestRecord) -> float:
    """End-to-end latency, seconds: end - start."""
    return r.end - r.start


def tpot(r: RequestRecord) -> float | None:
    """Time per output token after the first, seconds; None for a request of fewer than 2 tokens."""
    if r.output_tokens <= 1:
        return None
    return (e2el(r) - ttft(r)) / (r.output_tokens - 1)


@dataclass
class LatencyStats:
    """One metric's summary in milliseconds, as vLLM prints it."""
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: dict[float, float] = field(default_factory=dict)


def _stats(values_s: list[float], percentiles: Sequence[float]) -> LatencyStats:
    # vLLM: np.mean(values or 0) * 1000 -- an empty list reads as 0, seconds turned into ms last.
    x = values_s or 0
    return LatencyStats(float(np.mean(x) * 1000), float(np.median(x) * 1000), float(np.std(x) * 1000),
                        {p: float(np.percentile(x, p) * 1000) for p in percentiles})


@dataclass
class BenchmarkMetrics:
    """What `vllm bench serve` reports, over the successful requests (failed ones only counted)."""
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float
    request_throughput: float      # completed / duration
    output_throughput: float       # total_output / duration
    total_token_throughput: float  # (total_input + total_output) / duration
    goodput: float | None          # good requests / duration; None when no SLO was given
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats

    def to_dict(self) -> dict:
        """The figures under the keys of vLLM's result JSON (mean_ttft_ms, p99_itl_ms, ...)."""
        out = {"duration": self.duration, "completed": self.completed, "failed": self.failed,
               "total_input_tokens": self.total_input, "total_output_tokens": self.total_output,
               "request_throughput": self.request_throughput, "request_goodput": self.goodput,
               "output_throughput": self.output_throughput,
               "total_token_throughput": self.total_token_throughput}
        for name in METRIC_NAMES:
            s: LatencyStats = getattr(self, name)
            out[f"mean_{name}_ms"] = s.mean_ms
            out[f"median_{name}_ms"] = s.median_ms
            out[f"std_{name}_ms"] = s.std_ms
            for p, v in s.percentiles_ms.items():
                out[f"p{_p_word(p)}_{name}_ms"] = v
        return out


def _p_word(p: float) -> str:
    # vLLM: 99 -> "99", 99.9 -> "99.9".
    return str(int(p)) if int(p) == p else str(p)


def parse_goodput(spec: list[str] | str) -> dict[str, float]:
    """`"ttft:500 tpot:50"` or `["ttft:500", "e2el:2000"]` -> {"ttft": 500.0, ...} (milliseconds)."""
    if isinstance(spec, str):
        spec = spec.split()
    if not isinstance(spec, (list, tuple)):
        raise TypeError(f"goodput must be a str or a list of 'NAME:MS' strings, got {type(spec).__name__}")
    out: dict[str, float] = {}
    for pair in spec:
        parts = pair.split(":") if isinstance(pair, str) else []
        try:
            value = float(parts[1]) if len(parts) == 2 else None
        except ValueError:
            value = None
        if value is None:
            raise ValueError(f"goodput: {pair!r} is not NAME:MS (a metric name and a number of milliseconds),"
                             f" e.g. 'ttft:500'")
        out[parts[0]] = value
    _check_slos(out)
    return out


def _check_slos(slos: dict[str, float]) -> None:
    if not isinstance(slos, dict):
        raise TypeError(f"goodput_slos must be a dict like {{'ttft': 500.0}}, got {type(slos).__name__}")
    for name, value in slos.items():
        if name not in SLO_NAMES:
            raise ValueError(f"goodput SLO name {name!r} is unknown; allowed: {', '.join(SLO_NAMES)}")
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            raise ValueError(f"goodput SLO {name} must be a finite number of ms >= 0, got {value!r}")


def calculate_metrics(records: Sequence[RequestRecord], duration: float,
                      goodput_slos: dict[str, float] | None = None,
                      percentiles: Sequence[float] = (50, 90, 99)) -> BenchmarkMetrics:
    """vLLM's `calculate_metrics` over recorded requests; `duration` is the benchmark's wall time (s)."""
    if not _is_number(duration) or not math.isfinite(duration) or duration <= 0:
        raise ValueError(f"duration must be a finite number of seconds > 0, got {duration!r}")
    for p in percentiles:
        if not _is_number(p) or not 0 <= p <= 100:
            raise ValueError(f"percentiles must be numbers in 0..100, got {p!r} in {list(percentiles)!r}")
    if goodput_slos is not None:
        _check_slos(goodput_slos)
    for i, r in enumerate(records):
        if not isinstance(r, RequestRecord):
            raise TypeError(f"records[{i}] must be a RequestRecord, got {type(r).__name__}")
        check_record(r, f"records[{i}]")

    done = [r for r in records if r.success]
    ttfts = [ttft(r) for r in done]
    e2els = [e2el(r) for r in done]
    tpots = [t for t in map(tpot, done) if t is not None]
    pooled_itls = [gap for r in done for gap in itls(r)]
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)

    goodput = None
    if goodput_slos:
        # A one-token request has TPOT 0 against the SLO (vLLM's all_tpots); SLOs are in ms.
        def good(r: RequestRecord) -> bool:
            value = {"ttft": ttft(r), "tpot": tpot(r) or 0.0, "e2el": e2el(r)}
            return all(value[name] <= slo / 1000 for name, slo in goodput_slos.items())
        goodput = sum(map(good, done)) / duration

    return BenchmarkMetrics(
        completed=len(done), failed=len(records) - len(done), total_input=total_input,
        total_output=total_output, duration=float(duration),
        request_throughput=len(done) / duration, output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration, goodput=goodput,
        ttft=_stats(ttfts, percentiles), tpot=_stats(tpots, percentiles),
        itl=_stats(pooled_itls, percentiles), e2el=_stats(e2els, percentiles))


def format_metrics(m: BenchmarkMetrics) -> str:
    """The table `vllm bench serve` prints, one figure a line."""
    row = "{:<40} {:<10}".format
    rowf = "{:<40} {:<10.2f}".format
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             row("Successful requests:", m.completed), row("Failed requests:", m.failed),
             rowf("Benchmark duration (s):", m.duration), row("Total input tokens:", m.total_input),
             row("Total generated tokens:", m.total_output),
             rowf("Request throughput (req/s):", m.request_throughput)]
    if m.goodput is not None:
        lines.append(rowf("Request goodput (req/s):", m.goodput))
    lines += [rowf("Output token throughput (tok/s):", m.output_throughput),
              rowf("Total token throughput (tok/s):", m.total_token_throughput)]
    for attr, short, header in _SECTIONS:
        s: LatencyStats = getattr(m, attr)
        lines += ["{s:{c}^{n}}".format(s=header, n=50, c="-"),
                  rowf(f"Mean {short} (ms):", s.mean_ms), rowf(f"Median {short} (ms):", s.median_ms)]
        lines += [rowf(f"P{_p_word(p)} {short} (ms):", v) for p, v in s.percentiles_ms.items()]
    lines.append("=" * 50)
    return "\n".join(line.rstrip() for line in lines)  # vLLM pads to 10 columns; drop the trailing blanks

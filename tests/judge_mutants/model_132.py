"""A solution of exercise 132 written from its statement: plain Python, no numpy.

The judge compares it with nano_engine.benchmarks.metrics, which uses numpy: passing shows that the
statement's definitions (linear percentiles, population std) pin the figures down.
"""

import math


def ttft(r):
    return r.chunk_times[0] - r.start


def itls(r):
    return [r.chunk_times[i] - r.chunk_times[i - 1] for i in range(1, len(r.chunk_times))]


def e2el(r):
    return r.end - r.start


def tpot(r):
    if r.output_tokens < 2:
        return None
    return (e2el(r) - ttft(r)) / (r.output_tokens - 1)


def percentile(values, p):
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def _summary(name, values, percentiles, out):
    xs = values or [0.0]  # an empty list reads as 0
    mean = sum(xs) / len(xs)
    out[f"mean_{name}_ms"] = mean * 1000
    out[f"median_{name}_ms"] = percentile(xs, 50) * 1000
    out[f"std_{name}_ms"] = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) * 1000
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = percentile(xs, p) * 1000


def is_good(r, slos):
    value = {"ttft": ttft(r), "tpot": tpot(r) or 0.0, "e2el": e2el(r)}
    return all(value[name] <= slo / 1000 for name, slo in slos.items())


def request_throughput(done, records, duration):
    return len(done) / duration


def benchmark_duration(records, duration):
    return duration


def calculate_metrics(records, duration, goodput_slos=None, percentiles=(50, 90, 99)):
    duration = benchmark_duration(records, duration)
    done = [r for r in records if r.success]
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    out = {"duration": duration, "completed": len(done), "failed": len(records) - len(done),
           "total_input_tokens": total_input, "total_output_tokens": total_output,
           "request_throughput": request_throughput(done, records, duration),
           "request_goodput": sum(is_good(r, goodput_slos) for r in done) / duration if goodput_slos else None,
           "output_throughput": total_output / duration,
           "total_token_throughput": (total_input + total_output) / duration}
    _summary("ttft", [ttft(r) for r in done], percentiles, out)
    _summary("tpot", [tpot(r) for r in done if tpot(r) is not None], percentiles, out)
    _summary("itl", [gap for r in done for gap in itls(r)], percentiles, out)
    _summary("e2el", [e2el(r) for r in done], percentiles, out)
    return out

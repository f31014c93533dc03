"""Exercise 132: serving metrics from a recorded trace. Edit this file, then run

    python practice/judge.py 132

The statement is in README.md. Each request of a benchmark run is a record (times in seconds, any
one clock):

    r.start          when the request was sent
    r.chunk_times    when each streamed chunk that carried output arrived (sorted; empty if it failed)
    r.end            when the response was complete
    r.prompt_tokens, r.output_tokens
    r.success        False for a request that failed (r.error says why)

(`nano_engine.benchmarks.metrics.RequestRecord`.) The judge gives only successful records to the
first four functions. Write `percentile` yourself: `numpy.percentile` is what it must agree with,
so use numpy to check your answers, not to give them.
"""


def ttft(r) -> float:
    """Time to first token, in seconds."""
    raise NotImplementedError


def itls(r) -> list[float]:
    """The inter-token latencies of one request, in seconds, in order."""
    raise NotImplementedError


def e2el(r) -> float:
    """End-to-end latency, in seconds."""
    raise NotImplementedError


def tpot(r) -> float | None:
    """Time per output token after the first, in seconds; None when it is not defined."""
    raise NotImplementedError


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0 <= p <= 100) of values (not sorted, at least one), interpolated linearly."""
    raise NotImplementedError


def calculate_metrics(records, duration: float, goodput_slos: dict[str, float] | None = None,
                      percentiles=(50, 90, 99)) -> dict:
    """The figures `vllm bench serve` reports for these records, as a dict with vLLM's key names.

    duration: the benchmark's wall time in seconds. goodput_slos: e.g. {"ttft": 500, "tpot": 50}
    (milliseconds), or None. See README.md for every key.
    """
    raise NotImplementedError

"""A load generator for any OpenAI-compatible server: `python -m nano_engine bench-serve`.

It sends a dataset of streamed requests at a chosen arrival rate and reports what users of a
server feel: time to first token, time per output token, inter-token latency, end-to-end
latency, throughput and goodput. It mirrors `vllm bench serve` so that its numbers and those of
vLLM's client, run against the same server, can be compared:

- `vllm/benchmarks/lib/endpoint_request_func.py`: one streamed request (`stream: true`,
  `stream_options.include_usage`); a timestamp (`time.perf_counter`) for every SSE chunk that has
  `choices` (TTFT is the first, ITL the gaps), output tokens from the last chunk's `usage`; the
  request's end is its last output chunk; any error, an HTTP status other than 200, a dropped
  connection, a response without a chunk, is a failed request, never a crash; so is a stream
  cut before `data: [DONE]` (vLLM's client would count it a success with a short output);
- `vllm/benchmarks/serve.py`: `get_request` (inf sends every request at once; otherwise gaps
  drawn from a gamma distribution of shape `burstiness`, 1 being a Poisson process, rescaled so
  the last request goes out at num_prompts / rate), `--max-concurrency` as a semaphore, warm-ups,
  the result JSON's keys; the metrics are `metrics.calculate_metrics`.

The client is httpx's AsyncClient (no proxy from the environment: it talks to the given URL
only); every request has a total `timeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from datetime import datetime
from typing import Sequence

import httpx
import numpy as np

from .metrics import METRIC_NAMES, BenchmarkMetrics, RequestRecord, calculate_metrics
from .datasets import SampleRequest

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


def sample_intervals(n: int, request_rate: float, burstiness: float = 1.0,
                     rng: np.random.RandomState | None = None) -> np.ndarray:
    """`n` gaps between arrivals, in seconds: gamma(shape=burstiness, scale=1/(rate*burstiness)),
    mean 1/rate and squared coefficient of variation 1/burstiness (1: exponential, a Poisson
    process; below 1 burstier, above 1 more even; inf: every gap exactly 1/rate)."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 requests/s (or inf), got {request_rate!r}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness!r}")
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / request_rate)
    rng = rng if rng is not None else np.random.RandomState(0)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, seconds after the start (vLLM's get_request). The draws are
    vLLM's: the legacy numpy generator seeded with `seed`; the sum is rescaled so that the last
    request leaves at n / rate, which steadies the throughput from one seed to the next."""
    delays = np.cumsum(sample_intervals(n, request_rate, burstiness, np.random.RandomState(seed)))
    if n and delays[-1] > 0:
        delays *= (n / request_rate) / delays[-1]
    return delays.tolist()


def _payload(req: SampleRequest, backend: str, model: str, ignore_eos: bool, extra_body: dict | None) -> dict:
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if backend == "openai":
        body.update(prompt=req.prompt, max_tokens=req.expected_output_len)
    else:
        body.update(messages=[{"role": "user", "content": req.prompt}],
                    max_completion_tokens=req.expected_output_len)
    if ignore_eos or req.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extra sampling parameter: a fixed amount of work
    return body | (extra_body or {})


def _error_text(status: int, body: bytes) -> str:
    try:  # OpenAI's shape: {"error": {"message": ...}}
        message = json.loads(body)["error"]["message"]
    except Exception:
        message = body.decode(errors="replace")[:200]
    return f"HTTP {status}: {' '.join(str(message).split())}"


def _usage_count(usage: dict, key: str, default):
    """A token count from a usage chunk: `default` where it is absent or null; a ValueError (the
    request fails, the run goes on) for anything but a whole number >= 0."""
    value = usage.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"the usage chunk's {key} is {value!r}, not a count of tokens")
    return value


async def send_request(client: httpx.AsyncClient, api_url: str, backend: str, payload: dict,
                       prompt_len: int, timeout: float) -> tuple[RequestRecord, str]:
    """Send one streamed request; return its timestamps and the generated text. Never raises
    for what the server or the network does: that is a failed record with the error."""
    start = time.perf_counter()
    chunk_times: list[float] = []
    text: list[str] = []
    prompt_tokens, output_tokens, error, done = prompt_len, None, "", False
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", api_url, json=payload) as response:
                if response.status_code != 200:
                    error = _error_text(response.status_code, await response.aread())
                else:
                    async for line in response.aiter_lines():
                        # Blank lines end an event; ": ..." lines are SSE comments (keep-alive pings).
                        if not line.startswith("data:"):
                            continue
                        if (data := line[5:].strip()) == "[DONE]":
                            done = True  # the end of an OpenAI stream: nothing after it counts
                            break
                        now = time.perf_counter()
                        chunk = json.loads(data)
                        if choices := chunk.get("choices"):
                            # A chunk with choices is one step of output, even with empty text
                            # (a special token, bytes held back by the detokenizer): vLLM counts it.
                            chunk_times.append(now)
                            piece = choices[0].get("text") if backend == "openai" else \
                                (choices[0].get("delta") or {}).get("content")
                            text.append(piece or "")
                        elif usage := chunk.get("usage"):
                            output_tokens = _usage_count(usage, "completion_tokens", None)
                            prompt_tokens = _usage_count(usage, "prompt_tokens", prompt_tokens)
                        elif err := chunk.get("error"):  # an error reported mid-stream
                            error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    if not chunk_times and not error:
                        error = "the stream ended without an output chunk (no TTFT)"
                    elif not done and not error:
                        # vLLM's client would count it; a stream cut before [DONE] lost its tail.
                        error = "the stream ended before data: [DONE] (cut short)"
    except TimeoutError:
        error = f"no complete response within the timeout of {timeout:g} s"
    except Exception as e:  # a dropped connection, a refused one, a chunk that is not JSON
        error = f"{type(e).__name__}: {' '.join(str(e).split()) or '(no message)'}"
    if error:
        end = max([time.perf_counter(), *chunk_times])
        return RequestRecord(start, chunk_times, end, int(prompt_len), 0, False, error), "".join(text)
    # Without a usage chunk, or with 0 tokens in it (vLLM's client then counts them itself), one token
    # per chunk (what vLLM's and our server send).
    n_out = output_tokens or len(chunk_times)
    return RequestRecord(start, chunk_times, chunk_times[-1], int(prompt_tokens), n_out), "".join(text)


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The id of the first model that GET /v1/models lists (vLLM's get_first_model_from_server)."""
    url = f"{base_url}/v1/models"
    try:
        response = await client.get(url)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except Exception as e:
        raise RuntimeError(f"cannot read the first model from {url} ({type(e).__name__}: "
                           f"{' '.join(str(e).split())}); is the server running? or pass --model") from None


def _check(requests, backend, request_rate, burstiness, max_concurrency, num_warmups, timeout):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not isinstance(requests, (list, tuple)) or not requests:
        raise ValueError(f"requests must be a non-empty list of SampleRequest, got {requests!r:.80}")
    if not all(isinstance(r, SampleRequest) for r in requests):
        raise TypeError("requests must hold SampleRequest objects (see benchmarks.datasets.get_samples)")
    sample_intervals(0, request_rate, burstiness)  # checks both
    if max_concurrency is not None and (isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int)
                                        or max_concurrency < 1):
        raise ValueError(f"max_concurrency must be None or an integer >= 1, got {max_concurrency!r}")
    if isinstance(num_warmups, bool) or not isinstance(num_warmups, int) or num_warmups < 0:
        raise ValueError(f"num_warmups must be an integer >= 0, got {num_warmups!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")


async def measure(requests: Sequence[SampleRequest], base_url: str = "http://127.0.0.1:8000", *,
                  backend: str = "openai", model: str | None = None, request_rate: float = math.inf,
                  burstiness: float = 1.0, max_concurrency: int | None = None, num_warmups: int = 0,
                  ignore_eos: bool = False, seed: int = 0, goodput: dict | None = None,
                  percentiles: Sequence[float] = (90, 99), percentile_metrics: Sequence[str] = METRIC_NAMES,
                  timeout: float = 600.0, disable_tqdm: bool = False,
                  extra_body: dict | None = None) -> tuple[dict, BenchmarkMetrics]:
    """run_benchmark's result, and the metrics it holds as one object (for format_metrics)."""
    from tqdm.auto import tqdm

    _check(requests, backend, request_rate, burstiness, max_concurrency, num_warmups, timeout)
    base_url = base_url.rstrip("/")
    api_url = base_url + BACKENDS[backend]
    # No pool limit of httpx's own (a request waiting for a connection would count in its TTFT);
    # --max-concurrency bounds the connections. trust_env=False: no proxy between us and the URL.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, pool=None),
                                 trust_env=False) as client:
        model = model or await first_model(client, base_url)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

        async def limited(req: SampleRequest, bar) -> tuple[RequestRecord, str]:
            async with gate:
                out = await send_request(client, api_url, backend, _payload(req, backend, model, ignore_eos,
                                                                             extra_body), req.prompt_len, timeout)
            if bar is not None:
                bar.update(1)
            return out

        if num_warmups:  # the first prompt, as vLLM warms up; their figures are dropped
            await asyncio.gather(*(limited(requests[0], None) for _ in range(num_warmups)))

        times = arrival_times(len(requests), request_rate, burstiness, seed)
        bar = None if disable_tqdm else tqdm(total=len(requests), desc="requests")
        tasks: list[asyncio.Task] = []
        start = time.perf_counter()
        try:
            for req, at in zip(requests, times):
                if (wait := start + at - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(limited(req, bar)))
            outputs = await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # an interrupted run leaves no request behind
                t.cancel()
            if bar is not None:
                bar.close()
        duration = time.perf_counter() - start

    records = [r for r, _ in outputs]
    metrics = calculate_metrics(records, duration, goodput or None, [float(p) for p in percentiles])
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend,
              "backend": backend, "model_id": model, "num_prompts": len(requests),
              "request_rate": request_rate if math.isfinite(request_rate) else "inf",
              "burstiness": burstiness, "max_concurrency": max_concurrency}
    for key, value in metrics.to_dict().items():  # vLLM stores the selected metrics only
        name = key.rsplit("_", 2)[-2] if key.endswith("_ms") else None
        if name is None or name in percentile_metrics:
            result[key] = value
    result.update(
        input_lens=[r.prompt_tokens for r in records], output_lens=[r.output_tokens for r in records],
        ttfts=[r.chunk_times[0] - r.start if r.success else 0.0 for r in records],
        itls=[[b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])] if r.success else [] for r in records],
        latencies=[r.end - r.start if r.success else 0.0 for r in records],
        start_times=[r.start - start for r in records], errors=[r.error for r in records],
        generated_texts=[text for _, text in outputs])
    return result, metrics


async def run_benchmark(requests: Sequence[SampleRequest], base_url: str = "http://127.0.0.1:8000",
                        **kwargs) -> dict:
    """Send `requests` to `base_url` (streamed, at `request_rate`, at most `max_concurrency` at
    once) and return the result under vLLM's keys: the settings, the metrics of
    benchmarks/metrics.py (those of `percentile_metrics` only, as vLLM), and per request
    input_lens, output_lens, ttfts, itls, latencies, start_times (s after the start), errors,
    generated_texts. Keyword arguments: see `measure`."""
    return (await measure(requests, base_url, **kwargs))[0]


def benchmark(requests: Sequence[SampleRequest], base_url: str = "http://127.0.0.1:8000", **kwargs) -> dict:
    """run_benchmark from plain code; in Jupyter, whose loop is already running, in a thread."""
    def run() -> dict:
        return asyncio.run(run_benchmark(requests, base_url, **kwargs))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()

"""The server's /metrics: Prometheus text, with vLLM's metric names, so dashboards made for vLLM read it.

Two kinds of figures, as in vLLM's `vllm/v1/metrics/loggers.py` (PrometheusStatLogger):
* state read when Prometheus scrapes (a custom collector): requests running and waiting, the KV
  cache's usage, preemptions and prefix-cache lookups so far;
* per-request latencies observed as tokens come out (histograms): time to first token, the gap
  between tokens, end-to-end latency, plus token and finished-request counters;
* each finished request's breakdown (vLLM's FinishedRequestStats): time queued (arrival to its
  first step), in prefill (first step to first token), in decode (first to last token), running
  (first step to last token), per output token after the first, and its prompt and generated
  token counts; and the tokens of each engine step (vllm:iteration_tokens_total).
Each server has its own registry (two servers in one test process do not share figures).
The collector reads lengths and counters that the engine thread writes: each read is one Python
attribute or len(), so a scrape sees a consistent-enough instant without locking the engine.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .async_llm import AsyncLLM, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets (loggers.py), in seconds.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0]  # also the queue, prefill, decode and inference times
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets, for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _EngineState:
    """Figures read from the engine at scrape time."""

    def __init__(self, llm: AsyncLLM, model_name: str):
        self.llm, self.labels = llm, {"model_name": model_name, "engine": "0"}

    def _gauge(self, name, doc, value):
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name, doc, value):
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self):
        engine = self.llm.engine
        sched, pool = engine.scheduler, engine.block_pool
        yield self._gauge("vllm:num_requests_running", "Requests in the running queue.", len(sched.running))
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", len(sched.waiting))
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                          1.0 - pool.num_free / pool.num_blocks)
        yield self._counter("vllm:num_preemptions", "Preemptions so far.", engine.stats.preemptions)
        yield self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            getattr(sched, "prefix_cache_queries", 0))
        yield self._counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            getattr(sched, "prefix_cache_hits", 0))
        if engine.config.speculative_config is not None:  # vLLM's spec_decode metrics
            stats = engine.stats
            yield self._counter("vllm:spec_decode_num_drafts", "Verifications of a request's drafts.",
                                stats.spec_num_drafts)
            yield self._counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                stats.spec_num_draft_tokens)
            yield self._counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                stats.spec_num_accepted_tokens)
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by their position among the drafts.",
                                          labels=[*self.labels, "position"])
            for pos, n in enumerate(stats.spec_accepted_per_pos):
                per_pos.add_metric([*self.labels.values(), str(pos)], n)
            yield per_pos


class ServingMetrics:
    """The registry behind GET /metrics; `observe` is the AsyncLLM's on_output hook."""

    def __init__(self, model_name: str, max_model_len: int = 8192):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "engine"]
        self._values = (model_name, "0")
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two output tokens.", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             labels, buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               labels + ["finished_reason"], registry=r)
        def seconds(name, doc, buckets=E2E_BUCKETS):
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.queue_time = seconds("vllm:request_queue_time_seconds", "Time waiting, arrival to first step.")
        self.prefill_time = seconds("vllm:request_prefill_time_seconds", "Time in prefill, first step to first token.")
        self.decode_time = seconds("vllm:request_decode_time_seconds", "Time in decode, first to last token.")
        self.inference_time = seconds("vllm:request_inference_time_seconds", "Time running, first step to last token.")
        self.tpot = seconds("vllm:request_time_per_output_token_seconds",
                            "A request's decode time per output token after the first.", ITL_BUCKETS)
        counts = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.",
                                               labels, buckets=counts, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per finished request.", labels, buckets=counts,
                                                   registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens computed per engine step.", labels,
                                          buckets=ITERATION_BUCKETS, registry=r)
        self._last_token: dict[str, float] = {}  # request id -> time of its latest token
        self._first_token: dict[str, float] = {}  # request id -> time of its first token

    def attach(self, llm: AsyncLLM) -> None:
        self.registry.register(_EngineState(llm, self.model_name))
        llm.subscribe(self.observe)
        llm.subscribe_steps(self.observe_step)

    def observe_step(self, num_tokens: int) -> None:
        self.iteration_tokens.labels(*self._values).observe(num_tokens)

    def observe(self, out: RequestOutput) -> None:
        v = self._values
        last = self._last_token.get(out.request_id)
        for t in out.token_times:
            if last is None:
                self.ttft.labels(*v).observe(t - out.arrival_time)
                self._first_token[out.request_id] = t
            else:
                self.itl.labels(*v).observe(t - last)
            last = t
        if out.new_token_ids:
            self.generation_tokens.labels(*v).inc(len(out.new_token_ids))
        if out.finished:
            self._last_token.pop(out.request_id, None)
            first = self._first_token.pop(out.request_id, None)
            self.e2e.labels(*v).observe((last or time.perf_counter()) - out.arrival_time)
            self.prompt_tokens.labels(*v).inc(out.num_prompt_tokens)
            self.success.labels(*v, out.finish_reason or "abort").inc()
            self.request_prompt_tokens.labels(*v).observe(out.num_prompt_tokens)
            self.request_generation_tokens.labels(*v).observe(out.num_output_tokens)
            scheduled = out.first_scheduled_time
            if scheduled is not None:  # it ran (an abort while waiting did not)
                self.queue_time.labels(*v).observe(scheduled - out.arrival_time)
                if first is not None:
                    self.prefill_time.labels(*v).observe(first - scheduled)
                    self.decode_time.labels(*v).observe(last - first)
                    self.inference_time.labels(*v).observe(last - scheduled)
                    if out.num_output_tokens > 1:
                        self.tpot.labels(*v).observe((last - first) / (out.num_output_tokens - 1))
        elif last is not None:
            self._last_token[out.request_id] = last

    def render(self) -> bytes:
        return generate_latest(self.registry)

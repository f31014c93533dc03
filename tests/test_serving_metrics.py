"""serving/metrics.py on its own: hand-made RequestOutputs and a stand-in engine, read back through
prometheus_client's own text parser (test_server.py reads /metrics from a running server)."""

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nano_engine.serving import metrics
from nano_engine.serving.async_llm import RequestOutput
from nano_engine.serving.metrics import ServingMetrics

LABELS = {"model_name": "m", "engine": "0"}
# vLLM's buckets, vllm/v1/metrics/loggers.py (PrometheusStatLogger), in seconds.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_E2E = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0]


def out(rid, times, ids=None, *, arrival, finished=False, reason=None, prompt=4):
    ids = list(range(len(times))) if ids is None else ids
    return RequestOutput(rid, ids, "", times, prompt, 0, 0, arrival, finished, reason)


def families(m: ServingMetrics) -> dict:
    """{family name: family} from the rendered text, parsed as Prometheus itself would."""
    text = m.render()
    assert isinstance(text, bytes)
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def samples(family, suffix="", model="m") -> dict:
    """{extra labels as a sorted tuple: value} of one family's samples named family.name + suffix."""
    got = {}
    for s in family.samples:
        if s.name == family.name + suffix:
            extra = {k: v for k, v in s.labels.items() if k not in LABELS}
            assert {k: s.labels[k] for k in LABELS} == {**LABELS, "model_name": model}
            got[tuple(sorted(extra.items()))] = s.value
    return got


def histogram(family) -> tuple[dict, float, float]:
    buckets = {float(dict(k)["le"]): v for k, v in samples(family, "_bucket").items()}
    return buckets, samples(family, "_count")[()], samples(family, "_sum")[()]


def test_the_names_types_and_content_type_are_vllms():
    assert metrics.CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    m = ServingMetrics("m")
    m.attach(fake_llm())
    f = families(m)
    assert {name: fam.type for name, fam in f.items() if name.startswith("vllm:")} == {
        "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram", "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:num_preemptions": "counter",
        "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
        "vllm:request_queue_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
        "vllm:request_decode_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
        "vllm:request_time_per_output_token_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram", "vllm:iteration_tokens_total": "histogram"}
    assert samples(f["vllm:time_to_first_token_seconds"], "_bucket") == {}  # no sample for a label set never observed


def test_observe_times_first_token_gaps_and_whole_requests():
    m = ServingMetrics("m")
    # a: tokens at 10.5 | 10.75, 11.0 | then a last output with no token: TTFT 0.5, ITL 0.25 0.25, E2E 1.0
    m.observe(out("a", [], arrival=10.0))  # a prefill chunk: nothing yet
    m.observe(out("a", [10.5], arrival=10.0))
    m.observe(out("a", [10.75, 11.0], arrival=10.0))
    m.observe(out("a", [], arrival=10.0))  # a chunk with no token keeps the last token's time
    m.observe(out("a", [], arrival=10.0, finished=True, reason="stop", prompt=5))
    # b: one output with its only token, finished by length: TTFT 0.5, E2E 0.5
    m.observe(out("b", [20.5], [7], arrival=20.0, finished=True, reason="length", prompt=2))
    assert not m._last_token  # finished requests leave no trace (no memory held per past request)

    f = families(m)
    for name, want in (("vllm:time_to_first_token_seconds", VLLM_TTFT), ("vllm:inter_token_latency_seconds", VLLM_ITL),
                       ("vllm:e2e_request_latency_seconds", VLLM_E2E)):
        assert sorted(histogram(f[name])[0]) == want + [float("inf")]  # the buckets drawn are vLLM's
    buckets, count, total = histogram(f["vllm:time_to_first_token_seconds"])
    assert (count, total) == (2, 1.0) and buckets[0.25] == 0 and buckets[0.5] == 2 and buckets[float("inf")] == 2
    buckets, count, total = histogram(f["vllm:inter_token_latency_seconds"])
    assert (count, total) == (2, 0.5) and buckets[0.2] == 0 and buckets[0.3] == 2
    buckets, count, total = histogram(f["vllm:e2e_request_latency_seconds"])
    assert (count, total) == (2, 1.5) and buckets[0.3] == 0 and buckets[0.5] == 1 and buckets[1.0] == 2
    assert samples(f["vllm:generation_tokens"], "_total") == {(): 4}
    assert samples(f["vllm:prompt_tokens"], "_total") == {(): 7}
    assert samples(f["vllm:request_success"], "_total") == {(("finished_reason", "stop"),): 1,
                                                              (("finished_reason", "length"),): 1}


def test_a_request_aborted_before_its_first_token_ends_now(monkeypatch):
    m = ServingMetrics("m")
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: 33.0)
    m.observe(out("c", [], arrival=30.0, finished=True, reason=None, prompt=3))
    f = families(m)
    buckets, count, total = histogram(f["vllm:e2e_request_latency_seconds"])
    assert (count, total) == (1, 3.0) and buckets[2.5] == 0 and buckets[5.0] == 1
    assert samples(f["vllm:request_success"], "_total") == {(("finished_reason", "abort"),): 1}
    assert samples(f["vllm:time_to_first_token_seconds"], "_count") == {}  # no token: no TTFT
    assert samples(f["vllm:prompt_tokens"], "_total") == {(): 3}
    assert samples(f["vllm:generation_tokens"], "_total") == {}  # never counted


def fake_llm(spec=None, **scheduler):
    sched = SimpleNamespace(running=[1, 2], waiting=[3, 4, 5], **scheduler)
    stats = SimpleNamespace(preemptions=6, spec_num_drafts=5, spec_num_draft_tokens=15, spec_num_accepted_tokens=9,
                            spec_accepted_per_pos=[5, 3, 1])
    engine = SimpleNamespace(scheduler=sched, block_pool=SimpleNamespace(num_free=3, num_blocks=12),
                             stats=stats, config=SimpleNamespace(speculative_config=spec))
    listeners, steps = [], []
    return SimpleNamespace(engine=engine, listeners=listeners, subscribe=listeners.append, steps=steps,
                           subscribe_steps=steps.append)


@pytest.mark.parametrize("prefix, queries, hits", [({"prefix_cache_queries": 40, "prefix_cache_hits": 16}, 40, 16),
                                                   ({}, 0, 0)])  # a scheduler without a prefix cache: 0
def test_the_engines_state_is_read_at_scrape_time(prefix, queries, hits):
    m, llm = ServingMetrics("smol"), fake_llm(**prefix)
    m.attach(llm)
    assert llm.listeners == [m.observe]  # every output reaches the histograms

    def state():
        f = families(m)
        return {name: (s.name, s.value) for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                     "vllm:kv_cache_usage_perc", "vllm:num_preemptions",
                                                     "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
                for s in f[name].samples if s.labels == {"model_name": "smol", "engine": "0"}}

    assert state() == {
        "vllm:num_requests_running": ("vllm:num_requests_running", 2),
        "vllm:num_requests_waiting": ("vllm:num_requests_waiting", 3),
        "vllm:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", 0.75),
        "vllm:num_preemptions": ("vllm:num_preemptions_total", 6),
        "vllm:prefix_cache_queries": ("vllm:prefix_cache_queries_total", queries),
        "vllm:prefix_cache_hits": ("vllm:prefix_cache_hits_total", hits),
    }
    llm.engine.scheduler.running.append(9)  # read when scraped, not when attached
    llm.engine.block_pool.num_free = 12
    now = state()
    assert now["vllm:num_requests_running"][1] == 3 and now["vllm:kv_cache_usage_perc"][1] == 0


def test_two_servers_keep_their_own_figures():
    a, b = ServingMetrics("a"), ServingMetrics("b")
    a.observe(out("x", [1.5], arrival=1.0, finished=True, reason="stop"))
    assert samples(families(a)["vllm:request_success"], "_total", "a") == {(("finished_reason", "stop"),): 1}
    assert samples(families(b)["vllm:request_success"], "_total", "b") == {}


def test_a_finished_request_is_broken_down_into_queue_prefill_and_decode():
    """vLLM's FinishedRequestStats: arrival 10.0, first step 10.25, tokens at 10.5, 10.75, 11.5 (3 of them)."""
    m, llm = ServingMetrics("m", max_model_len=100), fake_llm()
    m.attach(llm)
    scheduled = dict(first_scheduled_time=10.25)
    m.observe(RequestOutput("a", [1], "", [10.5], 4, 0, 1, 10.0, **scheduled))
    m.observe(RequestOutput("a", [2, 3], "", [10.75, 11.5], 4, 0, 3, 10.0, True, "stop", **scheduled))
    m.observe(RequestOutput("b", [], "", [], 7, 0, 0, 12.0, True, "abort"))  # aborted while waiting: never ran
    f = families(m)
    for name, count, total in (("queue_time", 1, 0.25), ("prefill_time", 1, 0.25), ("decode_time", 1, 1.0),
                               ("inference_time", 1, 1.25), ("time_per_output_token", 1, 0.5)):
        _, n, s = histogram(f[f"vllm:request_{name}_seconds"])
        assert (n, s) == (count, pytest.approx(total)), name
    buckets, n, s = histogram(f["vllm:request_prompt_tokens"])
    assert sorted(buckets) == [1, 2, 5, 10, 20, 50, 100, float("inf")] and (n, s) == (2, 11)
    assert histogram(f["vllm:request_generation_tokens"])[1:] == (2, 3)
    for tokens in (64, 3, 200):  # each engine step's tokens, as AsyncLLM hands them to its step listeners
        for listener in llm.steps:
            listener(tokens)
    buckets, n, s = histogram(families(m)["vllm:iteration_tokens_total"])
    assert (n, s) == (3, 267) and buckets[64.0] == 2 and buckets[8.0] == 1
    assert not m._first_token and not m._last_token


def test_speculation_adds_vllms_spec_decode_counters():
    m = ServingMetrics("m")
    m.attach(fake_llm(spec=object()))  # a speculative engine
    f = families(m)
    assert [samples(f[f"vllm:spec_decode_num_{name}"], "_total")[()] for name in
            ("drafts", "draft_tokens", "accepted_tokens")] == [5, 15, 9]
    assert samples(f["vllm:spec_decode_num_accepted_tokens_per_pos"], "_total") == {
        (("position", "0"),): 5, (("position", "1"),): 3, (("position", "2"),): 1}
    plain = ServingMetrics("m")
    plain.attach(fake_llm())
    assert not any(name.startswith("vllm:spec_decode") for name in families(plain))

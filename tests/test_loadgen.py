"""The load generator (nano_engine/benchmarks/: serve.py, datasets.py, sweep.py) and its command
line (nano_engine/cli/bench_serve.py) against a fake OpenAI-compatible server.

The fake server is a FastAPI app under uvicorn on 127.0.0.1 (a free port), in its own thread, that
streams scripted SSE chunks with scripted delays, then a usage chunk and `data: [DONE]`; it counts
the requests in flight and can hold them until a number are in at once. It is always stopped (a
context manager; the fixture checks its thread has ended). What a server can do wrong (an error status, a stream
cut short or carrying an error, a dropped connection) is answered in-process by httpx's
MockTransport. Timing assertions are inequalities against the scripted delays, never tight.
"""

import asyncio
import contextlib
import json
import math
import re
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from nano_engine.benchmarks import datasets, serve
from nano_engine.benchmarks.datasets import SampleRequest, get_samples
from nano_engine.benchmarks.serve import arrival_times, run_benchmark
from nano_engine.benchmarks.sweep import plot_sweep, sweep, sweep_table
from nano_engine.cli import bench_serve
from in_process import serving
from tiny_files import save_tokenizer

PREFIX = "python -m nano_engine bench-serve: error: "


class FakeServer:
    """GET /v1/models, and POST /v1/completions and /v1/chat/completions streamed as scripted: each
    (delay, text) chunk, a usage chunk, data: [DONE]. A FastAPI app under uvicorn, in a thread."""

    def __init__(self, chunks=((0.0, "a"), (0.0, "b")), usage_tokens=2, hold_until=0, root=None):
        self.chunks, self.usage_tokens, self.hold_until, self.root = list(chunks), usage_tokens, hold_until, root
        self.bodies, self.in_flight, self.peak = [], 0, 0

    def app(self):
        app, released = FastAPI(), asyncio.Event()
        app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "fake-model", "object": "model",
                                                                   **({"root": self.root} if self.root else {})}]})

        @app.post("/v1/{endpoint:path}")
        async def stream(endpoint: str, request: Request):
            body, chat = await request.json(), endpoint == "chat/completions"
            self.bodies.append(body)

            async def events():
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
                try:
                    if self.peak >= self.hold_until:
                        released.set()
                    with contextlib.suppress(TimeoutError):  # hold until `hold_until` were in flight at once
                        await asyncio.wait_for(released.wait(), 10)
                    for delay, text in self.chunks:
                        await asyncio.sleep(delay)
                        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                        yield f"data: {json.dumps({'object': 'chunk', 'choices': [choice]})}\n\n"
                    usage = {"prompt_tokens": 7 if chat else len(body["prompt"]),
                             "completion_tokens": self.usage_tokens}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
                finally:
                    self.in_flight -= 1

            return StreamingResponse(events(), media_type="text/event-stream")
        return app

    def __enter__(self):
        self._serving = serving(self.app(), timeout_graceful_shutdown=1)
        self.url = self._serving.__enter__()
        return self

    def __exit__(self, *exc):
        self._serving.__exit__(*exc)


@pytest.fixture
def fake():
    """Start FakeServer(**script) in a `with`; afterwards check every one was stopped."""
    servers = []

    def start(**script):
        servers.append(FakeServer(**script))
        return servers[-1]

    yield start
    assert all(not s.thread.is_alive() for s in servers if hasattr(s, "thread")), "a fake server still runs"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A word-level tokenizer: 15 ids, of which 0-2 are special (<unk>, <s>, </s>)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    save_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def reqs(n, prompt_len=3, output_len=4):
    return [SampleRequest(list(range(3, 3 + prompt_len)), prompt_len, output_len) for _ in range(n)]


def bench(server, requests, **kw):
    kw.setdefault("disable_tqdm", True)
    return asyncio.run(run_benchmark(requests, server.url, **kw))


# ----- one streamed request: chunks, tokens, TTFT, ITL -----

def test_streamed_request_records_chunks_usage_tokens_and_plausible_latencies(fake):
    with fake(chunks=[(0.05, "Hel"), (0.1, "lo"), (0.1, " world")], usage_tokens=5) as s:
        r = bench(s, reqs(1, prompt_len=6))
    assert (r["completed"], r["failed"], r["errors"]) == (1, 0, [""])
    assert r["model_id"] == "fake-model"  # the first of GET /v1/models
    assert r["generated_texts"] == ["Hello world"]
    assert r["output_lens"] == [5] and r["input_lens"] == [6]  # from the usage chunk, not the 3 chunks
    (ttft,), (itl,), (e2el,) = r["ttfts"], r["itls"], r["latencies"]
    assert len(itl) == 2  # 3 chunks with text: 2 gaps; the usage chunk is not a chunk
    assert 0.05 <= ttft < 5 and all(0.05 <= gap < 5 for gap in itl)
    assert e2el >= ttft + sum(itl) - 1e-9 and e2el >= 0.25
    assert r["mean_tpot_ms"] == pytest.approx((e2el - ttft) / 4 * 1000)
    assert r["mean_ttft_ms"] == pytest.approx(ttft * 1000)
    assert s.bodies == [{"model": "fake-model", "prompt": [3, 4, 5, 6, 7, 8], "max_tokens": 4, "stream": True,
                         "stream_options": {"include_usage": True}}]  # no ignore_eos unless asked


def test_chat_backend_sends_text_messages_and_reads_deltas(fake):
    with fake(chunks=[(0, "Hi"), (0, "!")]) as s:
        r = bench(s, [SampleRequest("hello there", 2, 3, ignore_eos=True)], backend="openai-chat")
    body = s.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    assert body["max_completion_tokens"] == 3 and body["ignore_eos"] is True
    assert r["generated_texts"] == ["Hi!"] and r["input_lens"] == [7]  # the server's count wins


def sse(*events: str) -> bytes:
    return "".join(f"{e}\n\n" for e in events).encode()


def send(handler):
    """One request through serve.send_request, answered in-process by `handler`."""
    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await serve.send_request(client, "http://h/v1/completions", "openai", {"model": "m"}, 3, 5)

    return asyncio.run(main())


def test_a_stream_is_read_as_sse_and_ends_at_done():
    """Events with and without the space after "data:", a comment, a chunk whose text is empty
    or missing (still one chunk, as vLLM counts it), and nothing after [DONE]."""
    def handler(request):
        assert request.method == "POST" and json.loads(request.content)["model"] == "m"
        chunk = lambda text: json.dumps({"choices": [{"text": text}]})
        body = sse(f"data: {chunk('a')}", ": ping", f"data:{chunk('b')}", f"data: {chunk('')}",
                   'data: {"choices": [{"index": 0}]}', 'data: {"choices": [], "usage": {"completion_tokens": 4}}',
                   "data: [DONE]", f"data: {chunk('late')}")
        return httpx.Response(200, content=body)

    record, text = send(handler)
    assert text == "ab" and record.success and len(record.chunk_times) == 4 and record.output_tokens == 4
    assert record.prompt_tokens == 3  # a usage chunk without prompt_tokens keeps the sent length
    no_usage = sse(*['data: {"choices": [{"text": "x"}]}'] * 3, "data: [DONE]")
    assert send(lambda request: httpx.Response(200, content=no_usage))[0].output_tokens == 3  # a token a chunk


# ----- failures are records, not crashes -----

def test_a_request_past_its_timeout_is_a_failed_record_with_vllms_zeros(fake):
    with fake(chunks=[(0.3, "a")] * 4) as s:  # each gap is within the timeout, the whole is not
        r = bench(s, reqs(2), timeout=0.8)
    assert (r["completed"], r["failed"]) == (0, 2) and all("timeout of 0.8 s" in e for e in r["errors"]), r["errors"]
    assert r["latencies"] == r["ttfts"] == [0.0, 0.0] and r["itls"] == [[], []]


@pytest.mark.parametrize("events, error, text", [
    (['data: {"choices": [{"text": "a"}]}', 'data: {"choices": [{"text": "b"}]}',
      'data: {"error": {"message": "engine died"}}', "data: [DONE]"], "engine died", "ab"),  # what came before is kept
    (['data: {"error": "out of blocks"}', "data: [DONE]"], "out of blocks", ""),
    (['data: {"choices": [{"text": "a"}]}'], "[DONE]", "a"),  # the body ends cleanly, but without data: [DONE]
    (["data: [DONE]"], "no TTFT", ""),
])
def test_an_error_in_the_stream_or_no_chunk_at_all_is_a_failed_record(events, error, text):
    record, got = send(lambda request: httpx.Response(200, content=sse(*events)))
    assert not record.success and error in record.error and record.output_tokens == 0 and got == text


def test_a_usage_chunk_that_is_not_a_count_fails_its_request_alone():
    """A proxy's null, a string, a negative or a NaN count: that request fails naming the field (it
    used to raise out of the whole run); null keeps the sent length, and 0 output tokens counts the chunks."""
    def usage(**fields):
        return sse('data: {"choices": [{"text": "a"}]}', 'data: {"choices": [{"text": "b"}]}',
                   "data: " + json.dumps({"choices": [], "usage": fields}), "data: [DONE]")

    for fields, named in [({"completion_tokens": "abc"}, "completion_tokens is 'abc'"),
                          ({"completion_tokens": -1}, "completion_tokens is -1"),
                          ({"completion_tokens": [2]}, "completion_tokens is [2]"),
                          ({"completion_tokens": 2, "prompt_tokens": True}, "prompt_tokens is True")]:
        record, _ = send(lambda request: httpx.Response(200, content=usage(**fields)))
        assert not record.success and named in record.error, record.error
    record, _ = send(lambda request: httpx.Response(200, content=usage(completion_tokens=2, prompt_tokens=None)))
    assert record.success and (record.prompt_tokens, record.output_tokens) == (3, 2)
    record, _ = send(lambda request: httpx.Response(200, content=usage(completion_tokens=0, prompt_tokens=7)))
    assert record.success and (record.prompt_tokens, record.output_tokens) == (7, 2)
    nan = sse('data: {"choices": [{"text": "a"}]}', 'data: {"choices": [], "usage": {"completion_tokens": NaN}}',
              "data: [DONE]")
    record, _ = send(lambda request: httpx.Response(200, content=nan))
    assert not record.success and "completion_tokens is nan" in record.error


def test_a_server_error_or_a_transport_error_is_one_readable_line():
    record, _ = send(lambda request: httpx.Response(400, json={"error": {"message": "max_tokens\n is too large"}}))
    assert not record.success and record.error == "HTTP 400: max_tokens is too large"  # the server's own message
    record, _ = send(lambda request: httpx.Response(502, content=b"\xff" + b"x" * 300))  # not JSON
    assert not record.success and record.error.startswith("HTTP 502: ") and len(record.error) < 250
    for message in ("a\n   dropped", ""):
        def handler(request):
            raise httpx.ReadError(message, request=request)

        record, _ = send(handler)
        assert not record.success and record.error.startswith("ReadError: ") and "\n" not in record.error
        assert record.error.strip() != "ReadError:"  # an exception without a message still says something


def test_a_server_without_models_names_the_url_and_the_error():
    def handler(request):
        raise httpx.ConnectError("no route", request=request)

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await serve.first_model(client, "http://h:1")

    with pytest.raises(RuntimeError, match=r"http://h:1/v1/models \(ConnectError.*--model"):
        asyncio.run(main())


# ----- arrivals and concurrency -----

@pytest.mark.parametrize("burstiness", [1.0, 0.25])  # 1: a Poisson process; below 1 burstier
def test_arrival_times_follow_vllm(burstiness):
    # vLLM's draws: gaps from gamma(shape=burstiness) of the legacy generator seeded with --seed,
    # cumulated, and rescaled so that the last request leaves at n / rate.
    raw = np.cumsum(np.random.RandomState(3).gamma(burstiness, 1.0, size=50))
    assert np.allclose(arrival_times(50, 10.0, burstiness, seed=3), raw * 5.0 / raw[-1])
    assert arrival_times(5, 2.0, burstiness) == arrival_times(5, 2.0, burstiness, seed=0)  # reproducible by default
    assert arrival_times(3, 100.0, burstiness)[-1] == pytest.approx(0.03)  # rescaled when the draws sum under 1 s too
    assert arrival_times(5, math.inf, burstiness) == [0.0] * 5
    assert arrival_times(4, 2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])  # even arrivals
    for rate, b, field in [(0.0, 1.0, "request_rate"), (1.0, 0, "burstiness")]:
        with pytest.raises(ValueError, match=field):
            arrival_times(3, rate, burstiness=b)


def test_infinite_rate_sends_every_request_at_once(fake):
    # The server holds each request until all 8 are in flight (10 s at most): a client that
    # sent them one after another would reach a peak of 1.
    with fake(hold_until=8) as s:
        r = bench(s, reqs(8))
    assert s.peak == 8 and r["completed"] == 8


def test_finite_rate_spreads_the_requests(fake):
    with fake() as s:
        r = bench(s, reqs(6), request_rate=20.0)
    assert r["completed"] == 6 and max(r["start_times"]) >= 0.25  # the last leaves at 6/20 = 0.3 s
    assert all(0 <= t < 5 for t in r["start_times"]) and 0.25 <= r["duration"] < 30  # seconds since the start


def test_max_concurrency_is_never_exceeded(fake):
    with fake(chunks=[(0.02, "a")] * 3, hold_until=3) as s:
        r = bench(s, reqs(10), max_concurrency=3)
    assert s.peak == 3 and r["completed"] == 10


def test_a_request_waiting_for_a_slot_is_timed_from_when_it_is_sent(fake):
    # As vLLM: the clock starts once the semaphore lets the request go (httpx's own connection
    # pool would also cap concurrency, but its wait would count in the TTFT).
    with fake(chunks=[(0, "a"), (0.1, "b")]) as s:
        r = bench(s, reqs(3), max_concurrency=1)
    spans = sorted(zip(r["start_times"], r["latencies"]))
    assert all(s1 >= s0 + l0 for (s0, l0), (s1, _) in zip(spans, spans[1:]))


def test_one_run_end_to_end_what_it_sends_and_keeps(fake, monkeypatch):
    """Warm-ups repeat the first request and are not counted; no proxy from the environment is
    used; the seed and burstiness reach the arrival times; extra_body reaches every request; the
    result holds the run's settings under vLLM's keys."""
    arrivals, real_arrivals = [], serve.arrival_times
    monkeypatch.setattr(serve, "arrival_times", lambda *args: arrivals.append(args) or real_arrivals(*args))
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # a dead proxy: used, every request would fail
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    requests = [SampleRequest([3 + i, 4], 2, 2) for i in range(3)]
    with fake() as s:
        r = asyncio.run(run_benchmark(requests, s.url + "/", num_warmups=2, max_concurrency=2, request_rate=500.0,
                                      burstiness=2.0, seed=9, timeout=7, extra_body={"temperature": 0.5},
                                      disable_tqdm=True))
    assert r["completed"] == 3 and len(r["ttfts"]) == 3
    assert [b["prompt"] for b in s.bodies[:2]] == [[3, 4]] * 2 and sorted(b["prompt"] for b in s.bodies[2:]) == [
        [3, 4], [4, 4], [5, 4]]
    assert all(b["temperature"] == 0.5 and b["model"] == "fake-model" for b in s.bodies)
    assert arrivals == [(3, 500.0, 2.0, 9)]
    assert {k: r[k] for k in ("backend", "num_prompts", "request_rate", "burstiness", "max_concurrency")} == {
        "backend": "openai", "num_prompts": 3, "request_rate": 500.0, "burstiness": 2.0, "max_concurrency": 2}


def test_measure_with_its_defaults_talks_to_the_local_server_at_once(monkeypatch):
    """No server runs: httpx's MockTransport answers in-process, and records every URL asked."""
    urls, arrivals = [], []
    real_client, real_arrivals = httpx.AsyncClient, serve.arrival_times

    def handler(request):
        urls.append(str(request.url))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, content=sse('data: {"choices": [{"text": "a"}]}', "data: [DONE]"))

    monkeypatch.setattr(serve.httpx, "AsyncClient",
                        lambda **kwargs: real_client(transport=httpx.MockTransport(handler), **kwargs))
    monkeypatch.setattr(serve, "arrival_times", lambda *args: arrivals.append(args) or real_arrivals(*args))
    result, metrics = asyncio.run(serve.measure(reqs(2), disable_tqdm=True))
    assert urls == ["http://127.0.0.1:8000/v1/models"] + ["http://127.0.0.1:8000/v1/completions"] * 2
    assert arrivals == [(2, math.inf, 1.0, 0)]  # every request at once, seed 0
    assert metrics.completed == 2 and result["model_id"] == "m"


def test_bad_library_arguments_raise_early_naming_the_argument():
    for kw, field in [({"backend": "vllm"}, "backend"), ({"max_concurrency": True}, "max_concurrency"),
                      ({"max_concurrency": 2.5}, "max_concurrency"), ({"num_warmups": -1}, "num_warmups"),
                      ({"request_rate": -2.0}, "request_rate"), ({"timeout": 0}, "timeout")]:
        with pytest.raises(ValueError, match=field):
            asyncio.run(run_benchmark(reqs(1), "http://127.0.0.1:9", **kw))
    with pytest.raises(TypeError, match="SampleRequest"):
        asyncio.run(run_benchmark([[1, 2]], "http://127.0.0.1:9"))
    with pytest.raises(ValueError, match="non-empty list"):
        asyncio.run(run_benchmark([], "http://127.0.0.1:9"))


# ----- sweeps -----

def test_benchmark_and_sweep_run_from_plain_code_and_inside_a_running_loop(fake):
    async def inside_a_loop():  # as in a Jupyter cell, whose loop is already running
        return sweep(reqs(2), [100.0, math.inf], s.url, disable_tqdm=True, percentile_metrics=["ttft"])

    with fake() as s:
        plain = serve.benchmark(reqs(2), s.url, disable_tqdm=True)
        swept = asyncio.run(inside_a_loop())
    assert plain["completed"] == 2 and [r["completed"] for r in swept] == [2, 2]
    assert [r["request_rate"] for r in swept] == [100.0, "inf"]  # one run per rate, in the order given
    assert all("median_ttft_ms" in r and "median_tpot_ms" not in r for r in swept)  # each with the same arguments


def sweep_result(rate, completed, scale, goodput=None):
    """What serve.benchmark returns, cut to what the report reads: TTFT with three percentiles
    (p9 sorts last as text, p99.9 last as a number), TPOT with a median only."""
    r = {"request_rate": rate, "completed": completed, "failed": 10 - completed, "request_throughput": 1.234 * scale,
         "output_throughput": 56.78 * scale, "median_ttft_ms": 12.34 * scale, "p9_ttft_ms": 5.0,
         "p50_ttft_ms": 12.0, "p99.9_ttft_ms": 45.67 * scale, "median_tpot_ms": 3.21 * scale}
    if goodput is not None:
        r["request_goodput"] = goodput
    return r


def cells(line):
    return [c.strip() for c in line.strip("|").split("|")]


def test_sweep_table_reads_each_result_in_its_own_row():
    rows = [sweep_result(2.0, 9, 1.0, goodput=0.5), sweep_result("inf", 7, 2.0, goodput=0.25)]
    head, rule, *body = sweep_table(rows).splitlines()
    assert len(cells(head)) == len(cells(rule)) == 8 and "p99.9" in head and "goodput" in head  # the top percentile
    numbers = [[float(x) for cell in cells(line) for x in cell.split(" / ")] for line in body]
    assert numbers == [pytest.approx([2, 9, 1, 1.234, 56.78, 12.34, 45.67, 3.21, 0.5], abs=0.1),  # rate, done,
                       pytest.approx([math.inf, 7, 3, 2.468, 113.56, 24.68, 91.34, 6.42, 0.25], abs=0.1)]  # failed...
    assert len(cells(sweep_table([sweep_result(0.5, 10, 1.0)]).splitlines()[-1])) == 7  # no goodput column


def test_sweep_plot_draws_each_metric_against_achieved_throughput(tmp_path):
    rows = [sweep_result(2.0, 9, 1.0), sweep_result("inf", 7, 2.0)]
    fig = plot_sweep(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    ttft, tpot = fig.axes  # one panel per metric stored
    for ax, label, ys in [(ttft, "TTFT", [12.34, 24.68]), (tpot, "TPOT", [3.21, 6.42])]:
        assert label in ax.get_ylabel() and "throughput" in ax.get_xlabel()
        assert ax.lines[0].get_xdata().tolist() == [56.78, 113.56] and ax.lines[0].get_ydata() == pytest.approx(ys)
        assert [t.get_text() for t in ax.texts] == ["2/s", "inf/s"]  # each point: the offered rate
    assert len(tpot.lines) == 1 and ttft.lines[1].get_label() == "p99.9"  # the top percentile stored, if any
    assert ttft.lines[1].get_ydata() == pytest.approx([45.67, 91.34])


# ----- datasets -----

def vllm_random_draws(seed, n, lo, hi, out_lo, out_hi, vocab_size):
    """vLLM's RandomDataset draws, in its order, from one generator: input lengths, output lengths,
    then each prompt's offset into the vocabulary."""
    rng = np.random.default_rng(seed)
    return (rng.integers(lo, hi + 1, size=n), rng.integers(out_lo, out_hi + 1, size=n),
            rng.integers(0, vocab_size, size=n))


@pytest.mark.parametrize("seed, input_len, output_len, ratio", [(0, 6, 4, 0.0), (3, 20, 10, 0.5), (7, 12, 1, 0.9)])
def test_random_prompts_are_vllms_draws_as_runs_of_allowed_ids(tokenizer, seed, input_len, output_len, ratio):
    out = get_samples("random", 40, tokenizer=tokenizer, random_input_len=input_len, random_output_len=output_len,
                      random_range_ratio=ratio, seed=seed)
    lo, hi = math.floor(input_len * (1 - ratio)), math.ceil(input_len * (1 + ratio))
    out_lo = max(math.floor(output_len * (1 - ratio)), 1)
    in_lens, out_lens, offsets = vllm_random_draws(seed, 40, lo, hi, out_lo, math.ceil(output_len * (1 + ratio)), 15)
    allowed = list(range(3, 15))  # the tiny vocabulary without its special ids 0-2
    assert [r.expected_output_len for r in out] == out_lens.tolist()
    for i, r in enumerate(out):
        start = (offsets[i] + i) % len(allowed)
        assert r.prompt == [allowed[(start + k) % len(allowed)] for k in range(in_lens[i])]
        assert r.prompt_len == in_lens[i] and r.ignore_eos is False
    text = get_samples("random", 40, tokenizer=tokenizer, random_input_len=input_len, random_output_len=output_len,
                       random_range_ratio=ratio, seed=seed, as_text=True)  # for chat: the same prompts, decoded
    assert [r.prompt for r in text] == [tokenizer.decode(r.prompt) for r in out]


def test_random_defaults_and_seeds(tokenizer):
    default = get_samples("random", 3, tokenizer=tokenizer)
    assert [(r.prompt_len, r.expected_output_len) for r in default] == [(1024, 128)] * 3  # vLLM's defaults
    assert default == get_samples("random", 3, tokenizer=tokenizer, seed=0) != get_samples("random", 3,
                                                                                          tokenizer=tokenizer, seed=1)


class FakeVocab:
    def __init__(self, vocab_size, special):
        self.vocab_size, self.all_special_ids = vocab_size, special

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_a_vocabulary_of_one_allowed_id_works_and_of_none_is_refused():
    one = FakeVocab(vocab_size=3, special=[0, 2])
    assert [r.prompt for r in datasets.random_requests(one, 2, input_len=3, output_len=1)] == [[1, 1, 1]] * 2
    with pytest.raises(ValueError, match="special"):
        datasets.prefix_repetition_requests(FakeVocab(vocab_size=2, special=[0, 1]), 1, num_prefixes=1)


def test_prefix_repetition_shares_exactly_the_prefixes(tokenizer):
    out = get_samples("prefix_repetition", 13, tokenizer=tokenizer, prefix_repetition_prefix_len=8,
                      prefix_repetition_suffix_len=5, prefix_repetition_num_prefixes=3,
                      prefix_repetition_output_len=7, seed=2)
    assert len(out) == 12  # 3 prefixes x (13 // 3) prompts, as vLLM
    assert all(len(r.prompt) == r.prompt_len == 13 and r.expected_output_len == 7 for r in out)
    groups = {}
    for r in out:
        groups.setdefault(tuple(r.prompt[:8]), []).append(tuple(r.prompt[8:]))
    assert len(groups) == 3 and all(len(g) == 4 for g in groups.values())
    assert len({s for g in groups.values() for s in g}) == 12  # each prompt its own suffix
    assert [r.prompt[:8] for r in out[:4]] != [r.prompt[:8] for r in out[:1]] * 4  # shuffled
    assert not set(tokenizer.all_special_ids) & {i for r in out for i in r.prompt}


def test_prefix_repetition_defaults_seeds_text_and_short_parts(tokenizer):
    default = get_samples("prefix_repetition", 10, tokenizer=tokenizer)
    assert [(r.prompt_len, r.expected_output_len) for r in default] == [(512, 128)] * 10  # vLLM's defaults
    assert len({tuple(r.prompt[:256]) for r in default}) == 10
    assert {i for r in default for i in r.prompt[:256]} == {i for r in default for i in r.prompt[256:]} == set(
        range(3, 15))  # prefixes and suffixes draw from every allowed id
    assert default == get_samples("prefix_repetition", 10, tokenizer=tokenizer, seed=0) != get_samples(
        "prefix_repetition", 10, tokenizer=tokenizer, seed=1)
    text = get_samples("prefix_repetition", 10, tokenizer=tokenizer, as_text=True)
    assert [r.prompt for r in text] == [tokenizer.decode(r.prompt) for r in default]
    assert all(len(r.prompt) == 1 for r in datasets.prefix_repetition_requests(tokenizer, 2, 0, 1, 1, 1))
    assert all(len(r.prompt) == 1 for r in datasets.prefix_repetition_requests(tokenizer, 2, 1, 0, 1, 1))


def test_w2_loads_as_recorded(tmp_path, monkeypatch):
    data = json.loads(datasets.find_w2().read_text())
    w2 = get_samples("w2", 64)
    assert get_samples("w2", None) == w2 and len(w2) == 64
    assert sum(r.prompt_len for r in w2) == 12670 and sum(r.expected_output_len for r in w2) == 4606
    assert all(r.ignore_eos for r in w2) and w2[5].prompt == data["requests"][5]["prompt_ids"]
    assert get_samples("w2", 3, as_text=True)[2].prompt == data["requests"][2]["prompt"]
    assert get_samples("w2", 66)[65].prompt == data["requests"][1]["prompt_ids"]  # cycles in order
    for r in data["requests"]:
        del r["ignore_eos"]
    (tmp_path / "w2.json").write_text(json.dumps(data))
    assert not any(r.ignore_eos for r in get_samples("w2", 3, dataset_path=str(tmp_path / "w2.json")))
    with pytest.raises(FileNotFoundError, match="/nonexistent/w2.json"):
        get_samples("w2", 1, dataset_path="/nonexistent/w2.json")
    monkeypatch.setattr(datasets, "W2_PATHS", (tmp_path / "a.json", tmp_path / "b.json"))
    with pytest.raises(FileNotFoundError, match="a.json.*b.json"):  # every place it looked
        datasets.find_w2()


@pytest.mark.parametrize("content, named", [
    ("{", "not JSON"), ("[1, 2]", "'requests' is a non-empty list"), ('{"requests": []}', "non-empty list"),
    ('{"foo": 1}', "'requests'"), ('{"requests": [5]}', "requests[0] must be an object"),
    ('{"requests": [{"prompt": "hi", "max_tokens": 4}]}', "requests[0].prompt_ids"),
    ('{"requests": [{"prompt_ids": [1, 2], "max_tokens": 4}, {"prompt_ids": "12", "max_tokens": 4}]}',
     "requests[1].prompt_ids"),
    ('{"requests": [{"prompt_ids": [1, -2], "max_tokens": 4}]}', "requests[0].prompt_ids"),
    ('{"requests": [{"prompt_ids": [1], "max_tokens": "abc"}]}', "requests[0].max_tokens"),
    ('{"requests": [{"prompt_ids": [1], "max_tokens": -4}]}', "requests[0].max_tokens"),
    ('{"requests": [{"prompt_ids": [1], "max_tokens": 4, "ignore_eos": "yes"}]}', "requests[0].ignore_eos"),
])
def test_a_broken_w2_file_is_refused_naming_the_file_and_the_entry(tmp_path, capsys, content, named):
    path = tmp_path / "mine.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(named)) as e:
        get_samples("w2", 2, dataset_path=str(path))
    assert "mine.json" in str(e.value)
    code, out, err = cli(capsys, "--dataset-name", "w2", "--dataset-path", str(path))
    assert code == 2 and "--dataset-path" in err[-1] and named in err[-1], err
    code, _, err = cli(capsys, "--dataset-name", "w2", "--dataset-path", str(tmp_path / "none.json"))
    assert code == 2 and "none.json" in err[-1]
    text_less = tmp_path / "ids.json"  # the chat backend sends the recorded text
    text_less.write_text('{"requests": [{"prompt_ids": [1], "max_tokens": 4}]}')
    assert get_samples("w2", 1, dataset_path=str(text_less))[0].prompt == [1]
    with pytest.raises(ValueError, match=r"requests\[0\].prompt must be"):
        get_samples("w2", 1, dataset_path=str(text_less), as_text=True)


@pytest.mark.parametrize("call, field", [
    (lambda t: datasets.random_requests(t, True), "num_prompts"),
    (lambda t: datasets.random_requests(t, 1, range_ratio=1.0), "random_range_ratio"),
    (lambda t: datasets.random_requests(t, 1, input_len=1, range_ratio=0.5), "empty prompt"),
    (lambda t: datasets.prefix_repetition_requests(t, 1, prefix_len=-1), "prefix_repetition_prefix_len"),
    (lambda t: datasets.prefix_repetition_requests(t, 1, prefix_len=0, suffix_len=0, num_prefixes=1),
     "prefix_len \\+ prefix_repetition_suffix_len"),
    (lambda t: datasets.prefix_repetition_requests(t, 2, num_prefixes=3), "prefix_repetition_num_prefixes"),
    (lambda t: get_samples("sharegpt", 1), "dataset_name"),
    (lambda t: get_samples("random", 1, tokenizer=t, dataset_path="w2.json"), "dataset_path"),
    (lambda t: get_samples("prefix_repetition", 10), "tokenizer"),
])
def test_bad_dataset_arguments_name_the_argument(tokenizer, call, field):
    with pytest.raises(ValueError, match=field):
        call(tokenizer)


# ----- the command line -----

def cli(capsys, *argv):
    code = bench_serve.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


@pytest.mark.parametrize("argv, named", [
    (["--num-prompts", "x"], "--num-prompts: 'x'"),
    (["--request-rate", "0"], "--request-rate: 0"),
    (["--burstiness", "nan"], "--burstiness: nan"),
    (["--random-range-ratio", "1"], "--random-range-ratio: 1"),
    (["--port", "65536"], "--port: 65536"),
    (["--backend", "tgi"], "--backend: invalid choice: 'tgi'"),
    (["--goodput", "ttft=5"], "--goodput: .*'ttft=5'"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics: 'foo'"),
    (["--metric-percentiles", "99,101"], "--metric-percentiles: 101"),
    (["--request-rates", "1,0"], "--request-rates: '0'"),
    (["--base-url", "localhost:8000"], "--base-url: 'localhost:8000'"),
    (["--request-rate", "2", "--request-rates", "1,2"], "--request-rate and --request-rates"),
    (["--dataset-path", "x.json"], "--dataset-path .*random"),
    (["--dataset-name", "prefix_repetition", "--num-prompts", "4"],
     "--num-prompts 4 .*--prefix-repetition-num-prefixes 10"),
])
def test_bad_argument_exits_2_with_one_line_naming_it_before_anything_loads(capsys, monkeypatch, argv, named):
    def no_load(*a, **k):
        raise AssertionError("the tokenizer was loaded before the arguments were checked")

    monkeypatch.setattr("nano_engine.models.loading.load_tokenizer", no_load)
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err[0].startswith("usage: python -m nano_engine bench-serve") and err[-1].startswith(PREFIX)
    assert re.search(named, err[-1]), err[-1]


def test_cli_defaults_are_vllms_but_the_two_documented():
    args = bench_serve.build_parser().parse_args([])
    assert (args.dataset_name, args.request_rate, args.burstiness, args.host, args.port) == (
        "random", math.inf, 1.0, "127.0.0.1", 8000)
    assert (args.num_prompts, args.percentile_metrics, args.metric_percentiles) == (
        64, ["ttft", "tpot", "itl", "e2el"], [90.0, 99.0])  # vLLM: 1000, ttft,tpot,itl at p99


def test_cli_runs_w2_from_its_path_without_a_tokenizer_and_saves_vllm_keys(capsys, fake, monkeypatch, tmp_path):
    def no_load(*a, **k):
        raise AssertionError("w2 holds its token ids: no tokenizer is loaded")

    monkeypatch.setattr("nano_engine.models.loading.load_tokenizer", no_load)
    monkeypatch.chdir(tmp_path)
    data = json.loads(datasets.find_w2().read_text())
    data["requests"] = data["requests"][:2]
    data["requests"][0]["prompt_ids"] = [3, 4, 5]
    (tmp_path / "mine.json").write_text(json.dumps(data))
    with fake(chunks=[(0, "a"), (0.01, "b")]) as s:
        code, out, err = cli(capsys, "--base-url", s.url, "--dataset-name", "w2", "--dataset-path", "mine.json",
                             "--num-prompts", "3", "--disable-tqdm", "--save-result", "--goodput", "ttft:60000",
                             "e2el:60000")
    assert code == 0, err
    assert re.search(r"^Successful requests: +3$", out, re.M) and "P99 ITL (ms):" in out
    assert sorted(b["prompt"] for b in s.bodies) == sorted([[3, 4, 5], [3, 4, 5], data["requests"][1]["prompt_ids"]])
    assert all(b["ignore_eos"] for b in s.bodies)  # W2's own setting
    (saved,) = tmp_path.glob("openai-*.json")  # named as vLLM names a result
    assert re.fullmatch(r"openai-infqps-fake-model-\d{8}-\d{6}\.json", saved.name), saved.name
    result = json.loads(saved.read_text())
    for key in ("completed", "request_throughput", "request_goodput", "output_throughput", "mean_ttft_ms",
                "median_tpot_ms", "p90_itl_ms", "p99_e2el_ms", "ttfts", "itls", "model_id", "request_rate"):
        assert key in result, key
    assert result["request_rate"] == "inf" and len(result["itls"]) == 3 and all(len(i) == 1 for i in result["itls"])


def test_cli_sweep_writes_the_plot_the_table_and_every_result(capsys, fake, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with fake() as s:
        code, out, err = cli(capsys, "--base-url", s.url, "--dataset-name", "w2", "--num-prompts", "3",
                             "--disable-tqdm", "--request-rates", "50,inf", "--sweep-output", "sweep",
                             "--percentile-metrics", "ttft,e2el", "--save-result")
    assert code == 0, err
    table = (tmp_path / "sweep.md").read_text().splitlines()
    assert "TTFT" in table[0] and "TPOT" not in table[0]
    assert [cells(row)[0] for row in table[2:]] == ["50", "inf"]
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "Time per Output Token" not in out and "End-to-end Latency" in out  # the selected sections only
    (saved,) = tmp_path.glob("*.json")  # one file, named as vLLM names a result, holding each rate's
    assert re.fullmatch(r"openai-sweep-fake-model-\d{8}-\d{6}\.json", saved.name), saved.name
    assert [r["request_rate"] for r in json.loads(saved.read_text())] == [50.0, "inf"]


def test_cli_every_request_failed_exits_1_with_the_first_error(capsys, fake):
    with fake() as s:
        url = s.url  # stopped: nothing listens there any more
    code, out, err = cli(capsys, "--base-url", url, "--model", "m", "--dataset-name", "w2", "--num-prompts", "2",
                         "--disable-tqdm")
    assert code == 1 and len(err) == 1 and err[0].startswith(PREFIX)
    assert "all 2 requests failed" in err[0] and "ConnectError" in err[0]


def test_dataset_flags_the_dataset_refuses_exit_2_before_anything_is_sent(capsys, monkeypatch, tokenizer):
    monkeypatch.setattr("nano_engine.models.loading.load_tokenizer", lambda path=None: tokenizer)
    monkeypatch.setattr(bench_serve, "measure", lambda *a, **k: pytest.fail("the benchmark ran"))
    code, _, err = cli(capsys, "--base-url", "http://127.0.0.1:9", "--dataset-name", "prefix_repetition",
                       "--num-prompts", "10", "--prefix-repetition-prefix-len", "0", "--prefix-repetition-suffix-len", "0")
    assert code == 2 and err[-1].startswith(PREFIX) and "prefix_repetition_suffix_len" in err[-1], err  # it was exit 1


def test_where_the_results_go_is_checked_before_anything_is_sent(capsys, monkeypatch, tmp_path):
    """A --result-filename or --sweep-output in a folder that is not there was found only after the run."""
    monkeypatch.setattr(bench_serve, "measure", lambda *a, **k: pytest.fail("the benchmark ran"))
    for argv, named in [(["--save-result", "--result-filename", str(tmp_path / "no" / "r.json")], "--result-filename"),
                        (["--request-rates", "1,2", "--sweep-output", str(tmp_path / "no" / "stem")], "--sweep-output")]:
        code, _, err = cli(capsys, "--dataset-name", "w2", *argv)
        assert code == 2 and err[-1].startswith(PREFIX + named) and str(tmp_path / "no") in err[-1], err


def test_cli_draws_prompts_with_the_served_models_tokenizer_when_it_is_here(capsys, fake, monkeypatch, tokenizer,
                                                                              tmp_path):
    """Without --tokenizer, the ids are drawn from the vocabulary of the model the server says it loaded
    (/v1/models root, a path on this machine); they were the embedded model's, outside a smaller one's."""
    loaded = []
    monkeypatch.setattr("nano_engine.models.loading.load_tokenizer", lambda path=None: loaded.append(path) or tokenizer)
    for root, want in ((str(tmp_path), str(tmp_path)), ("org/not-here", None), (None, None)):
        with fake(root=root) as s:
            code, _, err = cli(capsys, "--base-url", s.url, "--num-prompts", "1", "--random-input-len", "4",
                               "--random-output-len", "2", "--disable-tqdm")
        assert code == 0 and loaded[-1] == want, (root, err)


def test_cli_all_failed_on_ids_outside_the_vocabulary_says_to_pass_the_tokenizer(capsys, monkeypatch, tokenizer):
    monkeypatch.setattr("nano_engine.models.loading.load_tokenizer", lambda path=None: tokenizer)

    async def measure(*args, **kwargs):
        errors = ["HTTP 400: prompt_ids[0]=12 is outside the vocabulary [0, 8)"] * 2
        return {"errors": errors}, SimpleNamespace(completed=0, failed=2)

    monkeypatch.setattr(bench_serve, "measure", measure)
    monkeypatch.setattr(bench_serve, "_print_metrics", lambda *a: None)
    code, _, err = cli(capsys, "--base-url", "http://127.0.0.1:9", "--num-prompts", "2", "--random-input-len", "4")
    assert code == 1 and "outside the vocabulary" in err[-1] and "--tokenizer" in err[-1], err


def test_cli_hands_every_flag_to_the_dataset_and_the_benchmark(capsys, fake, monkeypatch, tokenizer, tmp_path):
    loaded, seen, real_samples, real_measure = [], {}, bench_serve.get_samples, bench_serve.measure

    async def measure(*args, **kwargs):
        seen.update(kwargs, base_url=args[1])
        return await real_measure(*args, **kwargs)

    monkeypatch.setattr(bench_serve, "get_samples",
                        lambda *a, **kw: seen.update(kw, dataset=a) or real_samples(*a, **kw))
    monkeypatch.setattr(bench_serve, "measure", measure)
    monkeypatch.setattr("nano_engine.models.loading.load_tokenizer", lambda path=None: loaded.append(path) or tokenizer)
    monkeypatch.chdir(tmp_path)
    with fake() as s:
        code, out, err = cli(
            capsys, "--base-url", s.url + "/", "--backend", "openai-chat", "--model", "org/served", "--tokenizer",
            "/models/tok", "--num-prompts", "2", "--random-input-len", "6", "--random-output-len", "3",
            "--random-range-ratio", "0.5", "--prefix-repetition-prefix-len", "3", "--prefix-repetition-suffix-len", "2",
            "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "5", "--request-rate", "50",
            "--burstiness", "0.5", "--max-concurrency", "2", "--num-warmups", "1", "--seed", "7", "--goodput",
            "ttft:60000", "e2el:50000", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "0,100",
            "--timeout", "30", "--disable-tqdm", "--label", "mine", "--save-result")
    assert code == 0, err
    assert loaded == ["/models/tok"] and seen.items() >= dict(
        dataset=("random", 2), tokenizer=tokenizer, as_text=True, seed=7, random_input_len=6, random_output_len=3,
        random_range_ratio=0.5, prefix_repetition_prefix_len=3, prefix_repetition_suffix_len=2,
        prefix_repetition_num_prefixes=2, prefix_repetition_output_len=5, base_url=s.url, request_rate=50.0,
        burstiness=0.5, max_concurrency=2, num_warmups=1, goodput={"ttft": 60000.0, "e2el": 50000.0},
        percentiles=[0.0, 100.0], timeout=30.0).items()
    assert len(s.bodies) == 3 and all(b["model"] == "org/served" and "messages" in b for b in s.bodies)  # 1 warm-up
    assert all(b["ignore_eos"] for b in s.bodies)  # the random dataset sets it, as vLLM
    (saved,) = tmp_path.glob("*.json")
    assert re.fullmatch(r"mine-50\.0qps-concurrency2-served-\d{8}-\d{6}\.json", saved.name), saved.name
    assert out.splitlines()[-1] == f"wrote {saved.name}"
    result = json.loads(saved.read_text())
    assert result["label"] == "mine" and result["tokenizer_id"] == "/models/tok"
    assert {"p0_ttft_ms", "p100_e2el_ms"} <= result.keys() and "p0_tpot_ms" not in result


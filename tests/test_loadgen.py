"""The load generator (nano_engine/loadgen*.py) against a fake OpenAI-compatible server.

The fake server is a plain asyncio HTTP/1.1 server on 127.0.0.1 (a free port), in its own thread
and event loop, that streams scripted SSE chunks (chunked transfer encoding, as uvicorn sends
them) with scripted delays, then a usage chunk and `data: [DONE]`. It counts the requests in
flight, can hold them until a number are in at once, answer 400, or drop the connection. It is
always stopped (a context manager; the fixture checks its thread has ended). Timing assertions are
inequalities against the scripted delays, never tight.
"""

import asyncio
import json
import math
import re
import threading

import numpy as np
import pytest

from nano_engine.benchmarks import serve as loadgen
from nano_engine.benchmarks import datasets as loadgen_datasets
from nano_engine.benchmarks.serve import arrival_times, run_benchmark, sample_intervals
from nano_engine.benchmarks.datasets import SampleRequest, get_samples
from nano_engine.benchmarks.sweep import plot_sweep, sweep, sweep_table
from tiny_files import save_tokenizer

PREFIX = "python -m nano_engine bench-serve: error: "


class FakeServer:
    """/v1/models, /v1/completions and /v1/chat/completions, streamed as scripted."""

    def __init__(self, chunks=((0.0, "a"), (0.0, "b")), usage_tokens=None, hold_until=0,
                 fail=(), drop_after=None, status=200, done=True):
        self.chunks, self.usage_tokens, self.hold_until = list(chunks), usage_tokens, hold_until
        self.fail, self.drop_after, self.status, self.done = set(fail), drop_after, status, done
        self.bodies, self.in_flight, self.peak = [], 0, 0
        self._writers = set()

    def __enter__(self):
        started = threading.Event()

        def serve():
            self.loop = asyncio.new_event_loop()
            self.released = asyncio.Event()
            self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.url = "http://127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]
            started.set()
            self.loop.run_forever()
            self.loop.close()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert started.wait(10), "the fake server did not start"
        return self

    def __exit__(self, *exc):
        async def stop():
            self.server.close()
            for w in list(self._writers):
                w.transport.abort()
            handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in handlers:  # a request still held or streaming ends here, not at exit
                t.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
            self.loop.stop()

        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(stop()))
        self.thread.join(10)

    async def _handle(self, reader, writer):
        self._writers.add(writer)
        try:
            while True:  # keep-alive: one connection carries several requests
                head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
                method, path, _ = head[0].split(" ")
                headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in head[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if method == "GET" and path == "/v1/models":
                    self._send_json(writer, 200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
                elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                    if not await self._stream(writer, path, json.loads(body)):
                        return
                else:
                    self._send_json(writer, 404, {"error": {"message": f"no route {path}"}})
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def _send_json(self, writer, status, obj):
        data = json.dumps(obj).encode()
        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % (status, len(data)) + data)

    async def _stream(self, writer, path, body) -> bool:
        index = len(self.bodies)
        self.bodies.append(body)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.peak >= self.hold_until:
                self.released.set()
            try:  # hold until `hold_until` requests were in flight at once (or give up after 10 s)
                await asyncio.wait_for(self.released.wait(), 10)
            except TimeoutError:
                pass
            if self.status != 200 or index in self.fail:
                self._send_json(writer, 400, {"error": {"message": "max_tokens is too large", "type":
                                                        "BadRequestError", "param": "max_tokens", "code": 400}})
                return True
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            self._event(writer, ": ping")  # an SSE comment: not a chunk
            chat = path.endswith("chat/completions")
            for i, (delay, text) in enumerate(self.chunks):
                if i == self.drop_after:
                    writer.transport.abort()  # the connection drops mid-stream
                    return False
                await asyncio.sleep(delay)
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                self._event(writer, "data: " + json.dumps({"object": "chunk", "choices": [choice]}))
                await writer.drain()
            if self.usage_tokens is not None:
                n_prompt = len(body["prompt"]) if not chat else 7
                self._event(writer, "data: " + json.dumps({"choices": [], "usage": {
                    "prompt_tokens": n_prompt, "completion_tokens": self.usage_tokens}}))
            if self.done:
                self._event(writer, "data: [DONE]")
            writer.write(b"0\r\n\r\n")
            return True
        finally:
            self.in_flight -= 1

    @staticmethod
    def _event(writer, text):
        data = (text + "\n\n").encode()
        writer.write(b"%x\r\n" % len(data) + data + b"\r\n")


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
    assert (r["completed"], r["failed"]) == (1, 0)
    assert r["model_id"] == "fake-model"  # the first of GET /v1/models
    assert r["generated_texts"] == ["Hello world"]
    assert r["output_lens"] == [5] and r["input_lens"] == [6]  # from the usage chunk, not the 3 chunks
    (ttft,), (itl,), (e2el,) = r["ttfts"], r["itls"], r["latencies"]
    assert len(itl) == 2  # 3 chunks with text: 2 gaps; the ping and the usage chunk are not chunks
    assert 0.05 <= ttft < 5 and all(0.05 <= gap < 5 for gap in itl)
    assert e2el >= ttft + sum(itl) - 1e-9 and e2el >= 0.25
    assert r["mean_tpot_ms"] == pytest.approx((e2el - ttft) / 4 * 1000)
    assert r["mean_ttft_ms"] == pytest.approx(ttft * 1000)
    body = s.bodies[0]
    assert body["prompt"] == [3, 4, 5, 6, 7, 8] and body["max_tokens"] == 4 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and "ignore_eos" not in body
    assert body["model"] == "fake-model"


def test_chat_backend_sends_text_messages_and_reads_deltas(fake):
    with fake(chunks=[(0, "Hi"), (0, "!")], usage_tokens=2) as s:
        r = bench(s, [SampleRequest("hello there", 2, 3, ignore_eos=True)], backend="openai-chat")
    body = s.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    assert body["max_completion_tokens"] == 3 and body["ignore_eos"] is True
    assert r["generated_texts"] == ["Hi!"] and r["input_lens"] == [7]  # the server's count wins


def test_without_usage_each_chunk_is_one_token(fake):
    with fake(chunks=[(0, "x")] * 4, usage_tokens=None) as s:
        assert bench(s, reqs(1))["output_lens"] == [4]


# ----- failures are records, not crashes -----

def test_a_400_is_a_failed_request_with_the_servers_message(fake):
    with fake(fail={1}, usage_tokens=2) as s:
        r = bench(s, reqs(3), max_concurrency=1)
    assert (r["completed"], r["failed"]) == (2, 1)
    assert r["errors"][1] == "HTTP 400: max_tokens is too large" and r["errors"][0] == ""


@pytest.mark.parametrize("drop_after", [0, 2])
def test_a_dropped_connection_is_a_failed_request(fake, drop_after):
    with fake(chunks=[(0, "a")] * 4, drop_after=drop_after, usage_tokens=4) as s:
        r = bench(s, reqs(2))
    assert (r["completed"], r["failed"]) == (0, 2) and all(r["errors"])


def test_a_stream_cut_before_done_is_a_failed_request(fake):
    # The body ends cleanly (chunked encoding's last chunk), but without `data: [DONE]`.
    with fake(chunks=[(0, "a")] * 2, usage_tokens=2, done=False) as s:
        r = bench(s, reqs(1))
    assert r["failed"] == 1 and r["errors"] == ["the stream ended before data: [DONE] (cut short)"]


def test_a_request_past_its_timeout_fails(fake):
    # Every gap (0.3 s) is within the timeout; the whole response (1.2 s) is not.
    with fake(chunks=[(0.3, "a")] * 4, usage_tokens=4) as s:
        r = bench(s, reqs(1), timeout=0.8)
    assert r["failed"] == 1 and r["errors"] == ["no complete response within the timeout of 0.8 s"]
    assert r["latencies"] == [0.0] and r["ttfts"] == [0.0] and r["itls"] == [[]]  # a failed request: vLLM's zeros


def test_no_server_means_failed_requests(fake):
    with fake() as s:
        url = s.url
    r = asyncio.run(run_benchmark(reqs(2), url, model="m", disable_tqdm=True, timeout=5))
    assert r["failed"] == 2 and all("Connect" in e for e in r["errors"])


# ----- arrivals and concurrency -----

@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gamma_intervals_have_mean_one_over_rate_and_cv2_one_over_burstiness(burstiness):
    gaps = sample_intervals(20000, 4.0, burstiness, np.random.RandomState(0))
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    cv2 = gaps.var() / gaps.mean() ** 2  # 1 for a Poisson process, burstier below 1, more even above
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)


def test_arrival_times_follow_vllm():
    times = arrival_times(50, 10.0, seed=3)
    assert times == sorted(times) and times[-1] == pytest.approx(5.0)  # rescaled to n / rate
    assert times == arrival_times(50, 10.0, seed=3) != arrival_times(50, 10.0, seed=4)
    # vLLM's draws: the legacy generator seeded with --seed, cumulated.
    raw = np.cumsum(np.random.RandomState(3).gamma(1.0, 0.1, size=50))
    assert np.allclose(times, raw * 5.0 / raw[-1])
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(4, 2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError, match="request_rate must be > 0"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="burstiness must be > 0"):
        arrival_times(3, 1.0, burstiness=-1)


def test_infinite_rate_sends_every_request_at_once(fake):
    # The server holds each request until all 8 are in flight (10 s at most): a client that
    # sent them one after another would reach a peak of 1.
    with fake(hold_until=8, usage_tokens=2) as s:
        r = bench(s, reqs(8))
    assert s.peak == 8 and r["completed"] == 8


def test_finite_rate_spreads_the_requests(fake):
    with fake(usage_tokens=2) as s:
        r = bench(s, reqs(6), request_rate=20.0)
    assert r["completed"] == 6 and max(r["start_times"]) >= 0.25  # the last leaves at 6/20 = 0.3 s
    assert all(0 <= t < 5 for t in r["start_times"]) and 0.25 <= r["duration"] < 30  # seconds since the start


def test_max_concurrency_is_never_exceeded(fake):
    with fake(chunks=[(0.02, "a")] * 3, hold_until=3, usage_tokens=3) as s:
        r = bench(s, reqs(10), max_concurrency=3)
    assert s.peak == 3 and r["completed"] == 10


def test_a_request_waiting_for_a_slot_is_timed_from_when_it_is_sent(fake):
    # As vLLM: the clock starts once the semaphore lets the request go (httpx's own connection
    # pool would also cap concurrency, but its wait would count in the TTFT).
    with fake(chunks=[(0, "a"), (0.1, "b")], usage_tokens=2) as s:
        r = bench(s, reqs(3), max_concurrency=1)
    spans = sorted(zip(r["start_times"], r["latencies"]))
    assert all(s1 >= s0 + l0 for (s0, l0), (s1, _) in zip(spans, spans[1:]))


def test_warmups_are_sent_but_not_counted(fake):
    with fake(usage_tokens=2) as s:
        r = bench(s, reqs(3), num_warmups=2)
    assert len(s.bodies) == 5 and r["completed"] == 3 and len(r["ttfts"]) == 3


def test_goodput_and_selected_metrics(fake):
    with fake(chunks=[(0.01, "a"), (0.01, "b")], usage_tokens=2) as s:
        lax = bench(s, reqs(2), goodput={"ttft": 60_000}, percentiles=[50, 90], percentile_metrics=["ttft", "itl"])
        strict = bench(s, reqs(2), goodput={"e2el": 0.001})
    assert lax["request_goodput"] == pytest.approx(lax["request_throughput"]) and strict["request_goodput"] == 0
    assert {"p50_ttft_ms", "p90_itl_ms", "mean_ttft_ms"} <= lax.keys()
    assert not any("tpot" in k or "e2el" in k or "p99" in k for k in lax)


def test_benchmark_and_sweep_run_from_plain_code_and_inside_a_running_loop(fake, tmp_path):
    async def inside_a_loop():  # as in a Jupyter cell, whose loop is already running
        return loadgen.benchmark(reqs(2), s.url, disable_tqdm=True)

    with fake(usage_tokens=2) as s:
        plain = loadgen.benchmark(reqs(2), s.url, disable_tqdm=True)
        nested = asyncio.run(inside_a_loop())
        swept = sweep(reqs(2), [100.0, math.inf], s.url, disable_tqdm=True)
    assert plain["completed"] == nested["completed"] == 2
    assert [r["request_rate"] for r in swept] == [100.0, "inf"]
    assert len(sweep_table(swept).splitlines()) == 4
    assert plot_sweep(swept, tmp_path / "s.png").axes and (tmp_path / "s.png").is_file()


def test_bad_library_arguments_raise_early():
    for kw, match in [({"backend": "vllm"}, "backend must be one of openai, openai-chat"),
                      ({"max_concurrency": 0}, "max_concurrency must be None or an integer >= 1"),
                      ({"num_warmups": -1}, "num_warmups must be an integer >= 0"),
                      ({"request_rate": -2.0}, "request_rate must be > 0"),
                      ({"timeout": 0}, "timeout must be > 0"),
                      ({"burstiness": 0}, "burstiness must be > 0"),
                      ({"max_concurrency": True}, "max_concurrency must be None or an integer >= 1, got True"),
                      ({"max_concurrency": 2.5}, "max_concurrency must be None or an integer >= 1, got 2.5")]:
        with pytest.raises(ValueError, match=match):
            asyncio.run(run_benchmark(reqs(1), "http://127.0.0.1:9", **kw))
    with pytest.raises(TypeError) as e:
        asyncio.run(run_benchmark([[1, 2]], "http://127.0.0.1:9"))
    assert str(e.value) == "requests must hold SampleRequest objects (see benchmarks.datasets.get_samples)"
    with pytest.raises(ValueError, match="non-empty list"):
        asyncio.run(run_benchmark([], "http://127.0.0.1:9"))


def sweep_result(rate, completed, scale, goodput=None):
    """What loadgen.benchmark returns, cut to what the report reads: TTFT with three percentiles
    (p9 sorts last as text, p99.9 last as a number), TPOT with a median only."""
    r = {"request_rate": rate, "completed": completed, "failed": 10 - completed, "request_throughput": 1.234 * scale,
         "output_throughput": 56.78 * scale, "median_ttft_ms": 12.34 * scale, "p9_ttft_ms": 5.0,
         "p50_ttft_ms": 12.0, "p99.9_ttft_ms": 45.67 * scale, "median_tpot_ms": 3.21 * scale}
    if goodput is not None:
        r["request_goodput"] = goodput
    return r


def test_sweep_table_reads_each_result_in_its_own_row():
    rows = [sweep_result(2.0, 9, 1.0, goodput=0.5), sweep_result("inf", 7, 2.0, goodput=0.25)]
    assert sweep_table(rows) == "\n".join([
        "| rate (req/s) | done | failed | req/s | output tok/s | TTFT median / p99.9 (ms) | TPOT median (ms) "
        "| goodput (req/s) |",
        "|---|---|---|---|---|---|---|---|",
        "| 2 | 9 | 1 | 1.23 | 56.8 | 12.3 / 45.7 | 3.2 | 0.50 |",
        "| inf | 7 | 3 | 2.47 | 113.6 | 24.7 / 91.3 | 6.4 | 0.25 |"])
    last_row = sweep_table([sweep_result(0.5, 10, 1.0)]).splitlines()[-1]
    assert last_row == "| 0.5 | 10 | 0 | 1.23 | 56.8 | 12.3 / 45.7 | 3.2 |"


def test_sweep_plot_draws_each_metric_against_achieved_throughput(tmp_path):
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    rows = [sweep_result(2.0, 9, 1.0), sweep_result("inf", 7, 2.0)]
    fig = plot_sweep(rows, tmp_path / "p.png")
    assert tuple(fig.get_size_inches()) == pytest.approx((8.4, 3.6))
    assert isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine)
    assert fig.get_suptitle() == "latency vs throughput (labels: offered request rate)"
    ttft, tpot = fig.axes
    left, right = ttft.get_position(), tpot.get_position()
    assert left.y0 == pytest.approx(right.y0) and left.x1 < right.x0
    for ax, label, ys in [(ttft, "TTFT", [12.34, 24.68]), (tpot, "TPOT", [3.21, 6.42])]:
        assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == (label, "achieved output throughput (tokens/s)",
                                                                      f"{label} (ms)")
        median = ax.lines[0]
        assert list(median.get_xdata()) == [56.78, 113.56] and list(median.get_ydata()) == pytest.approx(ys)
        assert (median.get_marker(), median.get_linestyle(), median.get_label()) == ("o", "-", "median")
        notes = [(t.get_text(), t.xy, t.xyann, t.anncoords, t.get_fontsize()) for t in ax.texts]
        assert notes == [("2/s", (56.78, ys[0]), (4, 4), "offset points", 8),
                         ("inf/s", (113.56, ys[1]), (4, 4), "offset points", 8)]
        assert all(g.get_visible() and g.get_alpha() == 0.3 for g in ax.xaxis.get_gridlines())
        assert [t.get_fontsize() for t in ax.get_legend().get_texts()] == [8] * len(ax.lines)
    assert len(tpot.lines) == 1  # no percentile stored for TPOT
    top = ttft.lines[1]
    assert (top.get_marker(), top.get_linestyle(), top.get_label()) == ("s", "--", "p99.9")
    assert list(top.get_xdata()) == [56.78, 113.56] and list(top.get_ydata()) == pytest.approx([45.67, 91.34])
    import PIL.Image
    assert PIL.Image.open(tmp_path / "p.png").size == (1008, 432)  # 8.4 x 3.6 inches at 120 dpi
    assert plot_sweep(rows[:1], title="one rate").get_suptitle() == "one rate"


def test_sweep_runs_one_benchmark_per_rate_with_the_same_arguments(monkeypatch):
    calls = []

    def fake_benchmark(requests, base_url, **kw):
        calls.append((requests, base_url, kw))
        return {"rate": kw["request_rate"]}

    monkeypatch.setattr(loadgen, "benchmark", fake_benchmark)
    requests = reqs(2)
    assert sweep(requests, [1.0, math.inf], seed=3) == [{"rate": 1.0}, {"rate": math.inf}]
    assert calls == [(requests, "http://127.0.0.1:8000", {"request_rate": 1.0, "seed": 3}),
                     (requests, "http://127.0.0.1:8000", {"request_rate": math.inf, "seed": 3})]


def test_parse_rates_names_the_bad_part():
    from nano_engine.benchmarks.sweep import parse_rates

    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for text, message in [("1, fast", "'fast' is not a number of requests/s (or inf)"),
                          ("2,-1", "'-1': a request rate must be > 0 (or inf)")]:
        with pytest.raises(ValueError) as e:
            parse_rates(text)
        assert str(e.value) == message


# ----- datasets -----

def test_random_lengths_stay_in_the_range_and_avoid_special_ids(tokenizer):
    out = get_samples("random", 200, tokenizer=tokenizer, random_input_len=20, random_output_len=10,
                      random_range_ratio=0.5, seed=1)
    ins, outs = [len(r.prompt) for r in out], [r.expected_output_len for r in out]
    assert all(10 <= n <= 30 for n in ins) and all(5 <= n <= 15 for n in outs)
    assert min(ins) < 15 and max(ins) > 25  # the range is used, not just its middle
    assert all(r.prompt_len == len(r.prompt) for r in out)
    assert not set(tokenizer.all_special_ids) & {i for r in out for i in r.prompt}
    fixed = get_samples("random", 5, tokenizer=tokenizer, random_input_len=8, random_output_len=3)
    assert all(len(r.prompt) == 8 and r.expected_output_len == 3 for r in fixed)
    text = get_samples("random", 2, tokenizer=tokenizer, random_input_len=4, as_text=True)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 4 for r in text)


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
    with pytest.raises(ValueError, match=r"num_prompts \(2\) must be >= prefix_repetition_num_prefixes \(3\)"):
        get_samples("prefix_repetition", 2, tokenizer=tokenizer, prefix_repetition_num_prefixes=3)


def test_w2_loads_as_recorded():
    data = json.loads(loadgen_datasets.find_w2().read_text())["requests"]
    w2 = get_samples("w2", 64)
    assert sum(r.prompt_len for r in w2) == 12670 and sum(r.expected_output_len for r in w2) == 4606
    assert all(r.ignore_eos for r in w2) and w2[5].prompt == data[5]["prompt_ids"]
    assert get_samples("w2", 3, as_text=True)[2].prompt == data[2]["prompt"]
    assert get_samples("w2", 66)[65].prompt == data[1]["prompt_ids"]  # cycles in order
    with pytest.raises(FileNotFoundError, match="W2 workload not found"):
        get_samples("w2", 1, dataset_path="/nonexistent/w2.json")


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


def test_random_defaults_and_edges(tokenizer):
    default = loadgen_datasets.random_requests(tokenizer, 3)
    assert [(r.prompt_len, len(r.prompt), r.expected_output_len) for r in default] == [(1024, 1024, 128)] * 3
    assert isinstance(default[0].prompt, list)
    assert default == loadgen_datasets.random_requests(tokenizer, 3, 1024, 128, 0.0, seed=0)
    assert default != loadgen_datasets.random_requests(tokenizer, 3, 1024, 128, 0.0, seed=1)
    assert get_samples("random", 3, tokenizer=tokenizer) == default  # vLLM's defaults
    assert get_samples("random", 3, tokenizer=tokenizer, seed=5) == loadgen_datasets.random_requests(tokenizer, 3,
                                                                                                      seed=5)
    # The shortest lengths: one prompt token, one output token, with and without a range.
    one = get_samples("random", 20, tokenizer=tokenizer, random_input_len=1, random_output_len=1)
    assert all(r.prompt_len == 1 and r.expected_output_len == 1 for r in one)
    ranged = get_samples("random", 40, tokenizer=tokenizer, random_input_len=2, random_output_len=1,
                         random_range_ratio=0.5, seed=4)
    assert {r.prompt_len for r in ranged} == {1, 2, 3} and {r.expected_output_len for r in ranged} == {1, 2}
    assert len(get_samples("random", 1, tokenizer=tokenizer, random_input_len=2)) == 1


def test_random_offsets_reach_the_whole_vocabulary():
    """With no special ids, prompt i starts at (offset_i + i) mod vocabulary: every offset occurs."""
    tok = FakeVocab(vocab_size=4, special=[])
    out = loadgen_datasets.random_requests(tok, 200, input_len=1, output_len=1, seed=0)
    assert {(r.prompt[0] - i) % 4 for i, r in enumerate(out)} == {0, 1, 2, 3}


class FakeVocab:
    def __init__(self, vocab_size, special):
        self.vocab_size, self.all_special_ids = vocab_size, special

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_a_vocabulary_of_one_allowed_id_works_and_of_none_is_refused():
    one = FakeVocab(vocab_size=3, special=[0, 2])
    assert [r.prompt for r in loadgen_datasets.random_requests(one, 2, input_len=3, output_len=1)] == [[1, 1, 1]] * 2
    assert {tuple(r.prompt) for r in loadgen_datasets.prefix_repetition_requests(one, 2, 2, 1, 2, 1)} == {(1, 1, 1)}
    with pytest.raises(ValueError) as e:
        loadgen_datasets.random_requests(FakeVocab(vocab_size=2, special=[0, 1]), 1, 1, 1)
    assert str(e.value) == "the tokenizer's vocabulary (2 ids) holds only special tokens"


@pytest.mark.parametrize("call, message", [
    (lambda t: loadgen_datasets.random_requests(t, 0), "num_prompts must be an integer >= 1, got 0"),
    (lambda t: loadgen_datasets.random_requests(t, 2.5), "num_prompts must be an integer >= 1, got 2.5"),
    (lambda t: loadgen_datasets.random_requests(t, "3"), "num_prompts must be an integer >= 1, got '3'"),
    (lambda t: loadgen_datasets.random_requests(t, True), "num_prompts must be an integer >= 1, got True"),
    (lambda t: loadgen_datasets.random_requests(t, 1, input_len=0), "random_input_len must be an integer >= 1, got 0"),
    (lambda t: loadgen_datasets.random_requests(t, 1, output_len=-1),
     "random_output_len must be an integer >= 1, got -1"),
    (lambda t: loadgen_datasets.random_requests(t, 1, range_ratio=1.0),
     "random_range_ratio must be in [0, 1), got 1.0"),
    (lambda t: loadgen_datasets.random_requests(t, 1, range_ratio=1.5),
     "random_range_ratio must be in [0, 1), got 1.5"),
    (lambda t: loadgen_datasets.random_requests(t, 1, range_ratio=-0.1),
     "random_range_ratio must be in [0, 1), got -0.1"),
    (lambda t: loadgen_datasets.random_requests(t, 1, input_len=1, range_ratio=0.5),
     "random_input_len=1 with random_range_ratio=0.5 can draw an empty prompt (the shortest is floor(1 x 0.5) = 0)"),
    (lambda t: loadgen_datasets.prefix_repetition_requests(t, 0), "num_prompts must be an integer >= 1, got 0"),
    (lambda t: loadgen_datasets.prefix_repetition_requests(t, 1, prefix_len=-1),
     "prefix_repetition_prefix_len must be an integer >= 0, got -1"),
    (lambda t: loadgen_datasets.prefix_repetition_requests(t, 1, suffix_len=-2),
     "prefix_repetition_suffix_len must be an integer >= 0, got -2"),
    (lambda t: loadgen_datasets.prefix_repetition_requests(t, 1, num_prefixes=0),
     "prefix_repetition_num_prefixes must be an integer >= 1, got 0"),
    (lambda t: loadgen_datasets.prefix_repetition_requests(t, 1, num_prefixes=1, output_len=0),
     "prefix_repetition_output_len must be an integer >= 1, got 0"),
    (lambda t: loadgen_datasets.prefix_repetition_requests(t, 1, prefix_len=0, suffix_len=0, num_prefixes=1),
     "prefix_repetition_prefix_len + prefix_repetition_suffix_len must be >= 1, got 0"),
    (lambda t: loadgen_datasets.w2_requests(0), "num_prompts must be an integer >= 1, got 0"),
    (lambda t: get_samples("sharegpt", 1), "dataset_name must be one of random, w2, prefix_repetition, got 'sharegpt'"),
    (lambda t: get_samples("random", 1, tokenizer=t, dataset_path="w2.json"),
     "dataset_path is for the w2 dataset only, got 'w2.json' with 'random'"),
    (lambda t: get_samples("prefix_repetition", 10), "the prefix_repetition dataset needs a tokenizer (its vocabulary "
                                                     "and special ids)"),
])
def test_bad_dataset_arguments_name_the_value_and_the_limit(tokenizer, call, message):
    with pytest.raises(ValueError) as e:
        call(tokenizer)
    assert str(e.value) == message


def test_prefix_repetition_defaults_seeds_text_and_short_parts(tokenizer):
    default = loadgen_datasets.prefix_repetition_requests(tokenizer, 10)
    assert [(r.prompt_len, r.expected_output_len) for r in default] == [(512, 128)] * 10  # vLLM's defaults
    assert len({tuple(r.prompt[:256]) for r in default}) == 10 and isinstance(default[0].prompt, list)
    assert default == loadgen_datasets.prefix_repetition_requests(tokenizer, 10, seed=0)
    assert default != loadgen_datasets.prefix_repetition_requests(tokenizer, 10, seed=1)
    assert get_samples("prefix_repetition", 10, tokenizer=tokenizer) == default
    kw = dict(prefix_repetition_prefix_len=3, prefix_repetition_suffix_len=2, prefix_repetition_num_prefixes=2)
    ids = get_samples("prefix_repetition", 4, tokenizer=tokenizer, seed=6, **kw)
    assert ids == loadgen_datasets.prefix_repetition_requests(tokenizer, 4, 3, 2, 2, seed=6)
    text = get_samples("prefix_repetition", 4, tokenizer=tokenizer, seed=6, as_text=True, **kw)
    assert [r.prompt for r in text] == [tokenizer.decode(r.prompt) for r in ids]
    assert [r.prompt_len for r in text] == [5] * 4
    assert all(len(r.prompt) == 1 for r in loadgen_datasets.prefix_repetition_requests(tokenizer, 2, 0, 1, 1, 1))
    assert all(len(r.prompt) == 1 for r in loadgen_datasets.prefix_repetition_requests(tokenizer, 2, 1, 0, 1, 1))


def test_prefix_repetition_draws_from_every_allowed_id(tokenizer):
    out = get_samples("prefix_repetition", 60, tokenizer=tokenizer, prefix_repetition_prefix_len=4,
                      prefix_repetition_suffix_len=4, prefix_repetition_num_prefixes=30)
    assert {i for r in out for i in r.prompt[:4]} == set(range(3, 15))
    assert {i for r in out for i in r.prompt[4:]} == set(range(3, 15))


def test_w2_defaults_and_a_record_without_ignore_eos(tmp_path, monkeypatch):
    w2 = loadgen_datasets.w2_requests()
    assert len(w2) == 64 and isinstance(w2[0].prompt, list) and get_samples("w2", None) == w2
    data = json.loads(loadgen_datasets.find_w2().read_text())
    for r in data["requests"]:
        del r["ignore_eos"]
    path = tmp_path / "w2.json"
    path.write_text(json.dumps(data))
    assert not any(r.ignore_eos for r in get_samples("w2", 3, dataset_path=str(path)))
    monkeypatch.setattr(loadgen_datasets, "W2_PATHS", (tmp_path / "a.json", tmp_path / "b.json"))
    with pytest.raises(FileNotFoundError) as e:
        loadgen_datasets.find_w2()
    assert str(e.value) == f"W2 workload not found; looked for {tmp_path / 'a.json'}, {tmp_path / 'b.json'}"


# ----- the command line -----

def cli(capsys, *argv):
    code = loadgen.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


@pytest.mark.parametrize("argv, message", [
    (["--num-prompts", "0"], "argument --num-prompts: 0 must be >= 1"),
    (["--request-rate", "0"], "argument --request-rate: 0 must be > 0"),
    (["--request-rate", "fast"], "argument --request-rate: 'fast' is not a number"),
    (["--burstiness", "-1"], "argument --burstiness: -1 must be > 0"),
    (["--random-range-ratio", "1"], "argument --random-range-ratio: 1 must be >= 0 and < 1"),
    (["--max-concurrency", "0"], "argument --max-concurrency: 0 must be >= 1"),
    (["--backend", "tgi"], "argument --backend: invalid choice: 'tgi' (choose from 'openai', 'openai-chat')"),
    (["--dataset-name", "sharegpt"], "argument --dataset-name: invalid choice: 'sharegpt' (choose from "
                                     "'random', 'w2', 'prefix_repetition')"),
    (["--goodput", "ttft=5"], "argument --goodput: goodput: 'ttft=5' is not NAME:MS (a metric name and a "
                              "number of milliseconds), e.g. 'ttft:500'"),
    (["--goodput", "itl:5"], "argument --goodput: goodput SLO name 'itl' is unknown; allowed: ttft, tpot, e2el"),
    (["--percentile-metrics", "ttft,foo"], "argument --percentile-metrics: 'foo' is not a metric; allowed: "
                                           "ttft,tpot,itl,e2el"),
    (["--metric-percentiles", "99,101"], "argument --metric-percentiles: 101 is not a percentile (0 to 100)"),
    (["--request-rates", "1,0"], "argument --request-rates: '0': a request rate must be > 0 (or inf)"),
    (["--base-url", "localhost:8000"], "argument --base-url: 'localhost:8000' is not an http:// or https:// "
                                       "URL with a host"),
    (["--request-rate", "2", "--request-rates", "1,2"], "--request-rate and --request-rates: give one or the other"),
    (["--dataset-path", "x.json"], "--dataset-path is for --dataset-name w2, not random"),
    (["--metric-percentiles", "50,x"], "argument --metric-percentiles: 'x' is not a number"),
    (["--num-prompts", "x"], "argument --num-prompts: 'x' is not an integer"),
    (["--port", "65536"], "argument --port: 65536 must be >= 1 and < 65536"),
    (["--burstiness", "nan"], "argument --burstiness: nan must be > 0"),
    (["--metric-percentiles", "-1"], "argument --metric-percentiles: -1 is not a percentile (0 to 100)"),
    (["--base-url", "ftp://h:1"], "argument --base-url: 'ftp://h:1' is not an http:// or https:// URL with a host"),
    (["--base-url", "http://"], "argument --base-url: 'http://' is not an http:// or https:// URL with a host"),
    (["--dataset-name", "prefix_repetition", "--num-prompts", "4"],
     "--num-prompts 4 is below --prefix-repetition-num-prefixes 10: each prefix needs a prompt"),
])
def test_bad_argument_exits_2_with_one_line_before_anything_loads(capsys, monkeypatch, argv, message):
    def no_load(*a, **k):
        raise AssertionError("the tokenizer was loaded before the arguments were checked")

    monkeypatch.setattr("nano_engine.models.loading.load_tokenizer", no_load)
    code, out, err = cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err[0].startswith("usage: python -m nano_engine bench-serve") and err[-1] == PREFIX + message


def test_cli_runs_w2_and_saves_vllm_keys(capsys, fake, tmp_path):
    path = tmp_path / "r.json"
    with fake(chunks=[(0, "a"), (0.01, "b")], usage_tokens=2) as s:
        code, out, err = cli(capsys, "--base-url", s.url, "--dataset-name", "w2", "--num-prompts", "4",
                             "--disable-tqdm", "--save-result", "--result-filename", str(path),
                             "--goodput", "ttft:60000", "e2el:60000")
    assert code == 0, err
    assert re.search(r"^Successful requests: +4$", out, re.M) and "P99 ITL (ms):" in out
    result = json.loads(path.read_text())
    for key in ("completed", "request_throughput", "request_goodput", "output_throughput", "mean_ttft_ms",
                "median_tpot_ms", "p90_itl_ms", "p99_e2el_ms", "ttfts", "itls", "model_id", "request_rate"):
        assert key in result, key
    assert result["request_rate"] == "inf" and len(result["itls"]) == 4 and all(len(i) == 1 for i in result["itls"])
    assert all(b["ignore_eos"] for b in s.bodies)  # W2's own setting


def test_cli_sweep_writes_the_plot_and_the_table(capsys, fake, tmp_path):
    stem = tmp_path / "sweep"
    with fake(usage_tokens=2) as s:
        code, out, err = cli(capsys, "--base-url", s.url, "--dataset-name", "w2", "--num-prompts", "3",
                             "--disable-tqdm", "--request-rates", "50,inf", "--sweep-output", str(stem),
                             "--percentile-metrics", "ttft,e2el")
    assert code == 0, err
    table = (tmp_path / "sweep.md").read_text().splitlines()
    assert table[0].startswith("| rate (req/s) |") and "TTFT median / p99 (ms)" in table[0]
    assert [row.split("|")[1].strip() for row in table[2:]] == ["50", "inf"]
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "Time per Output Token" not in out and "End-to-end Latency" in out


def test_cli_every_request_failed_exits_1_with_the_first_error(capsys, fake):
    with fake(status=400) as s:
        code, out, err = cli(capsys, "--base-url", s.url, "--dataset-name", "w2", "--num-prompts", "2",
                             "--disable-tqdm")
    assert code == 1 and err == [PREFIX + "all 2 requests failed; the first: HTTP 400: max_tokens is too large"]


def test_cli_random_dataset_ignores_eos_as_vllm(capsys, fake, tmp_path, monkeypatch, tokenizer):
    monkeypatch.setattr("nano_engine.models.loading.load_tokenizer", lambda path=None: tokenizer)
    with fake(usage_tokens=2) as s:
        code, out, err = cli(capsys, "--base-url", s.url, "--num-prompts", "3", "--random-input-len", "5",
                             "--random-output-len", "2", "--disable-tqdm")
    assert code == 0, err
    assert all(b["ignore_eos"] and len(b["prompt"]) == 5 and b["max_tokens"] == 2 for b in s.bodies)


def test_cli_defaults_are_vllms_but_the_two_documented():
    """vLLM's defaults (vllm/benchmarks/serve.py and datasets/), except --num-prompts (vLLM 1000)
    and the percentiles (vLLM: ttft,tpot,itl at p99), as the module's docstring says."""
    from nano_engine.cli import bench_serve as loadgen_cli

    assert vars(loadgen_cli.build_parser().parse_args([])) == {
        "backend": "openai", "base_url": None, "host": "127.0.0.1", "port": 8000, "model": None, "tokenizer": None,
        "dataset_name": "random", "dataset_path": None, "num_prompts": 64, "random_input_len": 1024,
        "random_output_len": 128, "random_range_ratio": 0.0, "prefix_repetition_prefix_len": 256,
        "prefix_repetition_suffix_len": 256, "prefix_repetition_num_prefixes": 10,
        "prefix_repetition_output_len": 128, "request_rate": math.inf, "request_rates": None,
        "sweep_output": "bench_serve_sweep", "burstiness": 1.0, "max_concurrency": None, "num_warmups": 0,
        "ignore_eos": False, "seed": 0, "goodput": None, "percentile_metrics": ["ttft", "tpot", "itl", "e2el"],
        "metric_percentiles": [90.0, 99.0], "timeout": 600.0, "save_result": False, "result_filename": None,
        "label": None, "disable_tqdm": False, "debug": False}


def test_cli_help_reads_as_recorded(capsys, monkeypatch):
    """The help a user reads, whole (flags, metavars, choices, every help line, the description).
    After changing it on purpose: COLUMNS=100 python -m nano_engine bench-serve --help >
    tests/data/bench_serve_help.txt, and read the diff."""
    from pathlib import Path

    monkeypatch.setenv("COLUMNS", "100")
    assert loadgen.main(["--help"]) == 0
    recorded = (Path(__file__).parent / "data" / "bench_serve_help.txt").read_text()
    assert capsys.readouterr().out == recorded


def spy_on_the_cli(monkeypatch, tokenizer):
    """Record what bench-serve hands to get_samples, load_tokenizer and measure (the real ones run)."""
    from nano_engine.cli import bench_serve as loadgen_cli

    calls = {"tokenizer": []}
    real_samples, real_measure = loadgen_cli.get_samples, loadgen_cli.measure

    def samples(*args, **kwargs):
        calls["samples"] = (args, kwargs)
        calls["requests"] = real_samples(*args, **kwargs)
        return calls["requests"]

    async def measure(*args, **kwargs):
        calls["measure"] = (args, kwargs)
        calls["result"], calls["metrics"] = await real_measure(*args, **kwargs)
        return calls["result"], calls["metrics"]

    def load_tokenizer(path=None):
        calls["tokenizer"].append(path)
        return tokenizer

    monkeypatch.setattr(loadgen_cli, "get_samples", samples)
    monkeypatch.setattr(loadgen_cli, "measure", measure)
    monkeypatch.setattr("nano_engine.models.loading.load_tokenizer", load_tokenizer)
    return calls


def test_cli_hands_every_flag_to_the_dataset_and_the_benchmark(capsys, fake, monkeypatch, tokenizer, tmp_path):
    from nano_engine.benchmarks.metrics import format_metrics

    calls = spy_on_the_cli(monkeypatch, tokenizer)
    monkeypatch.chdir(tmp_path)
    with fake(usage_tokens=2) as s:
        code, out, err = cli(
            capsys, "--base-url", s.url + "/", "--backend", "openai-chat", "--model", "org/served", "--tokenizer",
            "/models/tok", "--dataset-name", "prefix_repetition", "--num-prompts", "4",
            "--prefix-repetition-prefix-len", "3", "--prefix-repetition-suffix-len", "2",
            "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "5", "--request-rate", "50",
            "--burstiness", "0.5", "--max-concurrency", "2", "--num-warmups", "1", "--seed", "7", "--goodput",
            "ttft:60000", "e2el:50000", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "0,100",
            "--timeout", "30", "--disable-tqdm", "--label", "mine", "--save-result")
    assert code == 0, err
    assert calls["tokenizer"] == ["/models/tok"]
    assert calls["samples"] == (("prefix_repetition", 4), dict(
        tokenizer=tokenizer, as_text=True, seed=7, dataset_path=None, random_input_len=1024, random_output_len=128,
        random_range_ratio=0.0, prefix_repetition_prefix_len=3, prefix_repetition_suffix_len=2,
        prefix_repetition_num_prefixes=2, prefix_repetition_output_len=5))
    assert calls["measure"] == ((calls["requests"], s.url), dict(
        backend="openai-chat", model="org/served", request_rate=50.0, burstiness=0.5, max_concurrency=2,
        num_warmups=1, ignore_eos=False, seed=7, goodput={"ttft": 60000.0, "e2el": 50000.0},
        percentiles=[0.0, 100.0], percentile_metrics=["ttft", "e2el"], timeout=30.0, disable_tqdm=True))
    lines = out.splitlines()
    assert lines[0] == (f"4 requests (prefix_repetition) to {s.url}/v1/chat/completions; request rate 50/s, "
                        "burstiness 0.5 (gamma distribution), max concurrency 2")
    full = format_metrics(calls["metrics"]).splitlines()
    tpot = next(i for i, line in enumerate(full) if "Time per Output Token" in line)
    e2el = next(i for i, line in enumerate(full) if "End-to-end Latency" in line)
    assert lines[1:-1] == full[:tpot] + full[e2el:]  # the selected sections only, and the closing rule
    (saved,) = tmp_path.glob("*.json")
    assert re.fullmatch(r"mine-50\.0qps-concurrency2-served-\d{8}-\d{6}\.json", saved.name), saved.name
    assert lines[-1] == f"wrote {saved.name}"
    result = json.loads(saved.read_text())
    assert result["label"] == "mine" and result["tokenizer_id"] == "/models/tok"
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # both SLOs are lax


def test_cli_reads_w2_from_its_path_without_a_tokenizer_and_names_files_by_default(capsys, fake, monkeypatch,
                                                                                    tokenizer, tmp_path):
    from nano_engine.cli import bench_serve as loadgen_cli

    calls = spy_on_the_cli(monkeypatch, tokenizer)
    monkeypatch.chdir(tmp_path)
    data = json.loads(loadgen_datasets.find_w2().read_text())
    data["requests"] = data["requests"][:2]
    data["requests"][0]["prompt_ids"] = [3, 4, 5]
    (tmp_path / "mine.json").write_text(json.dumps(data))
    with fake(usage_tokens=2) as s:
        code, out, err = cli(capsys, "--base-url", s.url, "--dataset-name", "w2", "--dataset-path", "mine.json",
                             "--num-prompts", "2", "--disable-tqdm", "--save-result", "--percentile-metrics", "ttft")
        assert code == 0, err
        assert calls["tokenizer"] == [] and calls["samples"][1]["tokenizer"] is None
        assert [b["prompt"] for b in s.bodies] == [[3, 4, 5], data["requests"][1]["prompt_ids"]]
        lines = out.splitlines()
        assert lines[0] == (f"2 requests (w2) to {s.url}/v1/completions; request rate inf/s, burstiness 1 "
                            "(Poisson process), max concurrency None")
        assert lines[-2] == "=" * 50  # the closing rule stays after the last section is left out
        (saved,) = tmp_path.glob("openai-*.json")
        assert re.fullmatch(r"openai-infqps-fake-model-\d{8}-\d{6}\.json", saved.name), saved.name
        assert json.loads(saved.read_text())["tokenizer_id"] is None
        saved.unlink()
        code, out, err = cli(capsys, "--base-url", s.url, "--dataset-name", "w2", "--num-prompts", "2",
                             "--disable-tqdm", "--save-result", "--request-rates", "100,inf",
                             "--sweep-output", "sw")
        assert code == 0, err
        (saved,) = tmp_path.glob("openai-*.json")
        assert re.fullmatch(r"openai-sweep-fake-model-\d{8}-\d{6}\.json", saved.name), saved.name
        assert [r["request_rate"] for r in json.loads(saved.read_text())] == [100.0, "inf"]
        assert out.splitlines()[-2:] == ["wrote sw.md and sw.png", f"wrote {saved.name}"]
        titles = []
        real_plot = loadgen_cli.plot_sweep
        def plot_and_record(*a, **kw):
            titles.append(kw["title"])
            return real_plot(*a, **kw)
        monkeypatch.setattr(loadgen_cli, "plot_sweep", plot_and_record)
        code, out, err = cli(capsys, "--base-url", s.url, "--dataset-name", "w2", "--num-prompts", "1",
                             "--disable-tqdm", "--request-rates", "5", "--sweep-output", "one")
    assert code == 0, err
    assert titles == ["w2, fake-model"] and (tmp_path / "one.png").is_file() and (tmp_path / "one.md").is_file()


def test_cli_random_dataset_gets_its_lengths_ratio_and_seed(capsys, fake, monkeypatch, tokenizer):
    calls = spy_on_the_cli(monkeypatch, tokenizer)
    with fake(usage_tokens=2) as s:
        code, out, err = cli(capsys, "--base-url", s.url, "--num-prompts", "3", "--random-input-len", "6",
                             "--random-output-len", "3", "--random-range-ratio", "0.5", "--seed", "4",
                             "--disable-tqdm")
    assert code == 0, err
    assert calls["tokenizer"] == [None]  # the default: $NANO_ENGINE_MODEL, else the embedded model
    assert calls["samples"][1] | {"tokenizer": None} == dict(
        tokenizer=None, as_text=False, seed=4, dataset_path=None, random_input_len=6, random_output_len=3,
        random_range_ratio=0.5, prefix_repetition_prefix_len=256, prefix_repetition_suffix_len=256,
        prefix_repetition_num_prefixes=10, prefix_repetition_output_len=128)
    assert calls["measure"][1]["ignore_eos"] is True  # set for random, as vLLM


def test_cli_value_parsers_take_their_edges():
    from nano_engine.cli import bench_serve as loadgen_cli

    args = loadgen_cli.build_parser().parse_args(["--metric-percentiles", "0, 100", "--base-url", "https://h:1/"])
    assert args.metric_percentiles == [0.0, 100.0] and args.base_url == "https://h:1"
    assert loadgen_cli.build_parser().parse_args(["--base-url", "http://h"]).base_url == "http://h"
    assert loadgen_cli.build_parser().parse_args(["--base-url", "http://boX//"]).base_url == "http://boX"
    edges = vars(loadgen_cli.build_parser().parse_args([
        "--num-prompts", "1", "--num-warmups", "0", "--seed", "0", "--random-range-ratio", "0", "--port", "1",
        "--random-input-len", "1", "--random-output-len", "1", "--prefix-repetition-prefix-len", "0",
        "--prefix-repetition-suffix-len", "0", "--prefix-repetition-num-prefixes", "1",
        "--prefix-repetition-output-len", "1", "--max-concurrency", "1", "--timeout", "0.5", "--burstiness", "0.5",
        "--request-rate", "0.5"]))
    ints = {"num_prompts": 1, "num_warmups": 0, "seed": 0, "port": 1, "random_input_len": 1, "random_output_len": 1,
            "prefix_repetition_prefix_len": 0, "prefix_repetition_suffix_len": 0, "prefix_repetition_num_prefixes": 1,
            "prefix_repetition_output_len": 1, "max_concurrency": 1}
    assert {k: edges[k] for k in ints} == ints and all(type(edges[k]) is int for k in ints)  # ints, not floats
    assert (edges["random_range_ratio"], edges["timeout"], edges["burstiness"], edges["request_rate"]) == (
        0.0, 0.5, 0.5, 0.5)
    assert loadgen_cli.build_parser().parse_args(["--port", "65535"]).port == 65535


def test_benchmark_defaults_to_the_local_server(monkeypatch):
    seen = []

    async def fake_run(requests, base_url, **kwargs):
        seen.append((base_url, kwargs))
        return {}

    monkeypatch.setattr(loadgen, "run_benchmark", fake_run)
    assert loadgen.benchmark(reqs(1), seed=2) == {}
    assert seen == [("http://127.0.0.1:8000", {"seed": 2})]


def test_cli_prefix_repetition_takes_as_many_prompts_as_prefixes(capsys, fake, monkeypatch, tokenizer):
    spy_on_the_cli(monkeypatch, tokenizer)
    with fake(usage_tokens=2) as s:
        code, out, err = cli(capsys, "--base-url", s.url, "--dataset-name", "prefix_repetition", "--num-prompts", "2",
                             "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-prefix-len", "2",
                             "--prefix-repetition-suffix-len", "1", "--disable-tqdm")
    assert code == 0, err
    assert len(s.bodies) == 2


def test_a_server_error_that_is_not_json_is_cut_and_kept_readable():
    assert loadgen._error_text(502, b"\xff" + b"x" * 300) == "HTTP 502: \ufffd" + "x" * 199
    assert loadgen._error_text(400, b'{"error": {"message": "too\\n  long"}}') == "HTTP 400: too long"


def mock_client(handler):
    import httpx

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def sse(*events: str) -> bytes:
    return "".join(f"{e}\n\n" for e in events).encode()


def test_a_stream_is_read_as_sse_and_ends_at_done():
    """Events with and without the space after "data:", a comment, a chunk whose text is empty
    or missing (still one chunk, as vLLM counts it), and nothing after [DONE]."""
    import httpx

    def handler(request):
        assert request.method == "POST" and json.loads(request.content)["model"] == "m"
        chunk = lambda text: json.dumps({"choices": [{"text": text}]})
        body = sse(f"data: {chunk('a')}", ": ping", f"data:{chunk('b')}", f"data: {chunk('')}",
                   'data: {"choices": [{"index": 0}]}', 'data: {"choices": [], "usage": {"completion_tokens": 4}}',
                   "data: [DONE]", f"data: {chunk('late')}")
        return httpx.Response(200, content=body)

    async def main():
        async with mock_client(handler) as client:
            return await loadgen.send_request(client, "http://h/v1/completions", "openai", {"model": "m"}, 3, 5)

    record, text = asyncio.run(main())
    assert text == "ab" and record.success and len(record.chunk_times) == 4 and record.output_tokens == 4
    assert record.prompt_tokens == 3  # a usage chunk without prompt_tokens keeps the sent length


@pytest.mark.parametrize("events, error", [
    (['data: {"choices": [{"text": "a"}]}', 'data: {"choices": [{"text": "b"}]}',
      'data: {"error": {"message": "engine   died"}}', "data: [DONE]"], "stream error: engine   died"),
    (['data: {"error": "out of blocks"}', "data: [DONE]"], "stream error: out of blocks"),
    (['data: {"error": {"code": 500}}', "data: [DONE]"], "stream error: {'code': 500}"),
    (["data: [DONE]"], "the stream ended without an output chunk (no TTFT)"),
])
def test_an_error_in_the_stream_or_no_chunk_at_all_is_a_failed_record(events, error):
    import httpx

    async def main():
        async with mock_client(lambda request: httpx.Response(200, content=sse(*events))) as client:
            return await loadgen.send_request(client, "http://h/v1/completions", "openai", {}, 3, 5)

    record, text = asyncio.run(main())
    assert not record.success and record.error == error and record.output_tokens == 0
    assert text == ("ab" if len(events) == 4 else "")  # what came before the error is kept


@pytest.mark.parametrize("exc, error", [("a\n   dropped", "ReadError: a dropped"), ("", "ReadError: (no message)")])
def test_a_transport_error_is_one_line_in_the_record(exc, error):
    import httpx

    def handler(request):
        raise httpx.ReadError(exc, request=request)

    async def main():
        async with mock_client(handler) as client:
            return await loadgen.send_request(client, "http://h/v1/completions", "openai", {}, 3, 5)

    record, _ = asyncio.run(main())
    assert record.error == error and not record.success


def test_arrival_times_default_seed_and_short_runs_are_rescaled():
    assert arrival_times(5, 2.0) == arrival_times(5, 2.0, seed=0) != arrival_times(5, 2.0, seed=1)
    assert arrival_times(3, 100.0)[-1] == pytest.approx(0.03)  # rescaled even when the draws sum to under 1 s


def test_a_server_without_models_names_the_url_and_the_error():
    import httpx

    def handler(request):
        raise httpx.ConnectError("no\n   route", request=request)

    async def main():
        async with mock_client(handler) as client:
            await loadgen.first_model(client, "http://h:1")

    with pytest.raises(RuntimeError) as e:
        asyncio.run(main())
    assert str(e.value) == ("cannot read the first model from http://h:1/v1/models (ConnectError: no route); "
                            "is the server running? or pass --model")


def test_run_benchmark_defaults_to_the_local_server(monkeypatch):
    seen = []

    async def fake_measure(requests, base_url, **kwargs):
        seen.append((base_url, kwargs))
        return {"r": 1}, None

    monkeypatch.setattr(loadgen, "measure", fake_measure)
    assert asyncio.run(loadgen.run_benchmark(reqs(1), timeout=3)) == {"r": 1}
    assert seen == [("http://127.0.0.1:8000", {"timeout": 3})]


def test_measure_defaults_are_vllms():
    import inspect

    from nano_engine.benchmarks.metrics import METRIC_NAMES

    defaults = {k: p.default for k, p in inspect.signature(loadgen.measure).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert defaults == {"base_url": "http://127.0.0.1:8000", "backend": "openai", "model": None,
                        "request_rate": math.inf, "burstiness": 1.0, "max_concurrency": None, "num_warmups": 0,
                        "ignore_eos": False, "seed": 0, "goodput": None, "percentiles": (90, 99),
                        "percentile_metrics": METRIC_NAMES, "timeout": 600.0, "disable_tqdm": False,
                        "extra_body": None}
    assert inspect.signature(sample_intervals).parameters["burstiness"].default == 1.0


def test_sample_intervals_edges():
    assert sample_intervals(3, 4.0, math.inf).tolist() == [0.25] * 3  # even arrivals: exactly 1/rate apart
    assert sample_intervals(4, math.inf).tolist() == [0.0] * 4
    assert (sample_intervals(5, 2.0) == sample_intervals(5, 2.0, rng=np.random.RandomState(0))).all()
    assert (sample_intervals(5, 2.0) == sample_intervals(5, 2.0, 1.0)).all()  # Poisson by default
    for rate, burstiness, message in [(1.0, 0, "burstiness must be > 0, got 0"),
                                      (0, 1.0, "request_rate must be > 0 requests/s (or inf), got 0")]:
        with pytest.raises(ValueError) as e:
            sample_intervals(3, rate, burstiness)
        assert str(e.value) == message
    with pytest.raises(ValueError, match="num_warmups must be an integer >= 0, got True"):
        asyncio.run(run_benchmark(reqs(1), "http://127.0.0.1:9", num_warmups=True))


class RecordingBar:
    made = []

    def __init__(self, total=None, desc=None):
        self.total, self.desc, self.updates, self.closed = total, desc, [], False
        RecordingBar.made.append(self)

    def update(self, n):
        self.updates.append(n)

    def close(self):
        self.closed = True


def test_one_run_end_to_end_what_it_sends_and_keeps(fake, monkeypatch):
    """Warm-ups repeat the first request; the progress bar counts the measured requests; the
    client has no pool limit of its own beyond max_concurrency, no pool time-out, and no proxy
    from the environment; the seed reaches the arrival times; the result holds vLLM's settings."""
    import httpx

    clients, arrivals = [], []
    real_client, real_arrivals = httpx.AsyncClient, loadgen.arrival_times

    def client(**kwargs):
        clients.append(kwargs)
        return real_client(**kwargs)

    def arrival(*args):
        arrivals.append(args)
        return real_arrivals(*args)

    monkeypatch.setattr(loadgen.httpx, "AsyncClient", client)
    monkeypatch.setattr(loadgen, "arrival_times", arrival)
    monkeypatch.setattr("tqdm.auto.tqdm", RecordingBar)
    RecordingBar.made.clear()
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # a dead proxy: used, every request would fail
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    requests = [SampleRequest([3 + i, 4], 2, 2) for i in range(3)]
    with fake(usage_tokens=2) as s:
        r = asyncio.run(run_benchmark(requests, s.url + "/", num_warmups=2, max_concurrency=2, request_rate=500.0,
                                      burstiness=2.0, seed=9, timeout=7, extra_body={"temperature": 0.5}))
    assert r["completed"] == 3
    assert [b["prompt"] for b in s.bodies[:2]] == [[3, 4]] * 2 and sorted(b["prompt"] for b in s.bodies[2:]) == [
        [3, 4], [4, 4], [5, 4]]
    assert all(b["temperature"] == 0.5 and b["model"] == "fake-model" for b in s.bodies)
    (bar,) = RecordingBar.made
    assert (bar.total, bar.desc, bar.updates, bar.closed) == (3, "requests", [1, 1, 1], True)
    (kw,) = clients
    assert (kw["limits"].max_connections, kw["limits"].max_keepalive_connections) == (2, 2)
    assert kw["timeout"] == httpx.Timeout(7, pool=None) and kw["trust_env"] is False
    assert arrivals == [(3, 500.0, 2.0, 9)]
    assert re.fullmatch(r"\d{8}-\d{6}", r["date"])
    assert {k: r[k] for k in ("endpoint_type", "backend", "model_id", "num_prompts", "request_rate", "burstiness",
                              "max_concurrency")} == {
        "endpoint_type": "openai", "backend": "openai", "model_id": "fake-model", "num_prompts": 3,
        "request_rate": 500.0, "burstiness": 2.0, "max_concurrency": 2}


def test_measure_with_its_defaults_talks_to_the_local_server_at_once_with_a_bar(monkeypatch):
    """No server runs: httpx's MockTransport answers in-process, and records every URL asked."""
    import httpx

    urls, clients, arrivals = [], [], []
    real_client, real_arrivals = httpx.AsyncClient, loadgen.arrival_times

    def handler(request):
        urls.append(str(request.url))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, content=sse('data: {"choices": [{"text": "a"}]}', "data: [DONE]"))

    def client(**kwargs):
        clients.append(kwargs)
        return real_client(transport=httpx.MockTransport(handler), **kwargs)

    def arrival(*args):
        arrivals.append(args)
        return real_arrivals(*args)

    monkeypatch.setattr(loadgen.httpx, "AsyncClient", client)
    monkeypatch.setattr(loadgen, "arrival_times", arrival)
    monkeypatch.setattr("tqdm.auto.tqdm", RecordingBar)
    RecordingBar.made.clear()
    result, metrics = asyncio.run(loadgen.measure(reqs(2)))
    assert urls == ["http://127.0.0.1:8000/v1/models"] + ["http://127.0.0.1:8000/v1/completions"] * 2
    assert arrivals == [(2, math.inf, 1.0, 0)] and clients[0]["timeout"] == httpx.Timeout(600.0, pool=None)
    assert len(RecordingBar.made) == 1 and metrics.completed == 2 and result["model_id"] == "m"
    urls.clear()
    asyncio.run(loadgen.measure(reqs(1), "http://boX//", disable_tqdm=True))  # only the slashes are cut
    assert urls == ["http://box/v1/models", "http://box/v1/completions"]

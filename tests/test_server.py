"""The OpenAI-compatible server, through the real `openai` client, on the embedded model.

A server runs in this process (uvicorn in a thread, 127.0.0.1, a free port) so that the tests can
look inside its engine; test_serve_cli_* start `python -m nano_engine serve` as a child process.
Both are stopped by the fixture that started them, whatever happens in the test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient

from nano_engine import LLMEngine, SamplingParams, generate
from nano_engine.serving.async_llm import AsyncLLM, EngineDeadError, RequestOutput
from nano_engine.serving.launcher import ServerProcess
from nano_engine.models.loading import chat_prompt_ids
from nano_engine.serving.protocol import APIError, ChatCompletionRequest as Chat, CompletionRequest as Comp
from nano_engine.sampling import SampleLogprobs
from nano_engine.serving.server import OpenAIServing, _disconnected, _text, build_app

NUM_BLOCKS, BLOCK_SIZE = 128, 16
CHAT = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
        "What is 2 + 2?", "Say hello in Spanish.", "Why is the sky blue?", "Give me a fruit.",
        "Count from one to five.", "What do cats eat?", "Name a planet.", "What is rain?",
        "Tell me a fun fact.", "What is Python?", "Describe a tree.", "What is music?", "Say goodbye."]


@pytest.fixture(scope="module")
def served_engine():
    """One engine and its AsyncLLM for the module (the model loads once)."""
    engine = LLMEngine.from_pretrained(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=16,
                                       max_num_batched_tokens=256)
    llm = AsyncLLM(engine)
    try:
        yield engine, llm
    finally:
        llm.shutdown()


@contextlib.contextmanager
def serving(app):
    """uvicorn serving `app` in a thread on 127.0.0.1 (a free port); stopped on the way out."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not srv.started:
            assert thread.is_alive() and time.time() < deadline, "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(30)
        sock.close()
    assert not thread.is_alive()


@pytest.fixture
def server(served_engine):
    """A fresh app (build_app, its metrics) for each test, on the module's engine: each test then
    calls build_app itself, so that mutation testing ties the app's code to every test that uses it."""
    engine, llm = served_engine
    with serving(build_app(llm, "smol")) as url:
        yield SimpleNamespace(url=url, engine=engine, tok=engine.tokenizer, llm=llm,
                              client=openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                                   timeout=300))


def reference(s, ids: list[int], max_tokens: int) -> list[int]:
    """Single-request greedy generate: the tokens every served request must equal."""
    return generate(s.engine.model, ids, max_tokens, eos_token_id=s.engine.model.config.eos_token_id)


def chat_ids(s, text: str) -> list[int]:
    return chat_prompt_ids(s.tok, text)


def metrics(s) -> dict[str, float]:
    text = httpx.get(f"{s.url}/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(vllm:\w+)\{[^}]*\} (\S+)$", text, re.M)}


def wait_idle(s, timeout: float = 60) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        m = metrics(s)
        if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0) or time.time() > deadline:
            return m
        time.sleep(0.05)


def test_models_and_health(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["smol"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion_equals_single_request_generate(server):
    ids = server.tok("The capital of France is")["input_ids"]
    want = reference(server, ids, 12)
    for prompt in (ids, "The capital of France is"):
        r = server.client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == server.tok.decode(want, skip_special_tokens=True)
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
        assert r.choices[0].finish_reason == ("length" if len(want) == 12 else "stop")


def test_chat_streamed_equals_unstreamed_and_ends_with_the_usage_chunk(server):
    messages = [{"role": "user", "content": "Write one sentence about the moon."}]
    plain = server.client.chat.completions.create(model="smol", messages=messages, max_tokens=20, temperature=0)
    chunks = list(server.client.chat.completions.create(model="smol", messages=messages, max_tokens=20,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == plain.usage.completion_tokens
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens == len(chat_ids(server, messages[0]["content"]))
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == plain.choices[0].message.content
    assert body[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    want = reference(server, chat_ids(server, messages[0]["content"]), 20)
    assert plain.choices[0].message.content == server.tok.decode(want, skip_special_tokens=True)
    # The prompt was sent twice: the second time its full blocks came from the prefix cache.
    cached = (len(chat_ids(server, messages[0]["content"])) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert last.usage.prompt_tokens_details.cached_tokens == cached > 0


def test_streamed_text_never_splits_a_character(server):
    prompts = ["请用中文回答：天空为什么是蓝色的？", "Répondez en français : qu'est-ce qu'un café crème ?",
               "Write three emoji about food: 🍕"]
    non_ascii = 0
    for text in prompts:
        messages = [{"role": "user", "content": text}]
        plain = server.client.chat.completions.create(model="smol", messages=messages, max_tokens=40,
                                                      temperature=0).choices[0].message.content
        pieces = [c.choices[0].delta.content or "" for c in server.client.chat.completions.create(
            model="smol", messages=messages, max_tokens=40, temperature=0, stream=True) if c.choices]
        assert "".join(pieces) == plain
        # Half a character is never sent; only a reply cut by max_tokens mid-character ends in U+FFFD
        # (as tokenizer.decode of all its tokens does), in its last piece.
        assert all("\ufffd" not in p for p in pieces[:-1])
        non_ascii += sum(ord(ch) > 127 for ch in plain)
    assert non_ascii > 5  # the test saw multi-byte characters stream


def test_stop_strings_cut_the_text_streamed_or_not(server):
    prompt = "The capital of France is"
    full = server.client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    stop = full.strip().split()[1][:3]  # a piece of the second word
    at = full.index(stop)
    for include in (False, True):
        extra = {"include_stop_str_in_output": include}
        r = server.client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0,
                                             stop=[stop, "never-seen"], extra_body=extra)
        want = full[:at + len(stop)] if include else full[:at]
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
        streamed = "".join(c.choices[0].text for c in server.client.completions.create(
            model="smol", prompt=prompt, max_tokens=12, temperature=0, stop=stop, stream=True, extra_body=extra))
        assert streamed == want


def test_a_seeded_sampled_request_is_reproducible(server):
    def sample(seed):
        return server.client.completions.create(model="smol", prompt="Once upon a time", max_tokens=16,
                                                temperature=1.0, top_p=0.95, seed=seed).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(1234), sample(1), sample(2)}) > 1


def test_a_cache_salt_keeps_cached_prefixes_apart(server):
    prompt = "Salted prompts share cached blocks only with the same salt. " * 4

    def cached(salt):
        body = {"cache_salt": salt} if salt else {}
        r = server.client.completions.create(model="smol", prompt=prompt, max_tokens=1, temperature=0, extra_body=body)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("alice") == 0 and cached("bob") == 0 and cached(None) == 0
    assert cached("alice") > 0 and cached(None) > 0 and cached("carol") == 0


BAD = [
    ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 9000}, "max_tokens"), ({"max_tokens": NUM_BLOCKS * BLOCK_SIZE + 10}, "max_tokens"),
    ({"seed": 2 ** 70}, "seed"), ({"n": 2}, "n"), ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"),
    ({"priority": 1}, "priority"), ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5}, "min_tokens"), ({"logit_bias": {"7": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"top_logprobs": 2}, "top_logprobs"), ({"best_of": 2}, "best_of"),
    ({"prompt": []}, "prompt"), ({"prompt": [10 ** 7]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": None}, "prompt"), ({"stream_options": {"include_usage": True}}, "stream_options"), ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"ignore_eos": "maybe"}, "ignore_eos"),
    ({"cache_salt": ""}, "cache_salt"), ({"cache_salt": 5}, "cache_salt"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[f"{k}={v!r}"[:40] for (d, _) in BAD for k, v in d.items()])
def test_each_bad_value_is_a_400_naming_its_param(server, fields, param):
    body = {"prompt": "hello", "max_tokens": 4, **fields}
    prompt = body.pop("prompt")
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model="smol", prompt=prompt, extra_body=body)
    assert e.value.status_code == 400 and e.value.param == param, e.value.message
    assert wait_idle(server)["vllm:num_requests_waiting"] == 0


def test_bad_chat_values_and_an_unknown_model(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert e.value.param == "model"
    for messages in ([], [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]):
        with pytest.raises(openai.BadRequestError) as e:
            server.client.chat.completions.create(model="smol", messages=messages, max_tokens=4)
        assert e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}],
                                              max_completion_tokens=9000)
    assert e.value.param == "max_completion_tokens"
    hi = [{"role": "user", "content": "hi"}]
    for kw, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                      ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools")):
        with pytest.raises(openai.BadRequestError) as e:
            server.client.chat.completions.create(model="smol", messages=hi, max_tokens=4, **kw)
        assert e.value.param == param, e.value.message
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_sampling_parameters_are_accepted_and_change_what_they_must(server):
    """The rows that were refused before (penalties, logprobs) are served now, with their effect."""
    ids = server.tok("The capital of France is")["input_ids"]
    plain = server.client.completions.create(model="smol", prompt=ids, max_tokens=8, temperature=0)
    first = reference(server, ids, 1)[0]
    banned = server.client.completions.create(model="smol", prompt=ids, max_tokens=8, temperature=0,
                                              logit_bias={str(first): -100}, presence_penalty=0.5)
    assert plain.choices[0].text != banned.choices[0].text
    assert not server.tok(banned.choices[0].text)["input_ids"][:1] == [first]
    forced = server.client.completions.create(model="smol", prompt=ids, max_tokens=3, temperature=0,
                                              logit_bias={str(server.tok.eos_token_id): 100},
                                              extra_body={"min_tokens": 2, "repetition_penalty": 1.2, "min_p": 0.1})
    assert forced.usage.completion_tokens == 3 and forced.choices[0].finish_reason == "stop"


def test_completion_logprobs_streamed_and_not(server):
    ids = server.tok("The capital of France is")["input_ids"]
    want = reference(server, ids, 6)
    r = server.client.completions.create(model="smol", prompt=ids, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [server.tok.decode([t]) for t in want] and "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(want))]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and top[tok] == value == max(top.values()) and len(top) == 2  # greedy: it is the top one
    stream = list(server.client.completions.create(model="smol", prompt=ids, max_tokens=6, temperature=0,
                                                   logprobs=2, stream=True))
    streamed = [c.choices[0].logprobs for c in stream if c.choices[0].logprobs is not None]
    assert sum((x.tokens for x in streamed), []) == lp.tokens
    assert sum((x.token_logprobs for x in streamed), []) == lp.token_logprobs
    assert sum((x.text_offset for x in streamed), []) == lp.text_offset
    none = server.client.completions.create(model="smol", prompt=ids, max_tokens=2, temperature=0)
    assert none.choices[0].logprobs is None


def test_chat_logprobs_streamed_and_not(server):
    messages = [{"role": "user", "content": "Name a planet."}]
    want = reference(server, chat_ids(server, messages[0]["content"]), 5)
    r = server.client.chat.completions.create(model="smol", messages=messages, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [server.tok.decode([t]) for t in want]
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == c.logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
        assert bytes(c.bytes).decode() == c.token
    chunks = list(server.client.chat.completions.create(model="smol", messages=messages, max_tokens=5,
                                                        temperature=0, logprobs=True, stream=True))
    streamed = sum((c.choices[0].logprobs.content for c in chunks if c.choices[0].logprobs), [])
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    assert all(c.top_logprobs == [] for c in streamed)  # logprobs without top_logprobs: no alternatives
    sampled = server.client.chat.completions.create(model="smol", messages=messages, max_tokens=5, temperature=1.0,
                                                    seed=3, logprobs=True, top_logprobs=1)
    # sampled: the token's logprob is still the raw model's, whatever the draw
    assert all(c.logprob <= c.top_logprobs[0].logprob for c in sampled.choices[0].logprobs.content)


def test_a_stream_closed_after_two_chunks_frees_everything(server):
    stream = server.client.completions.create(model="smol", prompt="Tell me a very long story.", max_tokens=1500,
                                              temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 1:
            break
    assert metrics(server)["vllm:num_requests_running"] == 1
    before = aborted(server)
    stream.close()
    m = wait_idle(server)
    assert aborted(server) == before + 1
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert not server.engine.requests and server.engine.block_pool.num_free == NUM_BLOCKS


def aborted(s) -> float:
    m = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$',
                  httpx.get(f"{s.url}/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_client_gone_before_a_plain_response_aborts_it(server):
    before = aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=httpx.Timeout(60, read=1.0),
                   json={"prompt": "Tell me a very long story.", "max_tokens": 1500, "ignore_eos": True})
    m = wait_idle(server)
    assert m["vllm:num_requests_running"] == 0 and not server.engine.requests
    assert aborted(server) == before + 1


def test_sixteen_concurrent_streams_each_equal_their_single_request_output(server):
    want = [server.tok.decode(reference(server, chat_ids(server, q), 16), skip_special_tokens=True) for q in CHAT]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    first_step = server.engine.stats.steps

    async def one(question):
        stream = await client.chat.completions.create(model="smol", max_tokens=16, temperature=0, stream=True,
                                                      messages=[{"role": "user", "content": question}])
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        try:
            return await asyncio.gather(*(one(q) for q in CHAT))
        finally:
            await client.close()

    got = asyncio.run(main())
    assert got == want
    shared = [rec.num_requests for rec in server.engine.step_log if rec.step >= first_step]
    assert max(shared) >= 8  # they ran in the same steps, not one after another
    m = wait_idle(server)
    assert m["vllm:prefix_cache_queries_total"] > 0 and m["vllm:prefix_cache_hits_total"] > 0
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        count = re.search(rf'^vllm:{name}_count\{{[^}}]*\}} (\S+)$', text, re.M)
        assert count and float(count.group(1)) >= 16


# ----- the command line -----
def test_serve_cli_serves_and_stops_on_sigterm():
    server = ServerProcess("--max-num-seqs", "4", "--served-model-name", "tiny-test", "--no-enable-prefix-caching")
    with server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        assert client.models.list().data[0].id == "tiny-test"
        r = client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=3, temperature=0)
        assert r.usage.completion_tokens <= 3 and r.choices[0].message.content
        assert server.metrics()["vllm:request_success_total"] == 1
        proc = server.proc
        assert server.stop() == 0  # SIGTERM: a graceful shutdown and a clean exit
    assert proc.poll() == 0 and server.proc is None
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")


def test_a_server_started_from_a_short_lived_thread_outlives_it():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        server = pool.submit(ServerProcess("--max-num-seqs", "2").start).result()
    try:  # the thread that asked for it is gone; the server is not
        time.sleep(1.0)
        assert server.proc.poll() is None and httpx.get(f"{server.url}/health").status_code == 200
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("flags, says", [(["--port", "70000"], "--port"), (["--max-num-seqs", "0"], "--max-num-seqs"),
                                         (["--scheduling-policy", "lifo"], "--scheduling-policy"),
                                         (["--dtype", "int8"], "--dtype"),
                                         (["--dtype", "bf16", "--prepack"], "--prepack needs --dtype float32"),
                                         (["--attention-backend", "cuda"], "--attention-backend"),
                                         (["--dtype", "float16", "--attention-backend", "c"],
                                          "--attention-backend c runs float32 and bfloat16, got --dtype float16")])
def test_serve_cli_refuses_bad_flags_in_one_line(flags, says):
    r = subprocess.run([sys.executable, "-m", "nano_engine", "serve", *flags], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and says in r.stderr.strip().splitlines()[-1]


def test_serve_cli_loads_and_steps_the_model_in_the_engine_thread(tiny, monkeypatch):
    # serve hands AsyncLLM a function that makes the engine: the model is loaded in the thread that steps it,
    # and the event loop's thread (here: this one) runs no torch at all.
    import nano_engine.cli.serve as serve_cli
    from nano_engine.mini_llm import Transformer

    loaded_in, served = [], []

    def from_pretrained(path, **kwargs):
        loaded_in.append((threading.current_thread(), kwargs))
        return tiny

    def fake_run(self, *args, **kwargs):  # instead of serving: what the app was given
        served.append(threading.current_thread())

    monkeypatch.setattr(Transformer, "from_pretrained", staticmethod(from_pretrained))
    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    monkeypatch.setattr(serve_cli.signal, "signal", lambda *a: None)  # keep pytest's SIGTERM handler
    assert serve_cli.main(["--port", "0", "--max-num-seqs", "2", "--prepack"]) == 0
    (thread, kwargs), = loaded_in
    assert thread.name == "nano_engine-core" and thread is not threading.current_thread()
    assert kwargs["prepack"] is True and served == [threading.current_thread()]
    assert not thread.is_alive()  # run() shut the engine down on the way out


def test_serve_cli_passes_the_attention_backend_to_the_engine(monkeypatch):
    import nano_engine.cli.serve as serve_cli
    from nano_engine.engine import LLMEngine
    from nano_engine.mini_llm import Transformer
    from nano_engine.tiny import tiny_model

    backends = []
    real_init = LLMEngine.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        backends.append(self.runner.attention_backend)

    monkeypatch.setattr(Transformer, "from_pretrained", staticmethod(lambda path, **kw: tiny_model(dtype=torch.float32)))
    monkeypatch.setattr(LLMEngine, "__init__", init)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **kw: None)
    monkeypatch.setattr(serve_cli.signal, "signal", lambda *a: None)
    for flags, want in (([], "torch"), (["--attention-backend", "c"], "c")):
        assert serve_cli.main(["--port", "0", *flags]) == 0
        assert backends.pop() == want


# ----- protocol.py on its own: what each refused field says, whole -----
_c, _m = {"prompt": "hi"}, {"messages": [{"role": "user", "content": "x"}]}
PROTOCOL_REFUSALS = [  # (request class, body, the param named, the whole message)
    (Comp, {**_c, "best_of": 2}, "best_of", "best_of=2 is not supported by this server (leave it unset)"),
    (Comp, {**_c, "echo": True}, "echo", "echo=True is not supported by this server (leave it unset)"),
    (Comp, {**_c, "suffix": "s"}, "suffix", "suffix='s' is not supported by this server (leave it unset)"),
    (Chat, {**_m, "tools": [{"a": 1}]}, "tools", "tools=[{'a': 1}] is not supported by this server (leave it unset)"),
    (Comp, {**_c, "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options can only be set when stream is true"),
    (Comp, {**_c, "n": 2}, "n", "n=2 is not supported: this server returns one choice per request (n=1)"),
    (Comp, {**_c, "logprobs": 21}, "logprobs", "logprobs=21 must be in [0, 20]"),
    (Comp, {**_c, "logprobs": -1}, "logprobs", "logprobs=-1 must be in [0, 20]"),
    (Chat, {**_m, "top_logprobs": 21, "logprobs": True}, "top_logprobs", "top_logprobs=21 must be in [0, 20]"),
    (Chat, {**_m, "top_logprobs": -1, "logprobs": True}, "top_logprobs", "top_logprobs=-1 must be in [0, 20]"),
    (Chat, {**_m, "top_logprobs": 2}, "top_logprobs", "top_logprobs=2 needs logprobs=true"),
    (Chat, {**_m, "top_logprobs": 1}, "top_logprobs", "top_logprobs=1 needs logprobs=true"),  # the smallest k > 0
    (Comp, {**_c, "top_logprobs": 2}, "top_logprobs",
     "top_logprobs is a chat parameter: completions take logprobs=<int>"),
    (Chat, {**_m, "response_format": {"type": "json_object"}}, "response_format",
     "response_format={'type': 'json_object'} is not supported (only {'type': 'text'})"),
]


@pytest.mark.parametrize("cls, body, param, message", PROTOCOL_REFUSALS)
def test_check_supported_refuses_by_name_whole(cls, body, param, message):
    from nano_engine.serving.protocol import APIError, check_supported

    with pytest.raises(APIError) as e:
        check_supported(cls(**body))
    assert (e.value.message, e.value.param, e.value.status, str(e.value)) == (message, param, 400, message)
    assert e.value.body() == {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


def test_check_supported_takes_the_defaults_and_the_bounds():
    from nano_engine.serving.protocol import ChatCompletionRequest as Chat, CompletionRequest as Comp, check_supported

    c, m = {"prompt": "hi"}, {"messages": [{"role": "user", "content": "x"}]}
    for cls, body in [(Comp, {**c, "best_of": 1}), (Comp, {**c, "suffix": ""}), (Comp, {**c, "echo": False}),
                      (Chat, {**m, "tools": []}), (Comp, {**c, "stream": True, "stream_options": {}}),
                      (Comp, {**c, "logprobs": 0}), (Comp, {**c, "logprobs": 20}),
                      (Chat, {**m, "top_logprobs": 0}), (Chat, {**m, "top_logprobs": 20, "logprobs": True}),
                      (Chat, {**m, "response_format": {"type": "text"}}), (Chat, {**m, "unknown_extra": 1})]:
        check_supported(cls(**body))


def test_api_error_body_param_of_and_validation_error():
    from nano_engine.serving.protocol import APIError, param_of, validation_error

    e = APIError("no such model", "model", 404, "NotFoundError", "model_not_found")
    assert e.body() == {"error": {"message": "no such model", "type": "NotFoundError", "param": "model",
                                  "code": "model_not_found"}}
    assert APIError("x").body() == {"error": {"message": "x", "type": "BadRequestError", "param": None, "code": 400}}
    assert param_of(ValueError("max_tokens=0 must be an integer >= 1")) == "max_tokens"
    assert param_of(ValueError("temperature=-1 must be")) == "temperature"
    assert param_of(ValueError("max_tokens=0"), {"max_tokens": "max_completion_tokens"}) == "max_completion_tokens"
    assert param_of(ValueError("Prompt too long")) is None and param_of(ValueError("")) is None
    e = validation_error([{"loc": ("body", "messages", 0, "role"), "msg": "Field required"},
                          {"loc": ("body", "model"), "msg": "second"}])
    assert (e.message, e.param, e.status) == ("messages.0.role: Field required", "messages", 400)
    e = validation_error([{"loc": ("body",)}])
    assert (e.message, e.param) == ("body: invalid value", None)
    e = validation_error([{"msg": "Input should be a valid dictionary"}])  # an error with no location
    assert (e.message, e.param) == ("body: Input should be a valid dictionary", None)


# ----- serve_cli in-process: its flags, their defaults, what run() hands to the engine and uvicorn -----
def test_serve_flags_default_to_the_engines_defaults():
    from nano_engine.cli.serve import build_parser, engine_config
    from nano_engine.engine import EngineConfig

    args = build_parser().parse_args([])
    assert engine_config(args) == EngineConfig()
    assert (args.host, args.port, args.dtype) == ("127.0.0.1", 8000, "float32")  # loopback unless told


def test_serve_flags_spelled_as_vllm_spells_them_reach_the_engine_config():
    from nano_engine.cli.serve import build_parser, engine_config

    argv = ["--host", "0.0.0.0", "--port", "0", "--model", "m.gguf", "--served-model-name", "x", "--dtype", "bf16",
            "--attention-backend", "c", "--max-num-batched-tokens", "64", "--max-num-seqs", "3",
            "--no-enable-chunked-prefill", "--no-enable-prefix-caching", "--block-size", "8",
            "--num-gpu-blocks-override", "40", "--scheduling-policy", "priority", "--scheduler-reserve-full-isl",
            "--threads", "2", "--uvicorn-log-level", "warning", "--debug", "--prepack"]
    args = build_parser().parse_args(argv)
    assert (args.host, args.port, args.model, args.served_model_name, args.dtype, args.threads,
            args.uvicorn_log_level, args.debug, args.prepack) == ("0.0.0.0", 0, "m.gguf", "x", "bf16", 2, "warning",
                                                                  True, True)
    c = engine_config(args)
    s, k = c.scheduler_config, c.cache_config
    assert (s.max_num_batched_tokens, s.max_num_seqs, s.enable_chunked_prefill, k.enable_prefix_caching,
            k.block_size, k.num_blocks, s.policy, s.scheduler_reserve_full_isl, c.attention_backend) == (
        64, 3, False, False, 8, 40, "priority", True, "c")
    static = engine_config(build_parser().parse_args(["--scheduling-policy", "static"]))
    assert static.scheduler_config.enable_chunked_prefill is False  # static batching never chunks
    assert build_parser().parse_args(["--num-kv-blocks", "9"]).num_blocks == 9  # the older name still works
    assert build_parser().parse_args(["--port", "65535"]).port == 65535


@pytest.mark.parametrize("argv, message", [
    (["--port", "x"], "argument --port"),
    (["--port", "65536"], "argument --port"),
    (["--port", "-1"], "argument --port"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs"),
    (["--block-size", "b"], "argument --block-size"),
    (["--threads", "0"], "argument --threads"),
    (["--num-gpu-blocks-override", "-2"], "argument --num-gpu-blocks-override/--num-kv-blocks"),
    (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens"),
    (["--dtype", "int8"], "argument --dtype"),
    (["--attention-backend", "cuda"], "argument --attention-backend"),
    (["--scheduling-policy", "lifo"], "argument --scheduling-policy"),
    (["--uvicorn-log-level", "loud"], "argument --uvicorn-log-level"),
])
def test_serve_refuses_a_bad_flag_by_name(capsys, argv, message):
    from nano_engine.cli import serve as serve_cli

    assert serve_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: python -m nano_engine serve ")
    assert err[-1].startswith("python -m nano_engine serve: error: ") and message in err[-1]


@pytest.mark.parametrize("argv, name", [
    ([], "SmolLM2-135M-Instruct"), (["--model", "/m/SmolLM2.Q4.gguf"], "SmolLM2.Q4"), (["--model", "/m/qwen3"], "qwen3"),
    (["--model", "/m/qwen3/"], "qwen3"), (["--model", "/"], "/"), (["--model", "/m/x.bin"], "x.bin"),
    (["--model", "/m/a.gguf", "--served-model-name", "mine"], "mine"),
])
def test_the_served_name_comes_from_the_flag_or_the_model_path(argv, name):
    from nano_engine.cli.serve import EMBEDDED_NAME, build_parser, served_name

    assert EMBEDDED_NAME == "SmolLM2-135M-Instruct"
    assert served_name(build_parser().parse_args(argv)) == name


@pytest.fixture
def serve_spies(monkeypatch):
    """serve_cli.main with the model, the tokenizer, uvicorn and the signal handler replaced by spies."""
    import nano_engine.cli.serve as serve_cli
    from nano_engine.models import loading
    from nano_engine.mini_llm import Transformer
    from nano_engine.tiny import tiny_model

    seen = SimpleNamespace(loads=[], configs=[], signals=[], threads=[], checked=[], apps=[], calls=[], tokenizers=[])
    monkeypatch.setattr(Transformer, "from_pretrained",
                        staticmethod(lambda path, **kw: seen.loads.append((path, kw)) or tiny_model(dtype=torch.float32)))
    monkeypatch.setattr(loading, "check_model", lambda path: seen.checked.append(path) or seen.calls.append("check")
                        or "resolved-path")
    tokenizer = loading.load_tokenizer()  # the embedded model's, whatever path serve asks for
    monkeypatch.setattr(loading, "load_tokenizer", lambda path: seen.tokenizers.append(path) or tokenizer)
    real_config = uvicorn.Config

    def config(app, **kwargs):
        seen.configs.append(kwargs)
        return real_config(app, **kwargs)
    monkeypatch.setattr(uvicorn, "Config", config)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: seen.apps.append(self.config.app))
    monkeypatch.setattr(serve_cli.signal, "signal", lambda *a: seen.signals.append(a))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.threads.append(n))
    return seen


def test_serve_run_hands_its_flags_to_the_model_uvicorn_and_sigterm(serve_spies):
    from nano_engine.cli import serve as serve_cli

    seen = serve_spies
    assert serve_cli.main(["--port", "0", "--host", "127.0.0.2", "--uvicorn-log-level", "error", "--threads", "3",
                           "--model", "/x/m.gguf", "--prepack"]) == 0
    assert seen.checked == ["/x/m.gguf"]
    assert seen.loads == [("resolved-path", {"dtype": "float32", "prepack": True})]  # the checked path is loaded
    assert seen.tokenizers == ["resolved-path"]
    assert seen.configs == [{"host": "127.0.0.2", "port": 0, "log_level": "error", "timeout_graceful_shutdown": 5}]
    assert seen.signals == [(signal.SIGTERM, serve_cli._exit_cleanly)] and seen.threads == [3]
    [app] = seen.apps  # the app uvicorn serves is build_app's, under the served name ("m" of m.gguf)
    assert app.state.serving.model_name == app.state.metrics.model_name == "m"
    assert not app.state.serving.llm._thread.is_alive()  # its AsyncLLM, shut down when uvicorn returned
    with pytest.raises(SystemExit) as e:
        serve_cli._exit_cleanly(15, None)
    assert e.value.code == 0
    assert serve_cli.main(["--port", "0", "--dtype", "bf16"]) == 0  # no --threads: torch's own choice
    assert seen.threads == [3] and seen.loads[-1] == ("resolved-path", {"dtype": "bf16", "prepack": False})


def test_serve_run_shuts_the_engine_down_when_uvicorn_fails(serve_spies, monkeypatch, capsys):
    from nano_engine.cli import serve as serve_cli
    from nano_engine.serving.async_llm import AsyncLLM

    from nano_engine.serving import async_llm

    built = []

    class Recorded(AsyncLLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(async_llm, "AsyncLLM", Recorded)

    def broken(self):
        raise OSError("[Errno 98] address already in use")
    monkeypatch.setattr(uvicorn.Server, "run", broken)
    assert serve_cli.main(["--port", "0"]) == 1
    assert capsys.readouterr().err.strip() == ("python -m nano_engine serve: error: OSError: [Errno 98] address "
                                               "already in use (--debug shows the traceback)")
    assert built and not built[0]._thread.is_alive()  # the engine thread was stopped on the way out


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "bf16", "--prepack"], "--prepack needs --dtype float32, got --dtype bf16"),
    (["--dtype", "float64", "--prepack"], "--prepack needs --dtype float32, got --dtype float64"),
    (["--dtype", "float16", "--attention-backend", "c"], "--attention-backend c runs float32 and bfloat16, got --dtype float16"),
    (["--dtype", "float64", "--attention-backend", "c"], "--attention-backend c runs float32 and bfloat16, got --dtype float64"),
])
def test_serve_refuses_flag_combinations_before_the_model_loads(serve_spies, capsys, argv, message):
    from nano_engine.cli import serve as serve_cli

    assert serve_cli.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"python -m nano_engine serve: error: {message}"
    assert serve_spies.checked == [] and serve_spies.loads == []


def test_serve_builds_the_c_kernel_before_the_model_and_maps_config_errors(serve_spies, monkeypatch, capsys):
    from nano_engine.kernels import paged_decode as kernels
    from nano_engine.cli import serve as serve_cli

    real_build = kernels.build
    monkeypatch.setattr(kernels, "build", lambda: serve_spies.calls.append("build") or real_build())
    assert serve_cli.main(["--port", "0", "--attention-backend", "c", "--dtype", "fp32"]) == 0
    assert serve_spies.calls[:2] == ["build", "check"]  # then the runner asks again (built: at once)
    assert serve_cli.main(["--port", "0", "--attention-backend", "c", "--dtype", "bf16"]) == 0

    def bad_config(args):
        raise ValueError("x=1 is bad")
    monkeypatch.setattr(serve_cli, "engine_config", bad_config)
    assert serve_cli.main(["--port", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "python -m nano_engine serve: error: x=1 is bad"


# ----- the app on a scripted engine: what goes to the engine, what comes back, byte for byte -----


class CharTokenizer:
    """Token ids are code points; the chat template writes 'role: content' lines, then 'assistant: '."""
    eos_token_id = 0

    def __init__(self, batch_encoding: bool = False):
        self.batch_encoding, self.templated = batch_encoding, []

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt is True and tokenize is True
        self.templated.append(messages)
        if any(m["content"] == "break the template" for m in messages):
            raise ValueError("roles must alternate")
        ids = [ord(c) for c in "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "]
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if self.batch_encoding else ids


class ScriptedStream:
    def __init__(self, request_id, outputs):
        self.request_id, self.outputs, self.entered, self.exited = request_id, outputs, 0, 0

    async def __aenter__(self):
        self.entered += 1
        return self

    async def __aexit__(self, *exc):
        self.exited += 1

    def __aiter__(self):
        return self._each()

    async def _each(self):
        for out in self.outputs:
            yield out


class ScriptedLLM:
    """What build_app uses of an AsyncLLM: its engine's config, the tokenizer, add_request."""

    def __init__(self, tokenizer=None, num_blocks=4, block_size=16, chunked=True, max_num_batched_tokens=32,
                 max_position_embeddings=256, policy="fcfs", outputs=None, error=None):
        config = SimpleNamespace(
            scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked, policy=policy,
                                             max_num_batched_tokens=max_num_batched_tokens),
            cache_config=SimpleNamespace(num_blocks=num_blocks, block_size=block_size))
        model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=max_position_embeddings))
        self.engine = SimpleNamespace(config=config, model=model, stats=SimpleNamespace(preemptions=2),
                                      scheduler=SimpleNamespace(running=["a"], waiting=["b", "c"]),
                                      block_pool=SimpleNamespace(num_free=1, num_blocks=num_blocks))
        self.tokenizer = CharTokenizer() if tokenizer is None else tokenizer
        self.tokenizer_lock = threading.Lock()
        if outputs is None:  # one finished output: what the engine sends for a request it ran
            outputs = [output("ok", 1, True, "length")]
        self.dead, self.listeners, self.outputs, self.error = None, [], list(outputs), error
        self.added, self.streams = [], []

    def subscribe(self, on_output):
        self.listeners.append(on_output)

    async def add_request(self, prompt_ids, params, request_id, priority=0, cache_salt=None):
        self.added.append(SimpleNamespace(ids=prompt_ids, params=params, rid=request_id, priority=priority,
                                          cache_salt=cache_salt))
        if self.error is not None:
            raise self.error
        self.streams.append(ScriptedStream(request_id, self.outputs))
        return self.streams[-1]


def output(text, n, finished=False, reason=None, stop=None, cached=0, logprobs=None):
    return RequestOutput("r", [ord(c) for c in text], text, [0.0] * len(text), 3, cached, n, 0.0, finished,
                         reason, stop, logprobs)


def app_client(**kw):
    llm = ScriptedLLM(**kw)
    return llm, TestClient(build_app(llm, "m"), raise_server_exceptions=False)


def events(response) -> list:
    """The server-sent events of a streamed response, [DONE] as the string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") for b in blocks[:-1]), response.text
    return [b[6:] if b == "data: [DONE]" else json.loads(b[6:]) for b in blocks[:-1]]


def error_of(response, status):
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_build_app_needs_the_engines_tokenizer():
    llm = ScriptedLLM()
    llm.tokenizer = None
    with pytest.raises(ValueError) as e:
        build_app(llm, "m")
    assert str(e.value) == "the server needs the engine's tokenizer (LLMEngine(model, tokenizer, ...))"


def test_the_app_serves_no_docs_pages_under_its_title():
    _, client = app_client()
    assert client.get("/openapi.json").json()["info"]["title"] == "nano_engine"
    assert client.get("/docs").status_code == 404 and client.get("/redoc").status_code == 404


def test_health_models_and_metrics_on_their_own():
    llm, client = app_client()
    t0 = int(time.time())
    r = client.get("/health")
    assert (r.status_code, r.content) == (200, b"")
    llm.dead = RuntimeError("the engine thread died")
    r = client.get("/health")
    assert (r.status_code, r.json()) == (503, {"status": "dead"})
    models = client.get("/v1/models").json()
    created = models["data"][0]["created"]
    assert models == {"object": "list", "data": [{"id": "m", "object": "model", "created": created,
                                                  "owned_by": "nano_engine", "root": "m", "max_model_len": 256}]}
    assert isinstance(created, int) and t0 - 60 <= created <= t0  # when the app was built
    r = client.get("/metrics")
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    for line in ('vllm:num_requests_running{engine="0",model_name="m"} 1.0',
                 'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
                 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75'):
        assert line in r.text.splitlines(), line


def test_serving_takes_its_limits_from_the_engine_config():
    t0 = time.time()
    serving = OpenAIServing(ScriptedLLM(num_blocks=4, block_size=16, max_position_embeddings=200), "m")
    assert (serving.capacity, serving.max_model_len, type(serving.created)) == (64, 200, int)
    assert int(t0) <= serving.created <= time.time() and serving.model_name == "m"
    llm = ScriptedLLM(num_blocks=4, block_size=16, chunked=False, max_num_batched_tokens=32)
    assert OpenAIServing(llm, "m").capacity == 32 and OpenAIServing(llm, "m").tokenizer is llm.tokenizer
    # without chunked prefill a prompt must fit one step's budget, unless the KV cache is smaller
    assert OpenAIServing(ScriptedLLM(num_blocks=4, block_size=16, chunked=False, max_num_batched_tokens=100),
                         "m").capacity == 64


def test_a_default_max_tokens_is_what_the_context_and_the_kv_cache_leave():
    llm, client = app_client(num_blocks=4, block_size=16, max_position_embeddings=256)
    for prompt, room in (("abc", 62), ("x" * 60, 5), ("x" * 64, 1)):  # capacity 64: 64 - len + 1
        assert client.post("/v1/completions", json={"prompt": prompt}).status_code == 200
        assert llm.added[-1].params.max_tokens == room
    llm, client = app_client(num_blocks=64, block_size=16, max_position_embeddings=100)
    client.post("/v1/completions", json={"prompt": "abc"})
    assert llm.added[-1].params.max_tokens == 97  # the context: 100 - 3
    llm, client = app_client(num_blocks=4, block_size=16)
    err = error_of(client.post("/v1/completions", json={"prompt": "x" * 65}), 400)
    assert err == {"message": "the prompt has 65 tokens, which leaves no room for output: this model's maximum "
                              "context length is 256 tokens and the KV cache holds 64 per request",
                   "type": "BadRequestError", "param": "prompt", "code": 400}
    chat = {"messages": [{"role": "user", "content": "x" * 60}]}  # 6 + 60 + 1 + 11 tokens with the template
    err = error_of(client.post("/v1/chat/completions", json=chat), 400)
    assert err["param"] == "messages" and err["message"].startswith("the prompt has 78 tokens,")
    assert llm.added == []  # nothing refused reached the engine


def test_a_max_tokens_past_the_context_is_refused_by_name():
    llm, client = app_client(num_blocks=64, max_position_embeddings=256)
    assert client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 253}).status_code == 200
    err = error_of(client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 254}), 400)
    assert err == {"message": "This model's maximum context length is 256 tokens. However, you requested 257 "
                              "tokens (3 in the prompt, 254 in the completion). Please reduce the length of the "
                              "prompt or max_tokens.", "type": "BadRequestError", "param": "max_tokens", "code": 400}
    chat = {"messages": [{"role": "user", "content": "hi"}]}  # 'user: hi\nassistant: ' is 20 tokens
    err = error_of(client.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 237}), 400)
    assert err["param"] == "max_completion_tokens" and err["message"] == (
        "This model's maximum context length is 256 tokens. However, you requested 257 tokens (20 in the "
        "messages, 237 in the completion). Please reduce the length of the messages or max_completion_tokens.")
    # max_completion_tokens wins over max_tokens, and its errors name it
    client.post("/v1/chat/completions", json={**chat, "max_tokens": 5, "max_completion_tokens": 7})
    assert llm.added[-1].params.max_tokens == 7
    err = error_of(client.post("/v1/chat/completions", json={**chat, "max_tokens": 5, "max_completion_tokens": 0}),
                   400)
    assert err["param"] == "max_completion_tokens", err
    err = error_of(client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 0}), 400)
    assert err["param"] == "max_tokens", err
    assert len(llm.added) == 2  # nothing refused reached the engine


def test_each_request_field_reaches_the_engine_as_sampling_params():
    llm, client = app_client(num_blocks=64)
    client.post("/v1/completions", json={"prompt": "abc"})
    assert llm.added[-1].params == SamplingParams(max_tokens=253, temperature=1.0)  # OpenAI's defaults otherwise
    body = {"prompt": "abc", "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 11,
            "stop_token_ids": [5, 6], "ignore_eos": True, "min_p": 0.05, "repetition_penalty": 1.1,
            "presence_penalty": 0.2, "frequency_penalty": 0.3, "logit_bias": {"65": 2.5}, "min_tokens": 2,
            "logprobs": 3, "stop": ["zz", "yy"], "include_stop_str_in_output": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert llm.added[-1].params == SamplingParams(
        max_tokens=9, temperature=0.5, top_p=0.9, top_k=7, seed=11, stop_token_ids=(5, 6), ignore_eos=True,
        min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3, logit_bias={65: 2.5},
        min_tokens=2, logprobs=3, stop=("zz", "yy"), include_stop_str_in_output=True)
    for top_k, want in ((-1, 0), (0, 0), (1, 1)):  # vLLM's -1: no limit
        client.post("/v1/completions", json={"prompt": "abc", "top_k": top_k, "stop": "one"})
        assert (llm.added[-1].params.top_k, llm.added[-1].params.stop) == (want, ("one",))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for extra, want in (({}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 4}, 4),
                        ({"logprobs": False, "top_logprobs": 0}, None)):
        client.post("/v1/chat/completions", json={**chat, **extra})
        assert llm.added[-1].params.logprobs == want, extra
    err = error_of(client.post("/v1/completions", json={"prompt": "abc", "logit_bias": {"x": 1}}), 400)
    assert (err["message"], err["param"]) == ("logit_bias key 'x' must be a token id (an integer)", "logit_bias")
    err = error_of(client.post("/v1/completions", json={"prompt": "abc", "stop": ["ok", ""]}), 400)
    assert err["param"] == "stop", err


def test_the_request_id_priority_and_cache_salt_reach_the_engine():
    llm, client = app_client(policy="priority")
    client.post("/v1/completions", json={"prompt": "abc", "priority": -3, "cache_salt": "s1"})
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    (a, b) = llm.added
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", a.rid) and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", b.rid)
    assert (a.priority, a.cache_salt, b.priority, b.cache_salt) == (-3, "s1", 0, None)
    llm, client = app_client(policy="fcfs")
    err = error_of(client.post("/v1/completions", json={"prompt": "abc", "priority": 1}), 400)
    assert (err["message"], err["param"]) == (
        "priority=1 needs --scheduling-policy priority (this server runs fcfs)", "priority")
    assert llm.added == []


def test_each_prompt_form_becomes_token_ids():
    llm, client = app_client()
    for prompt in ("abc", [97, 98, 99], ["abc"], [[97, 98, 99]]):
        assert client.post("/v1/completions", json={"prompt": prompt}).status_code == 200
        assert llm.added[-1].ids == [97, 98, 99], prompt
    err = error_of(client.post("/v1/completions", json={"prompt": [[1], [2], [3]]}), 400)
    assert (err["message"], err["param"]) == ("prompt is a batch of 3 prompts: send one prompt per request", "prompt")
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    for batch_encoding in (False, True):  # a tokenizer may return a BatchEncoding (input_ids, attention_mask)
        llm, client = app_client(tokenizer=CharTokenizer(batch_encoding))
        assert client.post("/v1/chat/completions", json={"messages": chat}).status_code == 200
        assert llm.tokenizer.templated == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": ""},
                                            {"role": "user", "content": "one\ntwo"}]]
        text = "system: be brief\nuser: \nuser: one\ntwo\nassistant: "
        assert llm.added[-1].ids == [ord(c) for c in text] and type(llm.added[-1].ids[0]) is int
    err = error_of(client.post("/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "break the template"}]}), 400)
    assert err == {"message": "messages do not fit the model's chat template: roles must alternate",
                   "type": "BadRequestError", "param": "messages", "code": 400}


def test_message_content_is_a_string_or_text_parts():
    assert (_text(None, 0), _text("", 0), _text("hi", 0), _text([], 0)) == ("", "", "hi", "")
    assert _text([{"type": "text", "text": "a"}, {"type": "text", "text": "b c"}], 0) == "a\nb c"
    for part, got in (({"type": "image_url", "image_url": {}}, "'image_url'"), ({"text": "no type"}, "None"),
                      ({"type": "text", "text": 5}, "'text'"), ({"type": "text"}, "'text'")):
        with pytest.raises(APIError) as e:
            _text([{"type": "text", "text": "fine"}, part], 3)
        assert (e.value.message, e.value.param) == (
            f"messages[3].content: only text parts are supported, got {got}", "messages")


def test_the_engines_refusals_and_its_death_have_their_status():
    _, client = app_client(error=EngineDeadError("the engine thread is gone"))
    err = error_of(client.post("/v1/completions", json={"prompt": "abc"}), 503)
    assert err == {"message": "the engine thread is gone", "type": "ServiceUnavailableError", "param": None,
                   "code": 503}
    for error, body, param in (
            (ValueError("prompt_ids has 9 tokens"), {"prompt": "abc"}, "prompt"),
            (ValueError("prompt_ids has 9 tokens"), {"messages": [{"role": "user", "content": "x"}]}, "messages"),
            (ValueError("request needs 99 slots"), {"prompt": "abc"}, "prompt"),
            (ValueError("request needs 99 slots"), {"prompt": "abc", "max_tokens": 5}, "max_tokens"),
            (ValueError("request needs 99 slots"), {"messages": [{"role": "user", "content": "x"}],
                                                    "max_completion_tokens": 5}, "max_completion_tokens"),
            (TypeError("seed must be an int"), {"prompt": "abc"}, "seed")):
        _, client = app_client(error=error)
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        err = error_of(client.post(path, json=body), 400)
        assert err == {"message": str(error), "type": "BadRequestError", "param": param, "code": 400}, (error, body)


def test_an_unexpected_error_is_a_500_in_openais_shape():
    class Broken(CharTokenizer):
        def __call__(self, text):
            raise RuntimeError("the tokenizer broke")

    _, client = app_client(tokenizer=Broken())
    err = error_of(client.post("/v1/completions", json={"prompt": "abc"}), 500)
    assert err == {"message": "internal error: RuntimeError: the tokenizer broke", "type": "InternalServerError",
                   "param": None, "code": 500}
    _, client = app_client()
    err = error_of(client.post("/v1/completions", content=b"[1, 2", headers={"content-type": "application/json"}),
                   400)
    assert err["type"] == "BadRequestError" and err["code"] == 400


def head_of(body, kind, obj):
    assert re.fullmatch(rf"{kind}-[0-9a-f]{{32}}", body["id"]) and abs(body["created"] - time.time()) < 60
    assert type(body["created"]) is int and body["model"] == "m" and body["object"] == obj
    return {"id": body["id"], "created": body["created"], "model": "m", "object": obj}


def test_a_plain_completion_and_chat_response_whole():
    outs = [output("Hel", 1), output("", 1), output("lo", 2, True, "stop", "!", cached=16)]
    llm, client = app_client(outputs=outs)
    body = client.post("/v1/completions", json={"prompt": "abc"}).json()
    assert body == {**head_of(body, "cmpl", "text_completion"),
                    "choices": [{"index": 0, "logprobs": None, "finish_reason": "stop", "stop_reason": "!",
                                 "text": "Hello"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 16}}}
    assert body["id"] == llm.added[-1].rid and (llm.streams[-1].entered, llm.streams[-1].exited) == (1, 1)
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert body == {**head_of(body, "chatcmpl", "chat.completion"),
                    "choices": [{"index": 0, "logprobs": None, "finish_reason": "stop", "stop_reason": "!",
                                 "message": {"role": "assistant", "content": "Hello"}}],
                    "usage": {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22,
                              "prompt_tokens_details": {"cached_tokens": 16}}}
    _, client = app_client(outputs=[output("x", 1, True, "length")])
    choice = client.post("/v1/completions", json={"prompt": "abc"}).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)


def test_a_request_the_engine_failed_is_a_500():
    _, client = app_client(outputs=[output("a", 1), output("", 1, True, "error")])
    err = error_of(client.post("/v1/completions", json={"prompt": "abc"}), 500)
    assert err == {"message": "the engine failed while running this request (see the server's log)",
                   "type": "InternalServerError", "param": None, "code": 500}
    got = events(client.post("/v1/completions", json={"prompt": "abc", "stream": True}))
    assert got[1:] == [{"error": err}, "[DONE]"] and got[0]["choices"][0]["text"] == "a"


def test_a_completion_stream_whole():
    outs = [output("He", 1), output("", 1), output("llo", 2), output("", 3, True, "stop", 7)]
    llm, client = app_client(outputs=outs)
    got = events(client.post("/v1/completions", json={"prompt": "abc", "stream": True}))
    head = head_of(got[0], "cmpl", "text_completion")
    assert got == [{**head, "choices": [{"index": 0, "logprobs": None, "finish_reason": None, "stop_reason": None,
                                         "text": t}]} for t in ("He", "llo")] + [
        {**head, "choices": [{"index": 0, "logprobs": None, "finish_reason": "stop", "stop_reason": 7, "text": ""}]},
        "[DONE]"]  # the empty output in between (text held back) sends nothing
    assert head["id"] == llm.added[-1].rid and llm.streams[-1].exited == 1
    got = events(client.post("/v1/completions", json={"prompt": "abc", "stream": True,
                                                      "stream_options": {"include_usage": True}}))
    assert got[-2:] == [{**head_of(got[-2], "cmpl", "text_completion"), "choices": [],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                                   "prompt_tokens_details": {"cached_tokens": 0}}}, "[DONE]"]
    assert all("usage" not in e for e in got[:-2])
    got = events(client.post("/v1/completions", json={"prompt": "abc", "stream": True,
                                                      "stream_options": {"include_usage": False}}))
    assert len(got) == 4 and all("usage" not in e for e in got[:-1])


def test_a_stream_with_no_output_still_ends_with_usage_and_done():
    _, client = app_client(outputs=[])
    got = events(client.post("/v1/completions", json={"prompt": "abc", "stream": True,
                                                      "stream_options": {"include_usage": True}}))
    assert got[-1] == "[DONE]" and got[0]["choices"] == [] and got[0]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}
    assert len(got) == 2


def test_a_chat_stream_whole():
    outs = [output("", 0), output("Hi", 1), output("", 1), output(" there", 2), output("", 3, True, "stop")]
    _, client = app_client(outputs=outs)
    got = events(client.post("/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}], "stream": True}))
    head = head_of(got[0], "chatcmpl", "chat.completion.chunk")

    def chunk(delta, reason=None):
        return {**head, "choices": [{"index": 0, "logprobs": None, "finish_reason": reason, "stop_reason": None,
                                     "delta": delta}]}

    # the first chunk names the role even with no text yet; a last chunk with no text has an empty delta
    assert got == [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hi"}),
                   chunk({"content": " there"}), chunk({}, "stop"), "[DONE]"]
    _, client = app_client(outputs=[output("A", 1), output("B", 2, True, "length")])
    got = events(client.post("/v1/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}], "stream": True}))
    assert [c["choices"][0]["delta"] for c in got[:-1]] == [{"role": "assistant", "content": "A"}, {"content": "B"}]
    assert got[1]["choices"][0]["finish_reason"] == "length"


def lp(token, logprob, *tops):
    return SampleLogprobs(ord(token), logprob, 1, [ord(t) for t, _ in tops], [v for _, v in tops])


def test_logprobs_in_openais_two_shapes():
    outs = [output("ab", 2, logprobs=[lp("a", -0.5, ("a", -0.5), ("z", -2.0)),
                                      lp("b", -1.5, ("c", -1.0), ("b", -1.5))]),
            output("é", 3, True, "length", logprobs=[lp("é", -0.25, ("é", -0.25), ("e", -3.0))])]
    _, client = app_client(outputs=outs)
    got = client.post("/v1/completions", json={"prompt": "abc", "logprobs": 2}).json()["choices"][0]["logprobs"]
    assert got == {"tokens": ["a", "b", "é"], "token_logprobs": [-0.5, -1.5, -0.25],
                   "top_logprobs": [{"a": -0.5, "z": -2.0}, {"c": -1.0, "b": -1.5}, {"é": -0.25, "e": -3.0}],
                   "text_offset": [0, 1, 2]}
    got = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "logprobs": True, "top_logprobs": 2}).json()
    first, _, last = got["choices"][0]["logprobs"]["content"]
    assert first == {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "z", "logprob": -2.0, "bytes": [122]}]}
    assert last["bytes"] == [195, 169] and last["top_logprobs"][1] == {"token": "e", "logprob": -3.0, "bytes": [101]}
    # a sampled token outside the top k is added to completions' top_logprobs, as vLLM does
    _, client = app_client(outputs=[output("q", 1, True, "length", logprobs=[lp("q", -4.0, ("a", -0.1))])])
    got = client.post("/v1/completions", json={"prompt": "abc", "logprobs": 1}).json()["choices"][0]["logprobs"]
    assert got["top_logprobs"] == [{"a": -0.1, "q": -4.0}]


def test_streamed_logprobs_go_with_the_chunk_that_carries_their_text():
    outs = [output("a", 1, logprobs=[lp("a", -0.5)]), output("", 2, logprobs=[lp("\x01", -1.0)]),
            output("bc", 3, logprobs=[lp("c", -2.0)]), output("", 3, True, "stop")]
    _, client = app_client(outputs=outs)
    got = events(client.post("/v1/completions", json={"prompt": "abc", "logprobs": 0, "stream": True}))
    assert [c["choices"][0]["logprobs"] for c in got[:-1]] == [
        {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}], "text_offset": [0]},
        {"tokens": ["\x01", "c"], "token_logprobs": [-1.0, -2.0], "top_logprobs": [{"\x01": -1.0}, {"c": -2.0}],
         "text_offset": [1, 2]},  # the held-back token's logprob comes with the next chunk that is sent
        {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}]
    got = events(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "logprobs": True, "stream": True}))
    assert [[x["token"] for x in c["choices"][0]["logprobs"]["content"]] for c in got[:-1]] == [
        ["a"], ["\x01", "c"], []]
    _, client = app_client(outputs=[output("a", 1), output("bc", 3, True, "stop")])  # none asked for, none sent
    got = events(client.post("/v1/completions", json={"prompt": "abc", "stream": True}))
    assert [c["choices"][0]["logprobs"] for c in got[:-1]] == [None, None]


def test_an_unknown_model_is_a_404_in_openais_shape():
    llm, client = app_client()
    err = error_of(client.post("/v1/completions", json={"prompt": "abc", "model": "gpt-4"}), 404)
    assert err == {"message": "The model `gpt-4` does not exist; this server serves `m`", "type": "NotFoundError",
                   "param": "model", "code": "model_not_found"}
    assert client.post("/v1/completions", json={"prompt": "abc", "model": "m"}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "abc"}).status_code == 200  # no model: the one served
    assert len(llm.added) == 2


def test_a_bad_stop_and_a_non_text_part_are_refused_with_their_reason():
    llm, client = app_client()
    for stop, message in (([""], "stop=[''] must not contain an empty string"),
                          (["a", ""], "stop=['a', ''] must not contain an empty string")):
        err = error_of(client.post("/v1/completions", json={"prompt": "abc", "stop": stop}), 400)
        assert err == {"message": message, "type": "BadRequestError", "param": "stop", "code": 400}
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "image_url"}]}]
    err = error_of(client.post("/v1/chat/completions", json={"messages": messages}), 400)
    assert err["message"] == "messages[1].content: only text parts are supported, got 'image_url'"  # its index
    assert llm.added == []


def test_one_output_token_past_the_context_is_refused_too():
    llm, client = app_client(num_blocks=64, max_position_embeddings=256)
    assert client.post("/v1/completions", json={"prompt": "a" * 255, "max_tokens": 1}).status_code == 200
    err = error_of(client.post("/v1/completions", json={"prompt": "a" * 256, "max_tokens": 1}), 400)
    assert err["param"] == "max_tokens" and err["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested 257 tokens (256 in the prompt, "
        "1 in the completion).")
    assert len(llm.added) == 1


def test_streamed_events_carry_utf8_text_unescaped():
    """vLLM's chunks are UTF-8 JSON: "é", not "\\u00e9" (both decode alike; the bytes differ)."""
    _, client = app_client(outputs=[output("é", 1), output("€", 2, True, "length")])
    r = client.post("/v1/completions", json={"prompt": "abc", "stream": True})
    assert '"text": "é"' in r.text and '"text": "€"' in r.text and "\\u" not in r.text


def test_the_disconnect_watch_skips_other_messages_and_ends_on_the_disconnect():
    messages = [{"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"}]
    seen = []

    class Raw:
        async def receive(self):
            seen.append(messages[len(seen)])
            return seen[-1]

    asyncio.run(asyncio.wait_for(_disconnected(Raw()), 5))
    assert seen == messages

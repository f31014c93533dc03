"""The OpenAI-compatible server, through the real `openai` client, on the embedded model.

A server runs in this process (uvicorn in a thread, 127.0.0.1, a free port) so that the tests can
look inside its engine; test_serve_cli_serves_and_stops_on_sigterm starts `python -m nano_engine
serve` as a child process. Both are stopped by the fixture that started them, whatever happens in
the test. The serve command's other tests run it in-process with the model and uvicorn replaced by
spies, and the app's own tests (what reaches the engine, what goes back on the wire, each refusal)
run it on a scripted engine."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn
from fastapi.testclient import TestClient

import nano_engine.cli.serve as serve_cli
from in_process import serving
from nano_engine import EngineConfig, LLMEngine, SamplingParams, generate
from nano_engine.serving.async_llm import AsyncLLM, EngineDeadError, RequestOutput
from nano_engine.serving.launcher import ServerProcess
from nano_engine.models.loading import chat_prompt_ids
from nano_engine.sampling import SampleLogprobs
from nano_engine.serving.server import build_app

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


def test_completion_equals_single_request_generate(server):
    assert [m.id for m in server.client.models.list().data] == ["smol"]
    root = httpx.get(f"{server.url}/v1/models").json()["data"][0]["root"]  # vLLM's: where the model was loaded from
    assert root == server.engine.model.name_or_path and root.endswith(".gguf")
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


# One row per way a bad value reaches the client: a body pydantic refuses, a SamplingParams refusal (every
# one begins with its field: test_api_properties.py), and the real engine's, renamed to the request's field.
# Each refusal the server makes itself is in REFUSED below, on a scripted engine.
BAD = [
    ({"temperature": "hot"}, "temperature"), ({"temperature": -1}, "temperature"),
    ({"max_tokens": NUM_BLOCKS * BLOCK_SIZE + 10}, "max_tokens"),  # the KV cache's, not the context's, limit
    ({"prompt": [10 ** 7]}, "prompt"), ({"logit_bias": {"10000000": 1}}, "logit_bias"),  # outside the vocabulary
]


@pytest.mark.parametrize("fields, param", BAD, ids=[f"{k}={v!r}"[:40] for (d, _) in BAD for k, v in d.items()])
def test_each_bad_value_is_a_400_naming_its_param(server, fields, param):
    body = {"prompt": "hello", "max_tokens": 4, **fields}
    prompt = body.pop("prompt")
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model="smol", prompt=prompt, extra_body=body)
    assert e.value.status_code == 400 and e.value.param == param and param in e.value.message, e.value.message
    assert wait_idle(server)["vllm:num_requests_waiting"] == 0


def test_an_unknown_model_a_bad_chat_and_a_broken_body_are_refused_by_name(server):
    """The openai client sees each refusal's status and param (the scripted-engine tests below have the rest)."""
    with pytest.raises(openai.NotFoundError) as e:
        server.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert e.value.param == "model" and "gpt-4" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}],
                                              max_completion_tokens=9000)
    assert e.value.param == "max_completion_tokens" and "max_completion_tokens" in e.value.message
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


def test_n_choices_are_seeded_children_that_compute_the_prompt_once(server):
    """n=3: choice i is the request alone with seed + i (vLLM's children); the prompt is counted once in
    usage and computed once: the two later choices take its full blocks from the prefix cache."""
    prompt = "In a quiet village by the sea, an old fisherman kept a secret that nobody knew. " * 2
    ids = server.tok(prompt)["input_ids"]
    before = metrics(server)
    r = server.client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=1.0, seed=40, n=3)
    after = metrics(server)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [server.client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=1.0,
                                              seed=40 + i).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == alone and len(set(alone)) > 1
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 24
    full = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= 2 * full > 0
    # streamed: each chunk names its choice; put together by index they are the plain response
    texts = {}
    for chunk in server.client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=1.0,
                                                  seed=40, n=3, stream=True):
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert texts == {i: t for i, t in enumerate(alone)}
    chat = server.client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Name a fruit."}],
                                                 max_tokens=6, temperature=0, n=2)
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same twice
    assert wait_idle(server)["vllm:kv_cache_usage_perc"] == 0


def test_a_list_of_prompts_gets_one_choice_each_in_order(server):
    """lm-eval sends batches as a list of token-id prompts: choice i answers prompt i."""
    prompts = [server.tok(t)["input_ids"] for t in ("The capital of France is", "One, two, three,", "Hello")]
    r = server.client.completions.create(model="smol", prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice, ids in zip(r.choices, prompts):
        assert choice.text == server.tok.decode(reference(server, ids, 5), skip_special_tokens=True)
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    r = server.client.completions.create(model="smol", prompt=["Hi", "Bye"], max_tokens=2, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.choices[0].text == r.choices[1].text


def test_echo_returns_the_prompt_with_its_logprobs(server):
    """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=1, token ids. The prompt's logprobs
    (the first null) are the model's log-softmax over one forward pass of the whole prompt."""
    ids = server.tok("The quick brown fox jumps over the lazy dog")["input_ids"]
    r = server.client.completions.create(model="smol", prompt=[ids], max_tokens=1, temperature=0, logprobs=1,
                                         echo=True, seed=1234)
    lp, model = r.choices[0].logprobs, server.engine.model
    with torch.inference_mode():
        logprobs = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)))).float().log_softmax(-1)
    want = [None] + [logprobs[p, ids[p + 1]].item() for p in range(len(ids) - 1)]
    assert lp.token_logprobs[:-1] == pytest.approx(want, abs=1e-5) and lp.token_logprobs[0] is None
    assert lp.tokens[:-1] == [server.tok.decode([t]) for t in ids] and lp.top_logprobs[0] is None
    next_token = logprobs[-1].argmax().item()
    assert lp.tokens[-1] == server.tok.decode([next_token])
    assert lp.token_logprobs[-1] == pytest.approx(logprobs[-1, next_token].item(), abs=1e-5)
    assert r.choices[0].text == server.tok.decode(ids) + server.tok.decode([next_token])
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):  # top-1 plus the token itself
        assert value in top.values() and 1 <= len(top) <= 2 and max(top.values()) >= value
    only = server.client.completions.create(model="smol", prompt="Echo me", max_tokens=0, echo=True, temperature=0)
    assert only.choices[0].text == "Echo me" and only.usage.completion_tokens == 0
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(
        model="smol", prompt="Echo me", max_tokens=3, echo=True, temperature=0, stream=True))
    plain = server.client.completions.create(model="smol", prompt="Echo me", max_tokens=3, echo=True, temperature=0)
    assert streamed == plain.choices[0].text and streamed.startswith("Echo me") and len(streamed) > len("Echo me")
    # vLLM's prompt_logprobs: the same numbers, keyed by token id, with ranks
    pl = httpx.post(f"{server.url}/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0},
                    timeout=60).json()["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and [e[str(t)]["logprob"] for e, t in zip(pl[1:], ids[1:])] == pytest.approx(want[1:], abs=1e-5)


def test_vllms_token_fields_do_what_they_say(server):
    ids = server.tok("The capital of France is")["input_ids"]
    greedy = reference(server, ids, 6)
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0}

    def complete(**extra):
        r = httpx.post(f"{server.url}/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    r = complete(return_token_ids=True)  # the ids beside the text
    assert r["choices"][0]["token_ids"] == greedy and r["choices"][0]["prompt_token_ids"] == ids
    word = server.tok.decode(greedy[:1]).strip()  # ban the first word of the greedy answer
    banned = complete(bad_words=[word])["choices"][0]["text"]
    assert word not in banned.split() and banned != server.tok.decode(greedy)
    allowed = [server.tok(" Paris")["input_ids"][0], server.tok(".")["input_ids"][0]]
    out = complete(allowed_token_ids=allowed, return_token_ids=True)["choices"][0]["token_ids"]
    assert set(out) <= set(allowed) and len(out) == 6
    eos = server.tok.eos_token_id  # special tokens in the text only when asked for
    two = {"allowed_token_ids": [eos], "ignore_eos": True, "max_tokens": 2}
    assert complete(**two)["choices"][0]["text"] == ""
    assert complete(**two, skip_special_tokens=False)["choices"][0]["text"] == server.tok.decode([eos, eos])
    r = complete(truncate_prompt_tokens=3)  # the last 3 prompt tokens only
    assert r["usage"]["prompt_tokens"] == 3
    assert r["choices"][0]["text"] == server.tok.decode(reference(server, ids[-3:], 6), skip_special_tokens=True)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Once upon a time", "temperature": 0,
                                                          "ignore_eos": True}, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 16  # a completion's default max_tokens
    r = complete(logprobs=0, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert r["tokens"] == [f"token_id:{t}" for t in greedy]


def test_a_chat_template_from_the_request_and_chat_echo(server):
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    r = server.client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Roses are red,"}],
                                              max_tokens=4, temperature=0, extra_body={"chat_template": template})
    ids = server.tok("Roses are red,\n")["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == server.tok.decode(reference(server, ids, 4), skip_special_tokens=True)
    messages = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    r = server.client.chat.completions.create(
        model="smol", messages=messages, max_tokens=3, temperature=0,
        extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True})
    assert r.choices[0].message.content.startswith("The color is") and r.choices[0].message.role == "assistant"


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]},
                                                   "maxItems": 3}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def is_person(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "pets"} and isinstance(obj["name"], str)
            and type(obj["age"]) is int and len(obj["pets"]) <= 3 and all(p in ("cat", "dog", "fish") for p in obj["pets"]))


def test_structured_output_follows_the_schema_and_leaves_the_batch_alone(server):
    """response_format json_schema: greedy output is JSON of that schema; the same request alone and among
    plain and other structured requests gives the same tokens, and the plain ones equal generate."""
    ask = [{"role": "user", "content": "Describe a person who has pets, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def structured():
        return server.client.chat.completions.create(model="smol", messages=ask, max_tokens=80, temperature=0,
                                                     response_format=fmt)

    alone = structured()
    assert alone.choices[0].finish_reason == "stop" and is_person(json.loads(alone.choices[0].message.content))
    free = server.client.chat.completions.create(model="smol", messages=ask, max_tokens=80, temperature=0)
    assert not is_person(_json_or_none(free.choices[0].message.content))  # the schema made the difference

    async def crowd():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
        plain = [client.completions.create(model="smol", prompt=q, max_tokens=10, temperature=0) for q in CHAT[:4]]
        shaped = [client.chat.completions.create(model="smol", messages=ask, max_tokens=80, temperature=0,
                                                 response_format=fmt) for _ in range(2)]
        choice = client.completions.create(model="smol", prompt="Pick a color:", max_tokens=5, temperature=0,
                                           extra_body={"guided_choice": ["red", "green", "blue"]})
        return await asyncio.gather(*plain, *shaped, choice)

    *plain, one, two, color = asyncio.run(crowd())
    assert one.choices[0].message.content == two.choices[0].message.content == alone.choices[0].message.content
    for r, q in zip(plain, CHAT[:4]):
        assert r.choices[0].text == server.tok.decode(reference(server, server.tok(q)["input_ids"], 10),
                                                      skip_special_tokens=True)
    assert color.choices[0].text in ("red", "green", "blue")
    obj = server.client.completions.create(model="smol", prompt="A JSON object describing a cat:", max_tokens=60,
                                           temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].finish_reason != "stop" or isinstance(json.loads(obj.choices[0].text), dict)
    code = server.client.completions.create(model="smol", prompt="My phone number is", max_tokens=12, temperature=0,
                                            extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", code.choices[0].text)
    with pytest.raises(openai.BadRequestError) as e:  # a schema xgrammar cannot compile
        server.client.chat.completions.create(model="smol", messages=ask, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})
    assert e.value.param == "response_format" and "objekt" in e.value.message
    assert e.value.body["message"].startswith("response_format")  # the request's field, not the engine's
    assert wait_idle(server)["vllm:kv_cache_usage_perc"] == 0


def test_a_grammar_that_leaves_no_token_fails_its_request_alone(server):
    """A regex that nothing can follow after its "a", or a grammar whose only way out min_tokens masks:
    a 400 naming the field (greedy used to emit token 0, sampling to fail every request of the step);
    requests running beside it get generate's tokens."""
    async def crowd():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
        plain = [client.completions.create(model="smol", prompt=q, max_tokens=12, temperature=0) for q in CHAT[:3]]
        dead = [client.completions.create(model="smol", prompt="Say a letter:", max_tokens=8, temperature=t,
                                          extra_body={"structured_outputs": {"regex": r}, "min_tokens": m})
                for t, r, m in [(0, r"a[^\s\S]", 0), (1.0, "a", 4), (0, "a", 4)]]
        return await asyncio.gather(*plain, *dead, return_exceptions=True)

    *plain, no_next, sampled, greedy = asyncio.run(crowd())
    for r, q in zip(plain, CHAT[:3]):
        assert r.choices[0].text == server.tok.decode(reference(server, server.tok(q)["input_ids"], 12),
                                                      skip_special_tokens=True)
    for e, named in [(no_next, "structured_outputs left"), (sampled, "structured_outputs with min_tokens"),
                     (greedy, "structured_outputs with min_tokens")]:
        assert isinstance(e, openai.BadRequestError) and e.param == "structured_outputs", e
        assert e.body["message"].startswith(named) and "after 1 output token" in e.body["message"], e.message
    assert wait_idle(server)["vllm:kv_cache_usage_perc"] == 0


def _json_or_none(text):
    try:
        return json.loads(text)
    except ValueError:
        return None


def test_a_named_or_required_tool_is_called_with_arguments_of_its_schema(server):
    """tool_choice naming a function: its arguments follow its parameters' schema (streamed as pieces of
    the arguments); "required": a list of calls, each of a given tool."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = server.client.chat.completions.create(model="smol", messages=ask, max_tokens=40, temperature=0,
                                              tools=[TOOL], tool_choice=named)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    pieces = [c.choices[0].delta.tool_calls for c in server.client.chat.completions.create(
        model="smol", messages=ask, max_tokens=40, temperature=0, tools=[TOOL], tool_choice=named, stream=True)]
    assert pieces[0] is None  # the role's chunk, then the call's: its name and id with the first piece
    assert pieces[1][0].function.name == "get_weather" and pieces[1][0].id
    assert "".join(p[0].function.arguments for p in pieces if p) == call.function.arguments
    add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    r = server.client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Add 2 and 3."}],
                                              max_tokens=200, temperature=0, tools=[TOOL, add], tool_choice="required")
    calls = r.choices[0].message.tool_calls
    if r.choices[0].finish_reason == "tool_calls":
        assert calls and all(c.function.name in ("get_weather", "add") for c in calls)
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
    else:  # cut by max_tokens: the text, no half call
        assert r.choices[0].finish_reason == "length" and not calls and r.choices[0].message.content.startswith("[")


def test_metrics_break_each_request_down_as_vllms_dashboards_read_them(server):
    prompt = server.tok("Count from one to ten:")["input_ids"]
    r = server.client.completions.create(model="smol", prompt=prompt, max_tokens=6, temperature=0, n=2,
                                         extra_body={"ignore_eos": True})
    m = wait_idle(server)
    assert m["vllm:request_prompt_tokens_count"] == 2 and m["vllm:request_prompt_tokens_sum"] == 2 * len(prompt)
    assert m["vllm:request_generation_tokens_sum"] == r.usage.completion_tokens == 12
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time", "time_per_output_token"):
        assert m[f"vllm:request_{name}_seconds_count"] == 2, name
    assert m["vllm:request_inference_time_seconds_sum"] >= m["vllm:request_decode_time_seconds_sum"] > 0
    # every computed token was in some step: the prompt, the second choice's uncached tail, 5 + 5 decodes
    assert m["vllm:iteration_tokens_total_sum"] >= len(prompt) + 10 and m["vllm:iteration_tokens_total_count"] >= 6


def test_a_speculative_server_streams_the_same_tokens_and_counts_its_drafts():
    """serve with n-gram speculation: through the openai client, streamed or not, the tokens are those
    without drafts, and /metrics carries vLLM's spec_decode counters."""
    engine = LLMEngine.from_pretrained(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    llm = AsyncLLM(engine)
    text = ("The old lighthouse keeper climbed the stairs every night. He lit the lamp, wound the clock, "
            "and wrote one line in his log.")
    ask = [{"role": "user", "content": f"Repeat this text exactly: {text}"}]
    try:
        with serving(build_app(llm, "smol")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
            r = client.chat.completions.create(model="smol", messages=ask, max_tokens=40, temperature=0)
            want = generate(engine.model, chat_prompt_ids(engine.tokenizer, ask[0]["content"]), 40,
                            eos_token_id=engine.model.config.eos_token_id)
            assert r.choices[0].message.content == engine.tokenizer.decode(want, skip_special_tokens=True)
            streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="smol", messages=ask, max_tokens=40, temperature=0, stream=True))
            assert streamed == r.choices[0].message.content
            m = {k: v for k, v in (line.rsplit(" ", 1) for line in httpx.get(f"{url}/metrics").text.splitlines()
                                   if line.startswith("vllm:spec_decode"))}
            drafts = sum(float(v) for k, v in m.items() if k.startswith("vllm:spec_decode_num_draft_tokens_total"))
            kept = sum(float(v) for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
            per_pos = [float(v) for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos")]
            assert drafts >= kept > 0 and sum(per_pos) == kept
    finally:
        llm.shutdown()


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


def test_a_stream_of_n_choices_closed_early_aborts_every_choice(server):
    before = aborted(server)
    stream = server.client.completions.create(model="smol", prompt="Tell me a very long story.", max_tokens=1500,
                                              temperature=1.0, seed=5, n=3, stream=True,
                                              extra_body={"ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen.add(chunk.choices[0].index)
        if len(seen) == 3:  # every choice has started
            break
    stream.close()
    m = wait_idle(server)
    assert aborted(server) == before + 3
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


@pytest.fixture
def serve_spies(monkeypatch):
    """serve_cli.main with the model (the tiny one), the tokenizer, the C kernel's build, uvicorn and
    signal.signal replaced by spies; `calls` lists the build, the model check and the loads in order."""
    from nano_engine.kernels import paged_attention as kernels
    from nano_engine.models import loading
    from nano_engine.mini_llm import Transformer
    from nano_engine.tiny import tiny_model

    seen = SimpleNamespace(calls=[], configs=[], signals=[], threads=[], apps=[])
    tokenizer, real_config, real_build = loading.load_tokenizer(), uvicorn.Config, kernels.build

    def load(path, **kwargs):
        seen.calls.append(("load", path, kwargs, threading.current_thread()))
        return tiny_model(dtype=torch.float32)
    monkeypatch.setattr(Transformer, "from_pretrained", staticmethod(load))
    monkeypatch.setattr(loading, "check_model", lambda path: seen.calls.append(("check", path)) or "resolved-path")
    monkeypatch.setattr(loading, "load_tokenizer", lambda path: seen.calls.append(("tokenizer", path)) or tokenizer)
    monkeypatch.setattr(kernels, "build", lambda: seen.calls.append(("build",)) or real_build())
    monkeypatch.setattr(uvicorn, "Config", lambda app, **kw: seen.configs.append(kw) or real_config(app, **kw))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.apps.append(
        (self.config.app, threading.current_thread(), sockets)))
    monkeypatch.setattr(serve_cli.signal, "signal", lambda *a: seen.signals.append(a))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.threads.append(n))
    return seen


def test_serve_hands_its_flags_to_the_model_the_engine_uvicorn_and_sigterm(serve_spies):
    seen = serve_spies
    assert serve_cli.main(["--port", "0", "--host", "127.0.0.2", "--uvicorn-log-level", "error", "--threads", "3",
                           "--model", "/x/m.gguf", "--prepack"]) == 0
    # the checked path is the one loaded, the model with its flags; the engine then builds the
    # attention kernel (auto)
    assert [c[:2] for c in seen.calls] == [("check", "/x/m.gguf"), ("load", "resolved-path"),
                                           ("tokenizer", "resolved-path"), ("build",)]
    (_, _, kwargs, loaded_in) = seen.calls[1]
    assert (kwargs["dtype"], kwargs["prepack"]) == ("float32", True) and seen.threads == [3]
    [config] = seen.configs
    assert (config["host"], config["port"], config["log_level"]) == ("127.0.0.2", 0, "error")
    # The model is loaded in the engine thread, which alone runs torch; uvicorn's event loop runs in this one.
    # run() shuts the engine down when uvicorn returns.
    [(app, served_in, [sock])] = seen.apps  # uvicorn serves on the socket bound before the model loaded
    assert served_in is threading.current_thread() and loaded_in is not served_in and not loaded_in.is_alive()
    assert sock.fileno() == -1  # closed once uvicorn returned
    assert TestClient(app).get("/v1/models").json()["data"][0]["id"] == "m"  # the served name: m of m.gguf
    assert app.state.serving.llm.engine.runner.attention_backend == "c"  # auto: the kernel, where it builds
    [(signum, handler)] = seen.signals  # SIGTERM ends the process with status 0
    with pytest.raises(SystemExit) as e:
        handler(signum, None)
    assert signum == signal.SIGTERM and e.value.code == 0
    assert serve_cli.main(["--port", "0", "--dtype", "bf16"]) == 0  # no --threads: torch's own choice
    last_load = [c for c in seen.calls if c[0] == "load"][-1]
    assert seen.threads == [3] and last_load[2] == {"dtype": "bf16", "prepack": False}


def test_serve_takes_max_model_len_and_refuses_one_above_the_models_by_name(serve_spies, capsys):
    assert serve_cli.main(["--port", "0", "--max-model-len", "100"]) == 0
    [(app, _, _)] = serve_spies.apps
    assert TestClient(app).get("/v1/models").json()["data"][0]["max_model_len"] == 100
    positions = app.state.serving.llm.engine.model.config.max_position_embeddings
    assert serve_cli.main(["--port", "0", "--max-model-len", str(positions + 1)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--max-model-len {positions + 1}" in last and "max_position_embeddings" in last, last


def test_serve_builds_the_c_kernel_before_the_model_and_the_engine_runs_it(serve_spies):
    assert serve_cli.main(["--port", "0", "--attention-backend", "c", "--dtype", "fp32"]) == 0
    assert [c[0] for c in serve_spies.calls[:2]] == ["build", "check"]  # no compiler: it fails before the load
    [(app, _, _)] = serve_spies.apps
    assert app.state.serving.llm.engine.runner.attention_backend == "c"


def test_a_port_in_use_or_a_host_not_here_is_refused_before_the_model_loads(serve_spies, capsys):
    """serve binds its socket first (vLLM's setup_server): uvicorn found out only after the model loaded."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, named in [(["--port", str(port)], f"--port {port}"), (["--host", "999.1.1.1"], "999.1.1.1")]:
            assert serve_cli.main(argv) == 2
            last = capsys.readouterr().err.strip().splitlines()[-1]
            assert named in last and "cannot listen" in last, last
    assert serve_spies.calls == [] and serve_spies.apps == []


def test_serve_exits_1_naming_the_error_and_stops_the_engine_when_uvicorn_fails(serve_spies, monkeypatch, capsys):
    def broken(self, sockets=None):
        raise OSError("[Errno 98] address already in use")
    monkeypatch.setattr(uvicorn.Server, "run", broken)
    assert serve_cli.main(["--port", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "OSError" in err[0] and "address already in use" in err[0]
    [engine_thread] = [c[3] for c in serve_spies.calls if c[0] == "load"]
    assert not engine_thread.is_alive()


BAD_FLAGS = [  # (argv, what the error line names)
    (["--port", "x"], ["--port", "'x'"]), (["--port", "65536"], ["--port", "65536"]),
    (["--max-num-seqs", "0"], ["--max-num-seqs"]), (["--dtype", "int8"], ["--dtype", "int8"]),
    (["--dtype", "float16", "--prepack"], ["--prepack", "float16"]),  # no packed kernel for float16 anywhere
    (["--dtype", "float16", "--attention-backend", "c"], ["--attention-backend c", "float16"]),
    (["--scheduling-policy", "static", "--enable-chunked-prefill"], ["enable_chunked_prefill", "static"]),
    (["--quantization", "int8", "--dtype", "float16"], ["--quantization", "float16"]),
    (["-q", "int4", "--tensor-parallel-size", "2"], ["--quantization"]), (["-q", "int2"], ["--quantization", "int2"]),
]


@pytest.mark.parametrize("argv, named", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_serve_refuses_a_bad_flag_by_name_before_the_model_loads(serve_spies, capsys, argv, named):
    assert serve_cli.main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error" in last and all(word in last for word in named), last
    assert serve_spies.calls == []


def test_serve_flags_spelled_as_vllm_spells_them_reach_the_engine_config():
    defaults = serve_cli.build_parser().parse_args([])
    # serve's defaults are the engine's, but for the attention: auto (the kernel where it builds).
    assert serve_cli.engine_config(defaults) == EngineConfig(attention_backend="auto")
    assert defaults.host == "127.0.0.1"  # loopback unless told
    argv = ["--max-num-batched-tokens", "64", "--max-num-seqs", "3", "--no-enable-chunked-prefill",
            "--no-enable-prefix-caching", "--block-size", "8", "--num-gpu-blocks-override", "40",
            "--scheduling-policy", "priority", "--scheduler-reserve-full-isl", "--attention-backend", "c"]
    c = serve_cli.engine_config(serve_cli.build_parser().parse_args(argv))
    s, k = c.scheduler_config, c.cache_config
    assert (s.max_num_batched_tokens, s.max_num_seqs, s.enable_chunked_prefill, k.enable_prefix_caching,
            k.block_size, k.num_blocks, s.policy, s.scheduler_reserve_full_isl, c.attention_backend) == (
        64, 3, False, False, 8, 40, "priority", True, "c")
    static = serve_cli.engine_config(serve_cli.build_parser().parse_args(["--scheduling-policy", "static"]))
    assert static.scheduler_config.enable_chunked_prefill is False  # static batching never chunks
    assert serve_cli.build_parser().parse_args(["--num-kv-blocks", "9"]).num_blocks == 9  # the older name works too
    assert serve_cli.build_parser().parse_args(["--port", "65535"]).port == 65535


@pytest.mark.parametrize("argv, name", [
    ([], "SmolLM2-135M-Instruct"), (["--model", "/m/SmolLM2.Q4.gguf"], "SmolLM2.Q4"), (["--model", "/m/qwen3"], "qwen3"),
    (["--model", "/m/qwen3/"], "qwen3"), (["--model", "/m/x.bin"], "x.bin"),
    (["--model", "/m/a.gguf", "--served-model-name", "mine"], "mine"),
])
def test_the_served_name_comes_from_the_flag_or_the_model_path(argv, name, monkeypatch):
    monkeypatch.delenv("NANO_ENGINE_MODEL", raising=False)
    assert serve_cli.served_name(serve_cli.build_parser().parse_args(argv)) == name


def test_serve_takes_the_model_as_vllm_serve_does_too(capsys):
    parse = serve_cli.build_parser().parse_args
    assert parse(["/m/qwen3", "--port", "0"]).model == parse(["--model", "/m/qwen3"]).model == "/m/qwen3"
    assert parse(["/m/q", "--model", "/m/q"]).model == "/m/q"
    with pytest.raises(SystemExit):
        parse(["/m/a", "--model", "/m/b"])
    assert "given twice" in capsys.readouterr().err


def test_the_served_name_of_a_model_named_by_the_environment_or_by_dot_is_its_folders(monkeypatch, tmp_path):
    parse = serve_cli.build_parser().parse_args
    monkeypatch.setenv("NANO_ENGINE_MODEL", "/m/llama-3")  # it was the embedded model's name
    assert serve_cli.served_name(parse([])) == "llama-3" and serve_cli.served_name(parse(["--model", "/m/q"])) == "q"
    monkeypatch.chdir(tmp_path)
    assert serve_cli.served_name(parse(["--model", "."])) == tmp_path.name  # it was "."


# ----- the app on a scripted engine: what goes to the engine, what comes back on the wire -----
class CharTokenizer:
    """Token ids are code points; the chat template writes 'role: content' lines, then 'assistant: ' when a reply is to follow."""
    eos_token_id = 0

    def __init__(self, batch_encoding: bool = False):
        self.batch_encoding, self.templated = batch_encoding, []

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools=None):
        assert tokenize is True
        self.templated.append(messages)
        if any(m["content"] == "break the template" for m in messages):
            raise ValueError("roles must alternate")
        ids = [ord(c) for c in "".join(f"{m['role']}: {m['content']}\n" for m in messages)
               + ("assistant: " if add_generation_prompt else "")]
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if self.batch_encoding else ids


class ScriptedStream:
    """A request's outputs, as AsyncLLM's stream gives them; `exited` counts the `async with` that closed it."""

    def __init__(self, request_id, outputs):
        self.request_id, self.outputs, self.exited = request_id, outputs, 0

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.exited += 1

    def abort(self):
        pass

    async def __aiter__(self):
        for out in self.outputs:
            yield out


class ScriptedLLM:
    """What build_app uses of an AsyncLLM: its engine's config and state, the tokenizer, add_request."""

    def __init__(self, tokenizer=None, num_blocks=4, block_size=16, chunked=True, max_num_batched_tokens=32,
                 max_position_embeddings=256, policy="fcfs", outputs=None, error=None):
        ns = SimpleNamespace
        config = ns(scheduler_config=ns(enable_chunked_prefill=chunked, policy=policy,
                                        max_num_batched_tokens=max_num_batched_tokens),
                    cache_config=ns(num_blocks=num_blocks, block_size=block_size), speculative_config=None)
        self.engine = ns(config=config, model=ns(config=ns(max_position_embeddings=max_position_embeddings)),
                         stats=ns(preemptions=2), scheduler=ns(running=["a"], waiting=["b", "c"]),
                         block_pool=ns(num_free=1, num_blocks=num_blocks))
        self.tokenizer = CharTokenizer() if tokenizer is None else tokenizer
        self.tokenizer_lock = threading.Lock()
        # by default one finished output: what the engine sends for a request it ran
        self.outputs = list(outputs) if outputs is not None else [output("ok", 1, True, "length")]
        self.dead, self.listeners, self.error, self.added, self.streams = None, [], error, [], []

    def subscribe(self, on_output):
        self.listeners.append(on_output)

    def subscribe_steps(self, on_step):
        pass

    async def add_request(self, prompt_ids, params, request_id, priority=0, cache_salt=None, after=None):
        self.added.append(SimpleNamespace(ids=prompt_ids, params=params, rid=request_id, priority=priority,
                                          cache_salt=cache_salt, after=after))
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


def post(client, body, path=None):
    """POST a completion (a body with "prompt") or a chat completion (with "messages"), as JSON with
    every non-ASCII character escaped: a lone surrogate ("\\ud800") goes out as a client may send it."""
    path = path or ("/v1/chat/completions" if "messages" in body else "/v1/completions")
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def events(response) -> list:
    """The server-sent events of a streamed response, [DONE] as the string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") for b in blocks[:-1]), response.text
    return [b[6:] if b == "data: [DONE]" else json.loads(b[6:]) for b in blocks[:-1]]


def error_of(response, status):
    assert response.status_code == status, response.text
    return response.json()["error"]


HI = [{"role": "user", "content": "hi"}]


def test_build_app_needs_the_engines_tokenizer():
    llm = ScriptedLLM()
    llm.tokenizer = None
    with pytest.raises(ValueError, match="tokenizer"):
        build_app(llm, "m")


def test_health_says_503_once_the_engine_died_and_models_give_the_context_length():
    llm, client = app_client(num_blocks=32)  # 512 tokens of KV cache, a model of 256 positions
    assert client.get("/health").status_code == 200
    llm.dead = RuntimeError("the engine thread died")
    assert client.get("/health").status_code == 503
    [model] = client.get("/v1/models").json()["data"]
    assert (model["id"], model["object"], model["max_model_len"]) == ("m", "model", 256)  # vLLM's max_model_len


def test_max_model_len_is_what_one_request_can_hold_or_less_if_asked():
    """By default the model's context, or the KV cache's tokens for one request if that is less (it was the
    model's 8192 while a 4,096-token cache refused anything longer); vLLM's --max-model-len lowers it, and
    every request is held to it; above either limit it is refused by name when the app is built."""
    # 64 KV slots: 65 tokens (the last one's KV is never written); without chunked prefill, one step of 32
    for kw, want in ((dict(num_blocks=4), 65), (dict(num_blocks=4, chunked=False, max_num_batched_tokens=32), 33)):
        llm, client = app_client(**kw)
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == want
        assert post(client, {"prompt": "abc"}, "/tokenize").json()["max_model_len"] == want
    llm = ScriptedLLM(num_blocks=32)
    client = TestClient(build_app(llm, "m", max_model_len=100), raise_server_exceptions=False)
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 100
    err = error_of(post(client, {"prompt": "x" * 90, "max_tokens": 11}), 400)
    assert err["param"] == "max_tokens" and "100" in err["message"] and llm.added == []
    assert post(client, {"prompt": "x" * 90, "max_tokens": 10}).status_code == 200
    for bad, named in ((257, "max_position_embeddings=256"), (0, ">= 1")):
        with pytest.raises(ValueError, match=re.escape(named)):
            build_app(ScriptedLLM(num_blocks=32), "m", max_model_len=bad)
    with pytest.raises(ValueError, match="66 is above the 65 tokens .* KV cache .*--num-gpu-blocks-override"):
        build_app(ScriptedLLM(num_blocks=4), "m", max_model_len=66)
    # the step's budget, without chunked prefill, is what to raise there (not the cache: 64 x 16 slots)
    with pytest.raises(ValueError, match="100 is above the 33 tokens .*max_num_batched_tokens=32.*--enable-chunked"):
        build_app(ScriptedLLM(num_blocks=64, chunked=False, max_num_batched_tokens=32), "m", max_model_len=100)
    assert 'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0' in client.get("/metrics").text.splitlines()


def test_errors_are_in_openais_shape():
    """{"error": {"message", "type", "param", "code"}}: an unknown model is a 404 with OpenAI's code, a bad value
    a 400; a request without a model gets the one served."""
    llm, client = app_client()
    for body, status, want in (({"prompt": "abc", "n": 0}, 400, ("BadRequestError", "n", 400)),
                               ({"prompt": "abc", "model": "gpt-4"}, 404,
                                ("NotFoundError", "model", "model_not_found"))):
        r = post(client, body)
        assert (r.status_code, list(r.json()), set(r.json()["error"])) == (status, ["error"], {
            "message", "type", "param", "code"})
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == want and str(body.get("model", "n=0")) in err["message"]
    assert post(client, {"prompt": "abc", "model": "m"}).status_code == 200
    assert post(client, {"prompt": "abc"}).status_code == 200
    assert len(llm.added) == 2


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
REFUSED = [  # (body, the param named, what the message names)
    ({"prompt": "abc", "use_beam_search": True}, "use_beam_search", "use_beam_search"),
    ({"prompt": "abc", "suffix": "s"}, "suffix", "suffix"), ({"prompt": "abc", "n": 129}, "n", "128"),
    ({"prompt": "abc", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ({"prompt": "abc", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "0"),
    ({"prompt": "abc", "allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ({"prompt": "abc", "bad_words": [" "]}, "bad_words", "blank"),
    ({"messages": HI, "structural_tag": "{}"}, "structural_tag", "structural_tag"),
    ({"prompt": "abc", "best_of": 2}, "best_of", "best_of"), ({"prompt": "abc", "stop": ["a", ""]}, "stop", "stop"),
    ({"prompt": "abc", "stream_options": {"include_usage": True}}, "stream_options", "stream"),  # without stream
    ({"prompt": "abc", "top_logprobs": 2}, "top_logprobs", "logprobs"),  # completions take logprobs=<int>
    ({"prompt": "abc", "logprobs": 21}, "logprobs", "21"), ({"prompt": "abc", "priority": 1}, "priority", "fcfs"),
    ({"prompt": ["a"] * 9, "n": 128}, "prompt", "9 prompts"), ({"prompt": "abc", "logit_bias": {"x": 1}}, "logit_bias", "'x'"),
    ({"prompt": "x" * 65}, "prompt", "65"),  # no room left for a single output token (the KV cache holds 64)
    ({"messages": HI, "response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "schema"),
    ({"prompt": "abc", "guided_choice": [], "max_tokens": 2}, "guided_choice", "choice"),
    ({"prompt": "abc", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "guided_regex"),
    ({"prompt": "abc", "structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
    ({"prompt": "abc", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"messages": HI, "tools": [TOOL]}, "tool_choice", "auto"),
    ({"messages": HI, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"messages": HI, "tools": [{"type": "function"}], "tool_choice": "required"}, "tools", "tools[0]"),
    ({"messages": HI, "tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "guided_regex"),
    ({"messages": HI, "top_logprobs": 1}, "top_logprobs", "logprobs=true"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "21"),
    ({"messages": HI, "tools": [{"a": 1}], "tool_choice": "required"}, "tools", "tools"),
    ({"messages": []}, "messages", "messages"),
    ({"messages": [{"content": "no role"}]}, "messages", "role"),
    ({"messages": HI + [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "messages[1]"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages", "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages", "messages[0]"),
    ({"messages": [{"role": "user", "content": "x" * 60}]}, "messages", "78"),  # 78 tokens with the template
    ({"messages": [{"role": "user", "content": "break the template"}]}, "messages", "roles must alternate"),
    # a lone UTF-16 surrogate is no text: no tokenizer reads it, no response could echo it (the model's name is
    # echoed in a 404, a tool's name in its call)
    ({"prompt": "a\ud800b"}, "prompt", "surrogate"), ({"prompt": "abc", "model": "m\udfff"}, "model", "surrogate"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}, "messages",
     "messages[0].content[0].text"),
    ({"messages": HI, "chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs", "surrogate"),
    ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format", "schema"),
    ({"messages": HI, "tools": [TOOL], "tool_choice": {"type": "function", "function": "get_weather"}},
     "tool_choice", "name"),
    ({"messages": HI, "tool_choice": "required"}, "tool_choice", "tools"),  # vLLM's: tool_choice needs tools
    ({"messages": HI, "tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "tools"),
    ({"prompt": "abc", "stop": ""}, "stop", "empty"),  # as ["a", ""]: not "no stop"
    # apply_chat_template's own arguments would rewrite the prompt (truncation cuts the messages away)
    ({"messages": HI, "chat_template_kwargs": {"truncation": True, "max_length": 2}}, "chat_template_kwargs",
     "max_length"),
    ({"messages": HI, "chat_template_kwargs": {"padding": "max_length"}}, "chat_template_kwargs", "padding"),
]


@pytest.mark.parametrize("body, param, named", REFUSED, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(REFUSED)])
def test_a_refused_request_is_a_400_naming_its_field_and_never_reaches_the_engine(body, param, named):
    llm, client = app_client()
    err = error_of(post(client, body), 400)
    assert (err["type"], err["param"]) == ("BadRequestError", param) and named in err["message"], err
    assert llm.added == []


def test_every_error_is_in_openais_shape_and_no_body_is_a_500():
    """An unknown path, a wrong method and a body that is not JSON answer {"error": {...}} too (a client reads
    error.message), and a broken body names no field (a character offset is no param); /tokenize and
    /detokenize refuse a lone surrogate by name instead of failing inside the tokenizer."""
    llm, client = app_client()
    for r, status in ((client.get("/v1/nope"), 404), (client.get("/v1/completions"), 405),
                      (client.post("/v1/completions", content=b"hello", headers={"content-type": "application/json"}),
                       400)):
        assert (r.status_code, list(r.json()), r.json()["error"]["code"]) == (status, ["error"], status), r.text
    assert error_of(client.post("/v1/completions", content=b'{"prompt": "a"', headers={
        "content-type": "application/json"}), 400)["param"] is None
    for path, body, param in (("/tokenize", {"prompt": "\ud83d"}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
                              ("/detokenize", {"tokens": [1], "model": "m\ud800"}, "model")):
        err = error_of(post(client, body, path), 400)
        assert err["param"] == param and "surrogate" in err["message"]
    assert llm.added == []


class VocabTokenizer(CharTokenizer):
    """CharTokenizer that lists a vocabulary (its longest entry 4 characters) and counts its calls; with
    `gate`, each call waits for it first (a tokenizer busy with a long text)."""

    def __init__(self, gate=None):
        super().__init__()
        self.gate, self.calls = gate, 0

    def get_vocab(self):
        return {"a": 0, "abcd": 1}

    def __call__(self, text, add_special_tokens=True):
        self.calls += 1
        if self.gate is not None:
            assert self.gate.wait(30)
        return super().__call__(text, add_special_tokens)


def test_a_text_longer_than_the_context_could_hold_is_refused_before_it_is_tokenized():
    """256 tokens of at most 4 characters each hold 1,024 characters: a longer text cannot fit, and the
    tokenizer never sees it (a 5 MB prompt took seconds there); cut to its last tokens, it is tokenized."""
    tok = VocabTokenizer()
    llm, client = app_client(tokenizer=tok, num_blocks=32)  # a context of 256 tokens
    for body, param in (({"prompt": "x" * 1025}, "prompt"), ({"prompt": ["ab", "x" * 1023]}, "prompt"),
                        ({"messages": [{"role": "user", "content": "x" * 1025}]}, "messages")):
        err = error_of(post(client, body), 400)
        assert err["param"] == param and "1025" in err["message"] and "256" in err["message"]
    assert error_of(post(client, {"prompt": "x" * 1025}, "/tokenize"), 400)["param"] == "prompt"
    assert tok.calls == 0 and llm.added == []
    assert post(client, {"prompt": "x" * 1025, "truncate_prompt_tokens": 8, "max_tokens": 1}).status_code == 200
    assert post(client, {"prompt": "x" * 40, "max_tokens": 1}).status_code == 200 and tok.calls == 2


def test_a_prompt_being_tokenized_holds_up_no_other_request():
    """Tokenizing runs in a worker thread: while one prompt is in the tokenizer, /health and /v1/models
    answer (on the event loop, they waited for it)."""
    gate = threading.Event()
    llm = ScriptedLLM(tokenizer=VocabTokenizer(gate))
    with serving(build_app(llm, "m")) as url:
        pending = threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                                   kwargs={"json": {"prompt": "abc", "max_tokens": 1}, "timeout": 60})
        pending.start()
        try:
            deadline = time.monotonic() + 30
            while llm.tokenizer.calls == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            for path in ("/health", "/v1/models"):
                assert httpx.get(f"{url}{path}", timeout=5).status_code == 200
        finally:
            gate.set()
            pending.join(60)
    assert len(llm.added) == 1


def test_fields_at_their_defaults_or_bounds_are_accepted():
    """OpenAI's defaults for what this server does not do (clients send them), the bounds of what it does and
    unknown extra fields are not refused."""
    _, client = app_client()
    for extra in ({"best_of": 1}, {"suffix": ""}, {"echo": False}, {"stream": True, "stream_options": {}},
                  {"logprobs": 0}, {"logprobs": 20}, {"unknown_extra": 1}):
        assert post(client, {"prompt": "abc", **extra}).status_code == 200, extra
    for extra in ({"tools": []}, {"top_logprobs": 0}, {"top_logprobs": 20, "logprobs": True},
                  {"response_format": {"type": "text"}}):
        assert post(client, {"messages": HI, **extra}).status_code == 200, extra


@pytest.mark.parametrize("error, body, status, param", [
    (EngineDeadError("the engine thread is gone"), {"prompt": "abc"}, 503, None),
    (ValueError("prompt_ids has 9 tokens"), {"prompt": "abc"}, 400, "prompt"),
    (ValueError("prompt_ids has 9 tokens"), {"messages": HI}, 400, "messages"),
    (ValueError("request needs 99 slots"), {"prompt": "abc"}, 400, "prompt"),
    (ValueError("request needs 99 slots"), {"prompt": "abc", "max_tokens": 5}, 400, "max_tokens"),
    (ValueError("request needs 99 slots"), {"messages": HI, "max_completion_tokens": 5}, 400, "max_completion_tokens"),
    (TypeError("seed must be an int"), {"prompt": "abc"}, 400, "seed"),
])
def test_the_engines_refusals_are_400s_naming_the_field_and_its_death_a_503(error, body, status, param):
    _, client = app_client(error=error)
    err = error_of(post(client, body), status)
    assert err["param"] == param and str(error) in err["message"]


def test_an_unexpected_error_and_a_request_the_engine_failed_are_500s():
    class Broken(CharTokenizer):
        def __call__(self, text, add_special_tokens=True):
            raise RuntimeError("the tokenizer broke")

    _, client = app_client(tokenizer=Broken())
    err = error_of(post(client, {"prompt": "abc"}), 500)
    assert err["type"] == "InternalServerError" and "the tokenizer broke" in err["message"]
    _, client = app_client(outputs=[output("a", 1), output("", 1, True, "error")])
    err = error_of(post(client, {"prompt": "abc"}), 500)
    assert err["type"] == "InternalServerError"
    got = events(post(client, {"prompt": "abc", "stream": True}))  # a stream ends with the error, then [DONE]
    assert got[1:] == [{"error": err}, "[DONE]"] and got[0]["choices"][0]["text"] == "a"


def test_a_request_whose_own_constraints_left_no_token_is_a_400_naming_its_fields():
    why = "structured_outputs with min_tokens left no token to sample after 1 output token: every token was forbidden"
    ended = output("", 1, True, "error")
    ended.error = why
    for body, param in [({"prompt": "abc", "structured_outputs": {"regex": "a"}, "min_tokens": 3}, "structured_outputs"),
                        ({"messages": HI, "min_tokens": 3, "response_format": {
                            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
                         "response_format")]:
        _, client = app_client(outputs=[output("a", 1), ended])
        err = error_of(post(client, body), 400)
        assert err["param"] == param and err["message"].startswith(param) and "no token" in err["message"]
        got = events(post(client, {**body, "stream": True}))  # a stream ends with that error, then [DONE]
        assert got[-2:] == [{"error": err}, "[DONE]"]


def test_a_default_max_tokens_is_what_the_context_and_the_kv_cache_leave():
    """A chat without max_tokens may fill what is left (vLLM's default); a completion gets 16 (OpenAI's and
    vLLM's), or less where less is left."""
    llm, client = app_client(num_blocks=4, block_size=16, max_position_embeddings=256)
    for prompt, room in (("abc", 16), ("x" * 60, 5), ("x" * 64, 1)):  # capacity 64: 64 - len + 1
        assert post(client, {"prompt": prompt}).status_code == 200
        assert llm.added[-1].params.max_tokens == room
    chat = {"messages": HI}  # 'user: hi\nassistant: ' is 20 tokens
    post(client, chat)
    assert llm.added[-1].params.max_tokens == 45  # 64 - 20 + 1
    llm, client = app_client(num_blocks=64, block_size=16, max_position_embeddings=100)
    post(client, chat)
    assert llm.added[-1].params.max_tokens == 80  # the context: 100 - 20
    # without chunked prefill a prompt must fit one step's budget (32): 32 - 20 + 1
    llm, client = app_client(num_blocks=4, block_size=16, chunked=False, max_num_batched_tokens=32)
    post(client, chat)
    assert llm.added[-1].params.max_tokens == 13


def test_a_max_tokens_past_the_context_is_refused_naming_the_field_and_the_limit():
    llm, client = app_client(num_blocks=64, max_position_embeddings=256)
    assert post(client, {"prompt": "abc", "max_tokens": 253}).status_code == 200
    assert post(client, {"prompt": "a" * 255, "max_tokens": 1}).status_code == 200  # the last slot of the context
    chat = {"messages": HI}  # 'user: hi\nassistant: ' is 20 tokens
    for body, param in (({"prompt": "abc", "max_tokens": 254}, "max_tokens"),
                        ({"prompt": "a" * 256, "max_tokens": 1}, "max_tokens"),
                        ({**chat, "max_completion_tokens": 237}, "max_completion_tokens"),
                        ({**chat, "max_tokens": 5, "max_completion_tokens": 0}, "max_completion_tokens")):
        err = error_of(post(client, body), 400)
        assert err["param"] == param, err
        if body.get(param):  # OpenAI's wording, which clients look for: the limit and what was asked
            assert "maximum context length is 256 tokens" in err["message"] and "257" in err["message"]
    post(client, {**chat, "max_tokens": 5, "max_completion_tokens": 7})  # max_completion_tokens wins
    assert llm.added[-1].params.max_tokens == 7
    assert len(llm.added) == 3  # nothing refused reached the engine


def test_each_request_field_reaches_the_engine():
    llm, client = app_client(num_blocks=64)
    post(client, {"prompt": "abc"})
    assert llm.added[-1].params == SamplingParams(max_tokens=16, temperature=1.0)  # OpenAI's defaults otherwise
    body = {"prompt": "abc", "max_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 11,
            "stop_token_ids": [5, 6], "ignore_eos": True, "min_p": 0.05, "repetition_penalty": 1.1,
            "presence_penalty": 0.2, "frequency_penalty": 0.3, "logit_bias": {"65": 2.5}, "min_tokens": 2,
            "logprobs": 3, "stop": ["zz", "yy"], "include_stop_str_in_output": True, "skip_special_tokens": False,
            "allowed_token_ids": [97, 98], "bad_words": ["no"], "prompt_logprobs": 2}
    assert post(client, body).status_code == 200
    assert llm.added[-1].params == SamplingParams(
        max_tokens=9, temperature=0.5, top_p=0.9, top_k=7, seed=11, stop_token_ids=(5, 6), ignore_eos=True,
        min_p=0.05, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3, logit_bias={65: 2.5},
        min_tokens=2, logprobs=3, stop=("zz", "yy"), include_stop_str_in_output=True, skip_special_tokens=False,
        allowed_token_ids=(97, 98), bad_words=("no",), prompt_logprobs=2)
    post(client, {"prompt": "abc", "echo": True, "logprobs": 1})  # echo scores the prompt with the logprobs' k
    assert llm.added[-1].params.prompt_logprobs == 1
    for top_k, want in ((-1, 0), (0, 0), (1, 1)):  # vLLM's -1: no limit
        post(client, {"prompt": "abc", "top_k": top_k, "stop": "one"})
        assert (llm.added[-1].params.top_k, llm.added[-1].params.stop) == (want, ("one",))
    for extra, want in (({}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 4}, 4),
                        ({"logprobs": False, "top_logprobs": 0}, None)):
        post(client, {"messages": HI, **extra})
        assert llm.added[-1].params.logprobs == want, extra
    llm, client = app_client(policy="priority")  # the priority and cache salt go with the request
    post(client, {"prompt": "abc", "priority": -3, "cache_salt": "s1"})
    post(client, {"messages": HI})
    assert [(a.priority, a.cache_salt) for a in llm.added] == [(-3, "s1"), (0, None)]


def test_each_prompt_form_becomes_token_ids():
    llm, client = app_client()
    for prompt in ("abc", [97, 98, 99], ["abc"], [[97, 98, 99]]):
        assert post(client, {"prompt": prompt}).status_code == 200
        assert llm.added[-1].ids == [97, 98, 99], prompt
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    for batch_encoding in (False, True):  # a tokenizer may return a BatchEncoding (input_ids, attention_mask)
        llm, client = app_client(tokenizer=CharTokenizer(batch_encoding))
        assert post(client, {"messages": chat}).status_code == 200
        assert llm.tokenizer.templated == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": ""},
                                            {"role": "user", "content": "one\ntwo"}]]
        text = "system: be brief\nuser: \nuser: one\ntwo\nassistant: "
        assert llm.added[-1].ids == [ord(c) for c in text] and type(llm.added[-1].ids[0]) is int


def test_a_messages_tool_calls_and_results_reach_the_template_checked():
    """An assistant's tool_calls and a tool's result (tool_call_id, name) are handed to the chat template;
    other extras are not, and an extra of the wrong type is a 400 naming messages (vLLM's typed messages)."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    chat = [{"role": "user", "content": "hi", "colour": "red"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"}]
    llm, client = app_client()
    assert post(client, {"messages": chat}).status_code == 200
    assert llm.tokenizer.templated == [[{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "", "tool_calls": [call]},
                                        {"role": "tool", "content": "sunny", "tool_call_id": "c1",
                                         "name": "get_weather"}]]
    for bad in ({"name": 5}, {"tool_calls": "garbage"}, {"tool_call_id": ["c1"]}):
        err = error_of(post(client, {"messages": [{"role": "user", "content": "hi", **bad}]}), 400)
        assert err["param"] == "messages" and next(iter(bad)) in err["message"]
    assert len(llm.added) == 1


def head_of(body, kind, obj):
    assert re.fullmatch(rf"{kind}-[0-9a-f]{{32}}", body["id"]) and abs(body["created"] - time.time()) < 60
    assert type(body["created"]) is int and body["model"] == "m" and body["object"] == obj
    return {"id": body["id"], "created": body["created"], "model": "m", "object": obj}


def test_a_plain_completion_and_chat_response_whole():
    outs = [output("Hel", 1), output("", 1), output("lo", 2, True, "stop", "!", cached=16)]
    llm, client = app_client(outputs=outs)
    body = post(client, {"prompt": "abc"}).json()
    assert body == {**head_of(body, "cmpl", "text_completion"),
                    "choices": [{"index": 0, "logprobs": None, "finish_reason": "stop", "stop_reason": "!",
                                 "text": "Hello"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 16}}}
    assert body["id"] == llm.added[-1].rid and llm.streams[-1].exited == 1
    body = post(client, {"messages": HI}).json()
    assert head_of(body, "chatcmpl", "chat.completion") and body["choices"][0]["message"] == {
        "role": "assistant", "content": "Hello"}
    llm.outputs[:] = [output("x", 1, True, "length")]
    choice = post(client, {"prompt": "abc"}).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)


def test_a_completion_stream_whole():
    outs = [output("He", 1), output("", 1), output("llo", 2), output("", 3, True, "stop", 7)]
    llm, client = app_client(outputs=outs)
    got = events(post(client, {"prompt": "abc", "stream": True}))
    head = head_of(got[0], "cmpl", "text_completion")
    assert got == [{**head, "choices": [{"index": 0, "logprobs": None, "finish_reason": None, "stop_reason": None,
                                         "text": t}]} for t in ("He", "llo")] + [
        {**head, "choices": [{"index": 0, "logprobs": None, "finish_reason": "stop", "stop_reason": 7, "text": ""}]},
        "[DONE]"]  # the empty output in between (text held back) sends nothing
    assert head["id"] == llm.added[-1].rid and llm.streams[-1].exited == 1
    for include_usage, outputs, n in ((True, outs, 3), (True, [], 0), (False, outs, 3)):
        llm.outputs[:] = outputs
        got = events(post(client, {"prompt": "abc", "stream": True,
                                   "stream_options": {"include_usage": include_usage}}))
        assert got[-1] == "[DONE]" and all("usage" not in e for e in got[:-2])
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        assert (got[-2].get("usage"), got[-2]["choices"] == []) == ((usage, True) if include_usage else (None, False))
    # vLLM's continuous_usage_stats: each chunk also carries its counts so far (only with include_usage)
    llm.outputs[:] = outs
    for include_usage, counts in ((True, [1, 2, 3]), (False, [None] * 3)):
        got = events(post(client, {"prompt": "abc", "stream": True, "stream_options": {
            "include_usage": include_usage, "continuous_usage_stats": True}}))
        chunks = [e for e in got[:-1] if e["choices"]]
        assert [(e.get("usage") or {}).get("completion_tokens") for e in chunks] == counts
        assert all(e["usage"]["total_tokens"] == 3 + n for e, n in zip(chunks, counts) if n is not None)


def test_required_tool_calls_cut_short_give_their_text_streamed_or_not():
    """tool_choice "required": the calls come whole with the last chunk; cut short by max_tokens there is no
    valid call, and the text the model wrote comes as content, streamed or not (a stream sent nothing)."""
    whole = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    cut = '[{"name": "get_weather", "param'
    body = {"messages": HI, "tools": [TOOL], "tool_choice": "required"}
    for text, reason in ((whole, "stop"), (cut, "length")):
        _, client = app_client(outputs=[output(text[:10], 3), output(text[10:], 9, True, reason)])
        message = post(client, body).json()["choices"][0]
        chunks = [e["choices"][0] for e in events(post(client, {**body, "stream": True}))[:-1]]
        streamed = "".join(ch["delta"].get("content") or "" for ch in chunks)
        calls = [call for ch in chunks for call in ch["delta"].get("tool_calls", [])]
        if reason == "stop":
            assert message["finish_reason"] == chunks[-1]["finish_reason"] == "tool_calls"
            assert [json.loads(x["function"]["arguments"]) for x in message["message"]["tool_calls"]] == [
                {"city": "Paris"}] == [json.loads(x["function"]["arguments"]) for x in calls]
            assert message["message"]["content"] is None and streamed == ""
        else:
            assert message["finish_reason"] == chunks[-1]["finish_reason"] == "length"
            assert message["message"]["content"] == streamed == cut and calls == []


def test_a_chat_stream_whole():
    outs = [output("", 0), output("Hi", 1), output("", 1), output(" there", 2), output("", 3, True, "stop")]
    llm, client = app_client(outputs=outs)
    got = events(post(client, {"messages": HI, "stream": True}))
    head = head_of(got[0], "chatcmpl", "chat.completion.chunk")

    def chunk(delta, reason=None):
        return {**head, "choices": [{"index": 0, "logprobs": None, "finish_reason": reason, "stop_reason": None,
                                     "delta": delta}]}

    # vLLM's: a chunk of its own names the role (at the first output: a client's TTFT stays the first
    # token's); a last chunk with no text has an empty delta
    role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]}
    assert got == [role, chunk({"content": "Hi"}), chunk({"content": " there"}), chunk({}, "stop"), "[DONE]"]
    assert llm.streams[-1].exited == 1

    def deltas(body):
        got = events(post(client, {"stream": True, **body}))
        return [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
                for c in got[:-1]], got

    llm.outputs[:] = [output("A", 1), output("B", 2, True, "length")]
    assert deltas({"messages": HI})[0] == [(0, {"role": "assistant", "content": ""}, None), (0, {"content": "A"}, None),
                                           (0, {"content": "B"}, "length")]
    # echo: the last message, when it has the reply's role, in a chunk of its own after the role's
    go_on = HI + [{"role": "assistant", "content": "Well,"}]
    got, raw = deltas({"messages": go_on, "echo": True, "add_generation_prompt": False, "return_token_ids": True})
    assert got[:2] == [(0, {"role": "assistant", "content": ""}, None), (0, {"content": "Well,"}, None)]
    assert raw[0]["prompt_token_ids"] == llm.added[-1].ids and "prompt_token_ids" not in raw[1]
    assert deltas({"messages": HI, "echo": True})[0][:2] == [(0, {"role": "assistant", "content": ""}, None),
                                                             (0, {"content": "A"}, None)]  # nothing to repeat
    # n choices: each one's role first
    got, _ = deltas({"messages": HI, "n": 2, "temperature": 1.0})
    assert sorted(got[:2]) == [(0, {"role": "assistant", "content": ""}, None),
                               (1, {"role": "assistant", "content": ""}, None)]
    assert all("role" not in d for _, d, _ in got[2:])


def lp(token, logprob, *tops):
    return SampleLogprobs(ord(token), logprob, 1, [ord(t) for t, _ in tops], [v for _, v in tops])


def test_logprobs_in_openais_two_shapes():
    outs = [output("ab", 2, logprobs=[lp("a", -0.5, ("a", -0.5), ("z", -2.0)), lp("b", -1.5, ("c", -1.0))]),
            output("é", 3, True, "length", logprobs=[lp("é", -0.25, ("é", -0.25), ("e", -3.0))])]
    _, client = app_client(outputs=outs)
    got = post(client, {"prompt": "abc", "logprobs": 2}).json()["choices"][0]["logprobs"]
    # a sampled token outside the top k ("b") is added to completions' top_logprobs, as vLLM does
    assert got == {"tokens": ["a", "b", "é"], "token_logprobs": [-0.5, -1.5, -0.25],
                   "top_logprobs": [{"a": -0.5, "z": -2.0}, {"c": -1.0, "b": -1.5}, {"é": -0.25, "e": -3.0}],
                   "text_offset": [0, 1, 2]}
    got = post(client, {"messages": HI, "logprobs": True, "top_logprobs": 2}).json()
    first, _, last = got["choices"][0]["logprobs"]["content"]
    assert first == {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "z", "logprob": -2.0, "bytes": [122]}]}
    assert last["bytes"] == [195, 169] and last["top_logprobs"][1] == {"token": "e", "logprob": -3.0, "bytes": [101]}


def test_streamed_logprobs_go_with_the_chunk_that_carries_their_text():
    outs = [output("a", 1, logprobs=[lp("a", -0.5)]), output("", 2, logprobs=[lp("\x01", -1.0)]),
            output("bc", 3, logprobs=[lp("c", -2.0)]), output("", 3, True, "stop")]
    llm, client = app_client(outputs=outs)
    got = events(post(client, {"prompt": "abc", "logprobs": 0, "stream": True}))
    assert [c["choices"][0]["logprobs"] for c in got[:-1]] == [
        {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}], "text_offset": [0]},
        {"tokens": ["\x01", "c"], "token_logprobs": [-1.0, -2.0], "top_logprobs": [{"\x01": -1.0}, {"c": -2.0}],
         "text_offset": [1, 2]},  # the held-back token's logprob comes with the next chunk that is sent
        {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}]
    got = events(post(client, {"messages": HI, "logprobs": True, "stream": True}))
    assert got[0]["choices"][0]["logprobs"] is None  # the role's chunk
    assert [[x["token"] for x in c["choices"][0]["logprobs"]["content"]] for c in got[1:-1]] == [
        ["a"], ["\x01", "c"], []]
    llm.outputs[:] = [output("a", 1), output("bc", 3, True, "stop")]  # none asked for, none sent
    got = events(post(client, {"prompt": "abc", "stream": True}))
    assert [c["choices"][0]["logprobs"] for c in got[:-1]] == [None, None]


def test_serve_prepacks_bfloat16_only_where_the_cpu_has_a_kernel_for_it(serve_spies, capsys, monkeypatch):
    from nano_engine.kernels import linear as linear_module

    monkeypatch.setattr(linear_module, "amx_library", lambda: None)  # a CPU without AMX or AVX-512
    monkeypatch.setattr(linear_module, "bf16_dot_library", lambda: None)
    assert serve_cli.main(["--dtype", "bf16", "--prepack"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--prepack" in last and "bf16" in last and "AVX512_BF16" in last, last
    assert serve_spies.calls == []


def test_tokenize_and_detokenize_as_vllm(server):
    """vLLM's /tokenize (a prompt, or chat messages through the template that chat completions
    use) and /detokenize; a bad body is a 400 naming its field."""
    s = server
    text = "The capital of France is Paris."
    r = httpx.post(f"{s.url}/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == list(s.tok(text)["input_ids"]) and r["count"] == len(r["tokens"]) > 0
    assert r["max_model_len"] == NUM_BLOCKS * BLOCK_SIZE + 1 and r["token_strs"] is None  # the cache (128 x 16) holds less than the model's 8192
    strs = httpx.post(f"{s.url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert strs == s.tok.convert_ids_to_tokens(r["tokens"])
    chat = httpx.post(f"{s.url}/tokenize", json={"messages": [{"role": "user", "content": "Name a planet."}]}).json()
    assert chat["tokens"] == chat_ids(s, "Name a planet.")
    served = s.client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Name a planet."}],
                                              max_tokens=1)
    assert served.usage.prompt_tokens == chat["count"]
    bare = httpx.post(f"{s.url}/tokenize", json={"messages": [{"role": "user", "content": "Name a planet."}],
                                                 "add_generation_prompt": False}).json()["tokens"]
    assert bare == chat["tokens"][:len(bare)] and len(bare) < chat["count"]
    assert httpx.post(f"{s.url}/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": s.tok.decode(r["tokens"])}
    assert httpx.get(f"{s.url}/version").json()["version"]
    vocab = s.engine.model.config.vocab_size
    for path, body, param in (("/detokenize", {"tokens": [vocab]}, "tokens"), ("/detokenize", {"tokens": ["x"]}, "tokens"),
                              ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "a", "messages": [{"role": "user"}]},
                                                            "messages"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
                              ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_special_tokens": True},
                               "add_special_tokens")):
        resp = httpx.post(f"{s.url}{path}", json=body)
        assert resp.status_code in (400, 404) and resp.json()["error"]["param"] == param, (path, body, resp.text)


def test_an_api_key_guards_the_v1_routes_and_leaves_the_others_open(served_engine):
    """--api-key as vLLM's: a /v1 request without the key, or with another one, is a 401 in
    OpenAI's error shape (the openai client raises AuthenticationError) and reaches no engine; with
    the key it is served; /health, /metrics, /version and /tokenize answer without it."""
    engine, llm = served_engine
    with pytest.raises(ValueError, match="api_key"):
        build_app(llm, "smol", api_key="")
    with serving(build_app(llm, "smol", api_key="sekret")) as url:
        queried = engine.scheduler.prefix_cache_queries
        for key in ("none", "sekret2", "sekre", "SEKRET"):
            wrong = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
            with pytest.raises(openai.AuthenticationError):
                wrong.completions.create(model="smol", prompt="Hello", max_tokens=2)
        r = httpx.get(f"{url}/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert engine.scheduler.prefix_cache_queries == queried  # no prompt reached the scheduler
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0, timeout=300)
        out = good.completions.create(model="smol", prompt="Hello", max_tokens=3, temperature=0)
        assert 1 <= out.usage.completion_tokens <= 3
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(url + path).status_code == 200, path
        assert httpx.post(f"{url}/tokenize", json={"prompt": "Hi"}).status_code == 200


def test_serve_takes_the_key_from_the_flag_or_vllms_variable_and_warns_an_open_listener(monkeypatch):
    """--api-key, else $VLLM_API_KEY (vLLM reads the same variable); serve warns when it listens
    beyond loopback without one."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert serve_cli.build_parser().parse_args([]).api_key is None
    assert serve_cli.build_parser().parse_args(["--api-key", "k1"]).api_key == "k1"
    monkeypatch.setenv("VLLM_API_KEY", "k2")
    assert serve_cli.build_parser().parse_args([]).api_key == "k2"
    assert serve_cli.build_parser().parse_args(["--api-key", "k1"]).api_key == "k1"
    for host, loopback in (("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
                           ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("example.org", False)):
        assert serve_cli.is_loopback(host) == loopback, host


def test_chat_honours_vllms_template_fields(server, monkeypatch):
    """add_generation_prompt, continue_final_message and chat_template_kwargs reach the chat
    template (they were accepted and ignored before); contradictions are 400s naming the field."""
    s = server
    user = [{"role": "user", "content": "What is the capital of France?"}]

    def template(messages, **kw):
        ids = s.tok.apply_chat_template(messages, tokenize=True, **kw)
        return [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]

    bare = s.client.chat.completions.create(model="smol", messages=user, max_tokens=1,
                                            extra_body={"add_generation_prompt": False})
    assert bare.usage.prompt_tokens == len(template(user, add_generation_prompt=False)) < len(chat_ids(s, user[0]["content"]))
    opened = user + [{"role": "assistant", "content": "The capital of France is"}]
    ids = template(opened, add_generation_prompt=False, continue_final_message=True)
    out = s.client.chat.completions.create(model="smol", messages=opened, max_tokens=6, temperature=0,
                                           extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content == s.tok.decode(reference(s, ids, 6), skip_special_tokens=True)
    seen = []
    original = s.tok.apply_chat_template
    monkeypatch.setattr(s.tok, "apply_chat_template", lambda *a, **kw: seen.append(kw) or original(*a, **kw))
    s.client.chat.completions.create(model="smol", messages=user, max_tokens=1,
                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert seen and seen[-1]["enable_thinking"] is False
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"add_generation_prompt": False, "continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs")):
        with pytest.raises(openai.BadRequestError) as e:
            s.client.chat.completions.create(model="smol", messages=user, max_tokens=1, extra_body=extra)
        assert e.value.body["param"] == param, extra

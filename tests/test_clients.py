"""The OpenAI-compatible server under two real clients, on the embedded model.

* lm-evaluation-harness (`lm_eval`, pinned in pyproject.toml) runs a small local multiple-choice
  task and a small generate_until task twice: with its `local-completions` model against our
  server (token-id prompts; `echo=true, logprobs=1, max_tokens=1` for each choice's loglikelihood;
  `stop` and `seed` for generation) and with its own `hf` backend, which loads the same GGUF file
  into transformers. Every choice's loglikelihood and is_greedy flag through the server equals
  what the hf backend computes, and every generated answer equals both the hf backend's and the
  engine's single-request greedy `generate` on the very token ids lm-eval sent.
* LangChain's `ChatOpenAI` (langchain-openai, pinned): `invoke` says what the plain `openai`
  client says at temperature 0 (and what `generate` says on the chat template's ids), `stream`'s
  pieces join into `invoke`'s text and end with the usage, and `with_structured_output` works
  both ways LangChain asks for it: `method="json_schema"` (a `response_format` of type
  json_schema; ChatOpenAI's default method in langchain-openai 1.x) and `method="function_calling"`
  (`tools` with `tool_choice` naming the function, the answer read from the reply's `tool_calls`).

lm_eval runs as a child process of this Python (offline: HF_*_OFFLINE, HF_HOME in a temp folder;
its task files and data are written by the test, nothing comes from a hub). The server runs in this
process (uvicorn in a thread on 127.0.0.1, a free port), behind a small ASGI wrapper that records
every POST body, so that a test can say what the client sent; the fixture that starts it stops it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from in_process import serving
from nano_engine import LLMEngine, generate
from nano_engine.models.loading import embedded_model_path
from nano_engine.serving.async_llm import AsyncLLM
from nano_engine.serving.server import build_app

MODEL = "smol"
LOGLIK_ATOL = 1e-3  # float32 both sides; the differences seen are ~1e-5 (our kernels vs transformers')
LM_EVAL_TIMEOUT = 300

# A multiple-choice task: one choice of the last question is the model's own greedy continuation
# (" The answer is: grass"), so that is_greedy is True at least once and the flag is really compared.
MC_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Berlin", "Paris", "Rome", "Madrid"], "label": 1},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten", "four"], "label": 1},
    {"question": "Which planet is known as the red planet?", "choices": ["Mars", "Venus", "Jupiter", "Mercury"], "label": 0},
    {"question": "What do bees make?", "choices": ["milk", "silk", "honey", "wool"], "label": 2},
    {"question": "What is frozen water called?", "choices": ["steam", "ice", "sand", "glass"], "label": 1},
    {"question": "What color is grass?", "choices": ["green", "The answer is: grass", "blue", "red"], "label": 0},
]
GEN_DOCS = [
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "What is 2 + 2?", "answer": "4"},
    {"question": "What color is the sky on a clear day?", "answer": "blue"},
    {"question": "How many days are in a week?", "answer": "seven"},
]
MC_TASK, GEN_TASK = "nano_engine_clients_mc", "nano_engine_clients_gen"
# Both tasks read their documents from a local JSON-lines file (no hub): lm-eval's `json` dataset.
TASK_HEAD = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
metadata:
  version: 1.0
"""
MC_YAML = TASK_HEAD + """\
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
GEN_YAML = TASK_HEAD + """\
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


class Recorder:
    """ASGI wrapper around the app: keeps (path, JSON body) of every POST, then hands the body on."""

    def __init__(self, app):
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(parts)
        try:
            self.bodies.append((scope["path"], json.loads(body)))
        except ValueError:
            self.bodies.append((scope["path"], body))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # what comes after the body: the disconnect

        return await self.app(scope, replay, send)


@pytest.fixture(scope="module")
def server():
    """One engine (float32, the embedded model), its AsyncLLM and a recorded app for the module."""
    engine = LLMEngine.from_pretrained(num_blocks=128, block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
    llm = AsyncLLM(engine)
    app = Recorder(build_app(llm, MODEL))
    try:
        with serving(app) as url:
            yield SimpleNamespace(url=url, engine=engine, tok=engine.tokenizer, bodies=app.bodies,
                                  client=openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0,
                                                       timeout=120))
    finally:
        llm.shutdown()


def reference(s, ids: list[int], max_tokens: int) -> list[int]:
    """Single-request greedy generate: the tokens every served request must equal."""
    return generate(s.engine.model, ids, max_tokens, eos_token_id=s.engine.model.config.eos_token_id)


def posted(s, path: str, since: int = 0) -> list[dict]:
    return [body for p, body in s.bodies[since:] if p == path]


# ----- lm-evaluation-harness -----

def run_lm_eval(root: Path, name: str, model: str, model_args: dict, *extra: str) -> dict:
    """`python -m lm_eval run` on the two local tasks; the results and each task's samples by doc_id."""
    out = root / f"out_{name}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(root / "hf_home"), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model,
           "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
           "--tasks", MC_TASK, GEN_TASK, "--include_path", str(root / "tasks"),
           "--output_path", str(out), "--log_samples", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LM_EVAL_TIMEOUT, cwd=root)
    print(f"\nlm_eval --model {model}: {time.perf_counter() - start:.1f} s\n{proc.stdout.strip()}")
    assert proc.returncode == 0, f"lm_eval {name} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    (results,) = out.glob("*/results_*.json")
    samples = {}
    for task in (MC_TASK, GEN_TASK):
        (path,) = out.glob(f"*/samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        samples[task] = sorted(rows, key=lambda r: r["doc_id"])
    return {"results": json.loads(results.read_text())["results"], "samples": samples, "stdout": proc.stdout}


@pytest.fixture(scope="module")
def lm_eval_runs(server, tmp_path_factory):
    """The same two tasks through our server (local-completions) and through lm-eval's hf backend."""
    root = tmp_path_factory.mktemp("lm_eval")
    (root / "tasks").mkdir()
    for task, yaml, docs in ((MC_TASK, MC_YAML, MC_DOCS), (GEN_TASK, GEN_YAML, GEN_DOCS)):
        data = root / f"{task}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (root / "tasks" / f"{task}.yaml").write_text(yaml.format(task=task, data=data))
    tokenizer = server.tok.name_or_path  # the engine's own tokenizer folder: both runs send the same ids
    gguf = embedded_model_path()
    since = len(server.bodies)
    # batch_size 4: lm-eval sends lists of 4 token-id prompts in one request.
    api = run_lm_eval(root, "api", "local-completions",
                      {"model": MODEL, "base_url": f"{server.url}/v1/completions", "tokenizer": tokenizer,
                       "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1,
                       "max_retries": 1}, "--batch_size", "4")
    sent = posted(server, "/v1/completions", since)
    hf = run_lm_eval(root, "hf", "hf", {"pretrained": gguf.parent, "gguf_file": gguf.name, "tokenizer": tokenizer,
                                        "dtype": "float32"}, "--device", "cpu")
    return SimpleNamespace(api=api, hf=hf, sent=sent)


def loglikelihoods(run) -> list[list[tuple[float, bool]]]:
    """Per doc, per choice: (loglikelihood, is_greedy), from lm-eval's sample strings."""
    return [[(float(ll), greedy == "True") for ll, greedy in row["filtered_resps"]]
            for row in run["samples"][MC_TASK]]


def test_lm_eval_loglikelihoods_through_the_server_equal_the_hf_backend(lm_eval_runs):
    api, hf = loglikelihoods(lm_eval_runs.api), loglikelihoods(lm_eval_runs.hf)
    assert [len(c) for c in api] == [len(c) for c in hf] == [len(d["choices"]) for d in MC_DOCS]
    diffs = [abs(a[0] - h[0]) for da, dh in zip(api, hf) for a, h in zip(da, dh)]
    print(f"\nmax |loglikelihood(server) - loglikelihood(hf)| = {max(diffs):.3g} over {len(diffs)} choices")
    assert max(diffs) <= LOGLIK_ATOL, (api, hf)
    assert [[g for _, g in d] for d in api] == [[g for _, g in d] for d in hf]
    assert api[-1][1][1] is True  # " The answer is: grass" is the model's own greedy continuation
    for metric in ("acc,none", "acc_norm,none"):
        assert lm_eval_runs.api["results"][MC_TASK][metric] == lm_eval_runs.hf["results"][MC_TASK][metric]
    # What lm-eval sent for them: token-id prompts, 4 to a request, the prompt's logprobs echoed.
    echo = [b for b in lm_eval_runs.sent if b.get("echo")]
    assert sum(len(b["prompt"]) for b in echo) == sum(len(d["choices"]) for d in MC_DOCS)
    for body in echo:
        assert body["max_tokens"] == 1 and body["logprobs"] == 1 and body["temperature"] == 0
        assert all(isinstance(t, int) for prompt in body["prompt"] for t in prompt)


def test_lm_eval_generate_until_through_the_server_equals_generate_and_the_hf_backend(server, lm_eval_runs):
    gen = [b for b in lm_eval_runs.sent if not b.get("echo")]
    sent_prompts = [p for b in gen for p in b["prompt"]]
    assert len(sent_prompts) == len(GEN_DOCS)
    assert all(b["stop"][0] == "\n" and b["max_tokens"] == 16 and b["temperature"] == 0 for b in gen)
    api, hf = lm_eval_runs.api["samples"][GEN_TASK], lm_eval_runs.hf["samples"][GEN_TASK]
    for doc, a, h in zip(GEN_DOCS, api, hf):
        context = a["arguments"]["gen_args_0"]["arg_0"]
        assert context == f"Q: {doc['question']}\nA:"
        ids = server.tok(context, add_special_tokens=False)["input_ids"]
        assert ids in sent_prompts  # the very ids lm-eval sent
        want = server.tok.decode(reference(server, ids, 16), skip_special_tokens=True).split("\n")[0]
        assert want.strip()
        assert a["filtered_resps"] == h["filtered_resps"] == [want], (doc, a["resps"], h["resps"])
    for metric in ("exact_match,none",):
        assert lm_eval_runs.api["results"][GEN_TASK][metric] == lm_eval_runs.hf["results"][GEN_TASK][metric]


# ----- LangChain -----

MESSAGES = [SystemMessage("Be brief."), HumanMessage("Name three colors.")]
OPENAI_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]


def chat_model(s, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=f"{s.url}/v1", api_key="EMPTY", temperature=0, max_retries=0,
                      timeout=120, **{"max_tokens": 16, **kwargs})


def test_langchain_invoke_equals_the_openai_client_and_generate(server):
    reply = chat_model(server).invoke(MESSAGES)
    plain = server.client.chat.completions.create(model=MODEL, messages=OPENAI_MESSAGES, max_tokens=16,
                                                  temperature=0)
    assert reply.content == plain.choices[0].message.content
    ids = server.tok.apply_chat_template(OPENAI_MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert reply.content == server.tok.decode(reference(server, ids, 16), skip_special_tokens=True)
    assert reply.response_metadata["finish_reason"] == plain.choices[0].finish_reason
    assert reply.usage_metadata["input_tokens"] == plain.usage.prompt_tokens == len(ids)
    assert reply.usage_metadata["output_tokens"] == plain.usage.completion_tokens


def test_langchain_stream_joins_into_invoke_and_ends_with_the_usage(server):
    llm = chat_model(server, stream_usage=True)
    reply = llm.invoke(MESSAGES)
    chunks = list(llm.stream(MESSAGES))
    assert len(chunks) > 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(c.content for c in chunks) == reply.content
    total = sum(chunks[1:], chunks[0])
    assert total.content == reply.content
    assert total.usage_metadata is not None
    assert total.usage_metadata["input_tokens"] == reply.usage_metadata["input_tokens"]
    assert total.usage_metadata["output_tokens"] == reply.usage_metadata["output_tokens"]
    assert total.usage_metadata["total_tokens"] == reply.usage_metadata["total_tokens"]
    last = posted(server, "/v1/chat/completions")[-1]
    assert last["stream"] is True and last["stream_options"] == {"include_usage": True}


class Person(BaseModel):
    """A person named in the text."""
    name: str
    age: int


EXTRACT = "Alice is 30 years old. Who is she? Answer with her name and age."


def test_langchain_structured_output_json_schema(server):
    since = len(server.bodies)
    structured = chat_model(server, max_tokens=64).with_structured_output(Person, method="json_schema",
                                                                          include_raw=True)
    out = structured.invoke(EXTRACT)
    (body,) = posted(server, "/v1/chat/completions", since)
    fmt = body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Person"
    assert fmt["json_schema"]["schema"]["required"] == ["name", "age"]
    assert out["parsing_error"] is None and isinstance(out["parsed"], Person), out
    assert Person.model_validate_json(out["raw"].content) == out["parsed"]
    # The same request through the plain client gives the same text.
    plain = server.client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=64,
                                                  temperature=0, response_format=fmt)
    assert plain.choices[0].message.content == out["raw"].content


def test_langchain_structured_output_function_calling(server):
    since = len(server.bodies)
    structured = chat_model(server, max_tokens=64).with_structured_output(Person, method="function_calling",
                                                                          include_raw=True)
    out = structured.invoke(EXTRACT)
    (body,) = posted(server, "/v1/chat/completions", since)
    (tool,) = body["tools"]
    assert tool["type"] == "function" and tool["function"]["name"] == "Person"
    assert body["tool_choice"] == {"type": "function", "function": {"name": "Person"}}
    assert out["parsing_error"] is None and isinstance(out["parsed"], Person), out
    (call,) = out["raw"].tool_calls
    assert call["name"] == "Person" and Person.model_validate(call["args"]) == out["parsed"]

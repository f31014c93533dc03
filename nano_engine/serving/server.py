"""An OpenAI-compatible HTTP server on the async engine: `python -m nano_engine serve`.

FastAPI + uvicorn, the stack of vLLM's server (`vllm/entrypoints/openai/api_server.py`,
`serving_completion.py`, `serving_chat.py`): GET /v1/models, POST /v1/completions and
/v1/chat/completions (streamed as server-sent events, ending in `data: [DONE]`), GET /health,
GET /metrics (metrics.py), GET /version and vLLM's POST /tokenize and /detokenize; with an API key,
the /v1 routes ask for it (RequireKey). Every bad value is a 400 in OpenAI's error shape naming its
`param`, checked before the request is queued; an unknown model is a 404. A client that goes away
aborts its request: for a stream, Starlette cancels the response when it sees `http.disconnect`;
for a plain response, the handler is raced against the disconnect (vLLM's `with_cancellation`,
`vllm/entrypoints/utils.py`).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .async_llm import AsyncLLM, EngineDeadError, RequestOutput, RequestStream
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       check_supported, param_of, validation_error)
from ..request import SamplingParams
from .metrics import CONTENT_TYPE, ServingMetrics


try:
    VERSION = importlib.metadata.version("nano_engine")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "unknown"


# apply_chat_template's own arguments, which chat_template_kwargs may not set
TEMPLATE_ARGUMENTS = {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                      "return_dict", "return_tensors", "tools", "documents", "chat_template", "tokenizer_kwargs"}


def with_cancellation(handler):
    """Run the handler, but stop it (and so abort its request) if the client disconnects first."""

    @functools.wraps(handler)
    async def wrapper(body, raw: Request):
        work = asyncio.ensure_future(handler(body, raw))
        gone = asyncio.ensure_future(_disconnected(raw))
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if work in done:
            return work.result()
        work.cancel()
        return Response(status_code=499)  # nobody reads it: the client is gone

    return wrapper


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, llm: AsyncLLM, model_name: str):
        self.llm, self.model_name = llm, model_name
        engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.max_model_len = engine.model.config.max_position_embeddings
        cache = engine.config.cache_config
        # The most KV slots one request can hold: a default max_tokens must fit them.
        self.capacity = cache.num_blocks * cache.block_size
        sched = engine.config.scheduler_config
        if not sched.enable_chunked_prefill:
            self.capacity = min(self.capacity, sched.max_num_batched_tokens)
        self.created = int(time.time())

    # ----- requests in -----
    def _check_model(self, req) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(f"The model `{req.model}` does not exist; this server serves `{self.model_name}`",
                           "model", 404, "NotFoundError", "model_not_found")

    def _chat_ids(self, req) -> list[int]:
        """The chat template's token ids for req.messages, with vLLM's template fields (call with the
        tokenizer lock held)."""
        if req.add_generation_prompt and req.continue_final_message:
            raise APIError("add_generation_prompt and continue_final_message cannot both be true: a reply "
                           "either starts or continues the last message", "continue_final_message")
        extra = req.chat_template_kwargs or {}
        taken = sorted(set(extra) & TEMPLATE_ARGUMENTS)
        if taken:
            raise APIError(f"chat_template_kwargs may not set {taken[0]!r}: the request sets it", "chat_template_kwargs")
        if req.continue_final_message and req.messages[-1].role != "assistant":
            raise APIError(f"continue_final_message needs an assistant message last, not {req.messages[-1].role!r}",
                           "continue_final_message")
        messages = [{"role": m.role, "content": _text(m.content, i)} for i, m in enumerate(req.messages)]
        if req.continue_final_message:  # passed only when set: simpler tokenizers (tiny.py's) lack it
            extra = {**extra, "continue_final_message": True}
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                     tokenize=True, **extra)
        except Exception as e:
            raise APIError(f"messages do not fit the model's chat template: {e}", "messages") from e
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(i) for i in ids]

    def tokenize(self, req: TokenizeRequest) -> dict:
        """vLLM's /tokenize: a prompt's token ids, or a chat's through the template."""
        self._check_model(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("send either prompt or messages", "prompt" if req.prompt is None else "messages")
        with self.llm.tokenizer_lock:
            if req.messages is not None:
                if req.add_special_tokens:
                    raise APIError("add_special_tokens=true is not supported with messages (the chat template "
                                   "adds the special tokens)", "add_special_tokens")
                ids = self._chat_ids(req)
            else:
                special = True if req.add_special_tokens is None else req.add_special_tokens
                ids = [int(i) for i in self.tokenizer(req.prompt, add_special_tokens=special)["input_ids"]]
            strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: the text of token ids, each checked against the vocabulary."""
        self._check_model(req)
        vocab = self.llm.engine.model.config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "tokens")
        with self.llm.tokenizer_lock:
            return {"prompt": self.tokenizer.decode(req.tokens)}

    def _prompt_ids(self, req) -> tuple[list[int], str]:
        with self.llm.tokenizer_lock:
            if isinstance(req, ChatCompletionRequest):
                return self._chat_ids(req), "messages"
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise APIError(f"prompt is a batch of {len(prompt)} prompts: send one prompt per request",
                                   "prompt")
                prompt = prompt[0]
            if isinstance(prompt, str):
                return list(self.tokenizer(prompt)["input_ids"]), "prompt"
            return list(prompt), "prompt"

    def _sampling_params(self, req, num_prompt: int, prompt_param: str) -> tuple[SamplingParams, str]:
        """The request's SamplingParams, which check every value (a refusal names its field)."""
        max_tokens, max_param = req.max_tokens, "max_tokens"
        if getattr(req, "max_completion_tokens", None) is not None:
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        room = min(self.max_model_len - num_prompt, self.capacity - num_prompt + 1)
        if max_tokens is None:
            if room < 1:
                raise APIError(f"the prompt has {num_prompt} tokens, which leaves no room for output: this "
                               f"model's maximum context length is {self.max_model_len} tokens and the KV "
                               f"cache holds {self.capacity} per request", prompt_param)
            max_tokens = room  # vLLM's default: whatever the context has left
        elif isinstance(max_tokens, int) and max_tokens >= 1 and num_prompt + max_tokens > self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the {prompt_param}, "
                           f"{max_tokens} in the completion). Please reduce the length of the {prompt_param} "
                           f"or {max_param}.", max_param)
        top_k = req.top_k if req.top_k is not None else 0
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=0 if top_k == -1 else top_k,
                seed=req.seed, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                min_p=_or(req.min_p, 0.0), repetition_penalty=_or(req.repetition_penalty, 1.0),
                presence_penalty=_or(req.presence_penalty, 0.0), frequency_penalty=_or(req.frequency_penalty, 0.0),
                logit_bias=_logit_bias(req.logit_bias), min_tokens=req.min_tokens, logprobs=_num_logprobs(req),
                stop=req.stop or (), include_stop_str_in_output=req.include_stop_str_in_output)
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param_of(e, {"max_tokens": max_param})) from e
        return params, max_param

    async def _start(self, req, kind: str) -> tuple[RequestStream, int]:
        self._check_model(req)
        check_supported(req)
        ids, prompt_param = self._prompt_ids(req)
        params, max_param = self._sampling_params(req, len(ids), prompt_param)
        policy = self.llm.engine.config.scheduler_config.policy
        if req.priority != 0 and policy != "priority":
            raise APIError(f"priority={req.priority} needs --scheduling-policy priority (this server runs "
                           f"{policy})", "priority")
        rid = f"{kind}-{uuid.uuid4().hex}"
        try:
            stream = await self.llm.add_request(ids, params, rid, priority=req.priority, cache_salt=req.cache_salt)
        except EngineDeadError as e:
            raise APIError(str(e), None, 503, "ServiceUnavailableError") from e
        except (TypeError, ValueError) as e:
            given = max_param if getattr(req, max_param, None) is not None else prompt_param
            raise APIError(str(e), param_of(e, {"prompt_ids": prompt_param, "request": given})) from e
        return stream, len(ids)

    # ----- responses out -----
    def _usage(self, num_prompt: int, out: RequestOutput | None) -> dict:
        done = out.num_output_tokens if out else 0
        return {"prompt_tokens": num_prompt, "completion_tokens": done, "total_tokens": num_prompt + done,
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens if out else 0}}

    def _logprobs(self, chat: bool, lps: list | None, offset: int) -> dict | None:
        """OpenAI's logprobs object for these tokens (sampling.SampleLogprobs); completions' text_offset
        counts from `offset`, the length of the text of the tokens before them."""
        if lps is None:
            return None
        with self.llm.tokenizer_lock:
            def text(t: int) -> str:
                return self.tokenizer.decode([t])

            if chat:
                return {"content": [{
                    "token": text(x.token_id), "logprob": x.logprob, "bytes": list(text(x.token_id).encode()),
                    "top_logprobs": [{"token": text(t), "logprob": v, "bytes": list(text(t).encode())}
                                     for t, v in zip(x.top_ids, x.top_logprobs)]} for x in lps]}
            tokens, offsets = [], []
            for x in lps:
                offsets.append(offset)
                tokens.append(text(x.token_id))
                offset += len(tokens[-1])
            # vLLM's: the top alternatives and the sampled token, which may be one of them
            tops = [{**{text(t): v for t, v in zip(x.top_ids, x.top_logprobs)}, tok: x.logprob}
                    for x, tok in zip(lps, tokens)]
            return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps], "top_logprobs": tops,
                    "text_offset": offsets}

    def _choice(self, chat: bool, text: str, out: RequestOutput, delta: bool, first: bool = False,
                logprobs: dict | None = None) -> dict:
        reason = out.finish_reason if out.finished else None
        if reason == "error":
            raise APIError("the engine failed while running this request (see the server's log)", None, 500,
                           "InternalServerError")
        choice = {"index": 0, "logprobs": logprobs, "finish_reason": reason, "stop_reason": out.stop_reason}
        if not chat:
            choice["text"] = text
        elif delta:
            choice["delta"] = ({"role": "assistant", "content": text} if first else
                               ({"content": text} if text or not reason else {}))
        else:
            choice["message"] = {"role": "assistant", "content": text}
        return choice

    async def respond(self, req, kind: str):
        chat = isinstance(req, ChatCompletionRequest)
        stream, num_prompt = await self._start(req, kind)
        head = {"id": stream.request_id, "created": int(time.time()), "model": self.model_name}
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._sse(stream, head, chat, num_prompt, usage), media_type="text/event-stream")
        text, last, lps = [], None, None
        async with stream:
            async for out in stream:
                text.append(out.new_text)
                last = out
                if out.logprobs is not None:
                    lps = (lps or []) + out.logprobs
        body = {**head, "object": "chat.completion" if chat else "text_completion",
                "choices": [self._choice(chat, "".join(text), last, delta=False,
                                         logprobs=self._logprobs(chat, lps, 0))],
                "usage": self._usage(num_prompt, last)}
        return JSONResponse(body)

    async def _sse(self, stream: RequestStream, head: dict, chat: bool, num_prompt: int, usage: bool):
        obj = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        last, first, pending, offset = None, chat, None, 0
        try:
            async with stream:
                async for out in stream:
                    last = out
                    if out.logprobs is not None:  # sent with the next chunk that goes out
                        pending = (pending or []) + out.logprobs
                    if not (out.new_text or out.finished or first):
                        continue  # text held back (half a character, a possible stop string)
                    lps = self._logprobs(chat, pending, offset)
                    if lps is not None and not chat:
                        offset += sum(map(len, lps["tokens"]))
                    pending = None if pending is None else []
                    choice = self._choice(chat, out.new_text, out, delta=True, first=first, logprobs=lps)
                    first = False
                    yield _event({**obj, "choices": [choice]})
            if usage:
                yield _event({**obj, "choices": [], "usage": self._usage(num_prompt, last)})
        except APIError as e:
            yield _event(e.body())
        yield "data: [DONE]\n\n"


def _or(value, default):
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON strings) with int keys; SamplingParams checks the rest."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"logit_bias key {key!r} must be a token id (an integer)") from None
    return out


def _num_logprobs(req) -> int | None:
    """How many alternatives per token: completions' logprobs, or chat's top_logprobs when logprobs=true."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _text(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(f"messages[{i}].content: only text parts are supported, got {part.get('type')!r}",
                           "messages")
        parts.append(part["text"])
    return "\n".join(parts)


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class RequireKey:
    """vLLM's --api-key: every /v1 route needs `Authorization: Bearer <key>`, else a 401 in OpenAI's
    error shape; the others (/health, /metrics, /version, /tokenize, /detokenize) stay open, as in
    vLLM (`AuthenticationMiddleware`, vllm/entrypoints/openai/api_server.py). A pure ASGI layer:
    it leaves the body and the disconnect messages of the routes it passes untouched."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):  # in constant time
                err = APIError("missing or wrong API key: send Authorization: Bearer <key>", None, 401,
                               "AuthenticationError")
                return await JSONResponse(err.body(), status_code=401)(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `llm` as `model_name` (the caller owns and shuts down `llm`); with
    `api_key`, the /v1 routes ask for it (RequireKey)."""
    if llm.tokenizer is None:
        raise ValueError("the server needs the engine's tokenizer (LLMEngine(model, tokenizer, ...))")
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty: pass a key, or None for an open server")
    app = FastAPI(title="nano_engine", docs_url=None, redoc_url=None)
    if api_key is not None:
        app.add_middleware(RequireKey, key=api_key)
    serving = OpenAIServing(llm, model_name)
    metrics = ServingMetrics(model_name)
    metrics.attach(llm)
    app.state.serving, app.state.metrics = serving, metrics

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_, e: RequestValidationError):
        err = validation_error(e.errors())
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal(_, e: Exception):
        err = APIError(f"internal error: {type(e).__name__}: {e}", None, 500, "InternalServerError")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health():
        if llm.dead is not None:
            return JSONResponse({"status": "dead"}, status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return serving.detokenize(body)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": serving.created, "owned_by": "nano_engine",
            "root": model_name, "max_model_len": serving.max_model_len}]}

    @app.post("/v1/completions")
    @with_cancellation
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.respond(body, "cmpl")

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def chat(body: ChatCompletionRequest, raw: Request):
        return await serving.respond(body, "chatcmpl")

    return app

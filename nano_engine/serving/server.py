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
import dataclasses
import functools
import importlib.metadata
import inspect
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_llm import AsyncLLM, EngineDeadError, RequestOutput, RequestStream
from .protocol import (COMPLETION_MAX_TOKENS, MAX_CHOICES, APIError, ChatCompletionRequest, CompletionRequest,
                       DetokenizeRequest, TokenizeRequest, called_tools, check_supported, refusal, structured_outputs,
                       tool_mode, validation_error)
from .. import checks
from ..request import SamplingParams
from .metrics import CONTENT_TYPE, ServingMetrics


try:
    VERSION = importlib.metadata.version("nano_engine")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "unknown"


# apply_chat_template's own arguments, which chat_template_kwargs may not set (they would change how the
# prompt is made: truncation=True with max_length=2 cuts the messages away); with those of the tokenizer's
# own signature (template_arguments), whatever its version adds
TEMPLATE_ARGUMENTS = {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                      "return_dict", "return_tensors", "tools", "documents", "chat_template", "tokenizer_kwargs",
                      "padding", "truncation", "max_length", "return_assistant_tokens_mask", "sanitize_control_tokens"}


def template_arguments(tokenizer) -> set[str]:
    """The arguments chat_template_kwargs may not set: TEMPLATE_ARGUMENTS and the named parameters of this
    tokenizer's apply_chat_template."""
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        params = ()
    return TEMPLATE_ARGUMENTS | {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def longest_token(tokenizer) -> int | None:
    """The most characters one token of this tokenizer spells (its vocabulary's longest entry), or None
    where the tokenizer cannot list its vocabulary. A text longer than max_model_len times this has more
    tokens than the context holds (only a normalizer that shortens text could make it fit, and no real
    prompt is hundreds of thousands of characters): it is refused before the tokenizer spends seconds on it."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return None
    return max((len(t) for t in vocab), default=None) or None


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


@dataclasses.dataclass
class _Prompt:
    ids: list[int]
    text: str | None  # as the client sent it, if it sent text (echo returns it as is)


@dataclasses.dataclass(eq=False)
class _Choice:
    """One choice of a response: one engine request, and what has come of it."""
    index: int
    prompt: _Prompt
    stream: RequestStream
    first: bool  # the first choice of its prompt: it computes the prompt (its cached tokens count)
    last: RequestOutput | None = None
    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    # streamed: chunks sent, logprobs and token ids not sent yet, completions' text offset
    sent: int = 0
    pending: list | None = None
    pending_ids: list[int] = dataclasses.field(default_factory=list)
    offset: int = 0
    tool_call_id: str | None = None  # a streamed tool call's id, in its first chunk

    def take(self, out: RequestOutput) -> None:
        self.last = out
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs

    async def drain(self) -> None:
        """All of the request's outputs (a plain response)."""
        async with self.stream:
            async for out in self.stream:
                self.take(out)
                self.text.append(out.new_text)
                self.token_ids += out.new_token_ids
                if out.logprobs is not None:
                    self.logprobs = (self.logprobs or []) + out.logprobs

    async def pump(self, queue: asyncio.Queue) -> None:
        """Each output into the queue as (self, output); then (self, None), or (self, the error)."""
        try:
            async with self.stream:
                async for out in self.stream:
                    queue.put_nowait((self, out))
        except Exception as e:
            queue.put_nowait((self, e))
        queue.put_nowait((self, None))


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, llm: AsyncLLM, model_name: str, max_model_len: int | None = None):
        self.llm, self.model_name = llm, model_name
        engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.template_arguments = template_arguments(self.tokenizer)
        self.token_chars = longest_token(self.tokenizer)
        cache = engine.config.cache_config
        # The most KV slots one request can hold: a default max_tokens must fit them. Without chunked
        # prefill, a request's tokens must also go into one step (after a preemption, all of them).
        self.capacity = cache.num_blocks * cache.block_size
        sched = engine.config.scheduler_config
        one_step = not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.capacity
        if one_step:
            self.capacity = sched.max_num_batched_tokens
        # vLLM's max_model_len: what /v1/models and /tokenize advertise and every request is held to.
        # By default the model's context, or less where one request cannot hold that much KV (its last
        # token's KV is never written: capacity + 1 tokens).
        positions = engine.model.config.max_position_embeddings
        self.max_model_len = min(positions, self.capacity + 1)
        if max_model_len is not None:
            max_model_len = checks.integer("max_model_len", max_model_len, minimum=1)
            if max_model_len > self.max_model_len:
                why = (f"the model's max_position_embeddings={positions}" if max_model_len > positions else
                       f"the {self.capacity + 1} tokens one request can have with max_num_batched_tokens="
                       f"{self.capacity} and chunked prefill off (a prompt goes into one step; raise "
                       f"--max-num-batched-tokens or --enable-chunked-prefill)" if one_step else
                       f"the {self.capacity + 1} tokens one request can have with this KV cache ({self.capacity} "
                       f"slots, none for the last token; more KV blocks: --num-gpu-blocks-override)")
                raise ValueError(f"max_model_len={max_model_len} is above {why}")
            self.max_model_len = max_model_len
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
        taken = sorted(set(extra) & self.template_arguments)
        if taken:
            raise APIError(f"chat_template_kwargs may not set {taken[0]!r}: the request sets it", "chat_template_kwargs")
        if req.continue_final_message and req.messages[-1].role != "assistant":
            raise APIError(f"continue_final_message needs an assistant message last, not {req.messages[-1].role!r}",
                           "continue_final_message")
        messages = [{**m.template_fields(), "content": _text(m.content, i)} for i, m in enumerate(req.messages)]
        tools = called_tools(req)
        if tools:  # the template shows the model the functions it may call
            extra = {**extra, "tools": tools}
        if req.continue_final_message:  # passed only when set: simpler tokenizers (tiny.py's) lack it
            extra = {**extra, "continue_final_message": True}
        template = getattr(req, "chat_template", None)
        if template is not None:
            extra = {**extra, "chat_template": template}
        special = getattr(req, "add_special_tokens", None) and isinstance(req, ChatCompletionRequest)
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                     tokenize=not special, **extra)
        except Exception as e:
            param = "chat_template" if template is not None else "messages"
            raise APIError(f"messages do not fit the {'given' if template else 'model' + chr(39) + 's'} chat "
                           f"template: {e}", param) from e
        if special:  # the templated text, then the tokenizer's own special tokens too (vLLM's add_special_tokens)
            ids = self.tokenizer(ids, add_special_tokens=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(i) for i in ids]

    def tokenize(self, req: TokenizeRequest) -> dict:
        """vLLM's /tokenize: a prompt's token ids, or a chat's through the template."""
        self._check_model(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("send either prompt or messages", "prompt" if req.prompt is None else "messages")
        self._check_length(req)
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

    def _check_length(self, req) -> None:
        """A request's text (its messages' or its prompts') that cannot fit the context in any tokenization
        is refused before it is tokenized (unless the request cuts its prompt to its last tokens, which
        needs them all)."""
        if getattr(req, "messages", None) is not None:
            texts, param = [_text(m.content, i) for i, m in enumerate(req.messages)], "messages"
        else:
            texts, param = (req.prompt if isinstance(req.prompt, list) else [req.prompt]), "prompt"
        limit = None if self.token_chars is None else self.max_model_len * self.token_chars
        size = sum(len(t) for t in texts if isinstance(t, str))
        if limit is not None and getattr(req, "truncate_prompt_tokens", None) is None and size > limit:
            raise APIError(f"{param} has {size} characters, more than this model's maximum context length of "
                           f"{self.max_model_len} tokens could hold (a token spells at most {self.token_chars} "
                           f"characters)", param)

    def _prompts(self, req) -> tuple[list[_Prompt], str]:
        """The request's prompts as token ids (a completion may send a list of them), each cut to
        its last truncate_prompt_tokens tokens when asked; and the field they came from. Slow for a
        long text: the server calls it in a worker thread, off the event loop."""
        chat = isinstance(req, ChatCompletionRequest)
        self._check_length(req)
        with self.llm.tokenizer_lock:
            if chat:
                prompts, param = [_Prompt(self._chat_ids(req), None)], "messages"
            else:
                raw, param = req.prompt, "prompt"
                if not (isinstance(raw, list) and raw and isinstance(raw[0], (str, list))):
                    raw = [raw]  # one prompt: a string or token ids
                if not raw or len(raw) * req.n > MAX_CHOICES:
                    raise APIError(f"prompt is a list of {len(raw)} prompts with n={req.n}: send 1 to "
                                   f"{MAX_CHOICES} choices per request", "prompt")
                prompts = [_Prompt(list(self.tokenizer(p, add_special_tokens=req.add_special_tokens)["input_ids"]), p)
                           if isinstance(p, str) else _Prompt(list(p), None) for p in raw]
        keep = req.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if not 1 <= keep <= self.max_model_len:
                raise APIError(f"truncate_prompt_tokens={req.truncate_prompt_tokens} must be -1 (the model's "
                               f"context) or in [1, {self.max_model_len}]", "truncate_prompt_tokens")
            prompts = [_Prompt(p.ids[-keep:], p.text if len(p.ids) <= keep else None) for p in prompts]
        return prompts, param

    def _sampling_params(self, req, num_prompt: int, prompt_param: str) -> SamplingParams:
        """The request's SamplingParams, which check every value (a refusal names its field)."""
        chat = isinstance(req, ChatCompletionRequest)
        max_param = _max_param(req)
        max_tokens = getattr(req, max_param)
        if not chat and req.echo and max_tokens == 0:
            max_tokens = 1  # the prompt only (vLLM's echo without generation): one token is run and dropped
        room = self.max_model_len - num_prompt  # max_model_len is at most what the KV cache holds (capacity + 1)
        if max_tokens is None:
            if room < 1:
                raise APIError(f"the prompt has {num_prompt} tokens, which leaves no room for output: this "
                               f"model's maximum context length is {self.max_model_len} tokens and the KV "
                               f"cache holds {self.capacity} per request", prompt_param)
            # chat: whatever the context has left (vLLM's default); completions: 16 (OpenAI's and vLLM's)
            max_tokens = room if chat else min(COMPLETION_MAX_TOKENS, room)
        elif isinstance(max_tokens, int) and max_tokens >= 1 and num_prompt + max_tokens > self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the {prompt_param}, "
                           f"{max_tokens} in the completion). Please reduce the length of the {prompt_param} "
                           f"or {max_param}.", max_param)
        structured, structured_param = structured_outputs(req)
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and not chat and req.echo and req.logprobs is not None:
            prompt_logprobs = req.logprobs  # echo returns the prompt's logprobs with the output's
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=_or(req.top_k, 0),
                seed=req.seed, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                min_p=_or(req.min_p, 0.0), repetition_penalty=_or(req.repetition_penalty, 1.0),
                presence_penalty=_or(req.presence_penalty, 0.0), frequency_penalty=_or(req.frequency_penalty, 0.0),
                logit_bias=_logit_bias(req.logit_bias), min_tokens=req.min_tokens, logprobs=_num_logprobs(req),
                stop=() if req.stop is None else req.stop, include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens, bad_words=tuple(req.bad_words or ()),
                allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
                prompt_logprobs=prompt_logprobs, structured_outputs=structured)
        except (TypeError, ValueError) as e:
            raise refusal(e, {"max_tokens": max_param, "structured_outputs": structured_param}) from e
        return params

    async def _start(self, req, kind: str) -> tuple[str, list[_Choice], list[_Prompt]]:
        """Check the request, then hand the engine one request per choice: n per prompt, child i of a
        prompt with seed + i (vLLM's parallel sampling), children after the first added once it has
        computed the prompt, whose blocks they then share through the prefix cache."""
        self._check_model(req)
        check_supported(req)
        # in a worker thread: the event loop serves the other requests meanwhile
        prompts, prompt_param = await asyncio.to_thread(self._prompts, req)
        planned = [self._sampling_params(req, len(p.ids), prompt_param) for p in prompts]  # all checked first
        policy = self.llm.engine.config.scheduler_config.policy
        if req.priority != 0 and policy != "priority":
            raise APIError(f"priority={req.priority} needs --scheduling-policy priority (this server runs "
                           f"{policy})", "priority")
        rid = f"{kind}-{uuid.uuid4().hex}"
        choices: list[_Choice] = []
        try:
            for p, (prompt, params) in enumerate(zip(prompts, planned)):
                base = rid if len(prompts) == 1 else f"{rid}-{p}"
                first = None
                for i in range(req.n):
                    child = params if i == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + i)
                    cid = base if req.n == 1 else f"{i}_{base}"
                    extra = {} if first is None else {"after": first}
                    stream = await self.llm.add_request(prompt.ids, child, cid, priority=req.priority,
                                                        cache_salt=req.cache_salt, **extra)
                    first = first or cid
                    choices.append(_Choice(len(choices), prompt, stream, first=i == 0))
        except BaseException as e:
            for c in choices:
                c.stream.abort()
            raise self._engine_error(e, req) from e
        return rid, choices, prompts

    @staticmethod
    def _engine_error(e: BaseException, req) -> BaseException:
        """The API error for what the engine raised at a request of `req` (its refusals name the
        request's own fields); anything else as it is."""
        chat = isinstance(req, ChatCompletionRequest)
        prompt_param = "messages" if chat else "prompt"
        max_param = _max_param(req)
        if isinstance(e, EngineDeadError):
            return APIError(str(e), None, 503, "ServiceUnavailableError")
        if isinstance(e, (TypeError, ValueError)):
            given = max_param if getattr(req, max_param, None) is not None else prompt_param
            structured = structured_outputs(req)[1]
            return refusal(e, {"prompt_ids": prompt_param, "request": given, "structured_outputs": structured})
        return e

    # ----- responses out -----
    def _usage(self, prompts: list[_Prompt], choices: list[_Choice], echo_only: bool) -> dict:
        """The prompts counted once each (not once per choice); the outputs of every choice."""
        num_prompt = sum(len(p.ids) for p in prompts)
        done = 0 if echo_only else sum(c.last.num_output_tokens for c in choices if c.last is not None)
        cached = sum(c.last.num_cached_tokens for c in choices if c.first and c.last is not None)
        return {"prompt_tokens": num_prompt, "completion_tokens": done, "total_tokens": num_prompt + done,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _token(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.tokenizer.decode([token_id])

    def _logprobs(self, req, entries: list | None, offset: int) -> dict | None:
        """OpenAI's logprobs object for these (token id, sampling.SampleLogprobs or None) pairs;
        completions' text_offset counts from `offset`, the length of the text before them. A None
        (the first token of an echoed prompt) has no logprob: null, as in OpenAI's echo."""
        if entries is None:
            return None
        chat, as_ids = isinstance(req, ChatCompletionRequest), bool(req.return_tokens_as_token_ids)
        with self.llm.tokenizer_lock:
            def text(t: int) -> str:
                return self._token(t, as_ids)

            if chat:
                return {"content": [{
                    "token": text(t), "logprob": x.logprob, "bytes": list(text(t).encode()),
                    "top_logprobs": [{"token": text(i), "logprob": v, "bytes": list(text(i).encode())}
                                     for i, v in zip(x.top_ids, x.top_logprobs)]} for t, x in entries]}
            tokens, offsets = [], []
            for t, _ in entries:
                offsets.append(offset)
                tokens.append(text(t))
                offset += len(self.tokenizer.decode([t])) if as_ids else len(tokens[-1])
            # vLLM's: the top alternatives and the sampled token, which may be one of them
            tops = [None if x is None else {**{text(i): v for i, v in zip(x.top_ids, x.top_logprobs)}, tok: x.logprob}
                    for (_, x), tok in zip(entries, tokens)]
            return {"tokens": tokens, "token_logprobs": [None if x is None else x.logprob for _, x in entries],
                    "top_logprobs": tops, "text_offset": offsets}

    def _vllm_prompt_logprobs(self, lps: list | None) -> list | None:
        """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob,
        rank, decoded_token}} for the token and the top k."""
        if lps is None:
            return None
        with self.llm.tokenizer_lock:
            def entry(x):
                if x is None:
                    return None
                out = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": self.tokenizer.decode([t])}
                       for r, (t, v) in enumerate(zip(x.top_ids, x.top_logprobs))}
                out[str(x.token_id)] = {"logprob": x.logprob, "rank": x.rank,
                                        "decoded_token": self.tokenizer.decode([x.token_id])}
                return out
            return [entry(x) for x in lps]

    def _text_length(self, ids: list[int]) -> int:
        """Characters of these tokens' texts, each decoded alone (as logprobs show them)."""
        with self.llm.tokenizer_lock:
            return sum(len(self.tokenizer.decode([t])) for t in ids)

    def _prompt_text(self, prompt: _Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        with self.llm.tokenizer_lock:
            return self.tokenizer.decode(prompt.ids)

    def _echo(self, req, c: _Choice) -> tuple[str, list]:
        """What echo puts before a choice's output: completions the prompt (text, and its logprob
        entries when logprobs are asked for); chat the last message when its role is the reply's."""
        if not req.echo:
            return "", []
        if isinstance(req, ChatCompletionRequest):
            last = req.messages[-1]
            return (_text(last.content, len(req.messages) - 1) if last.role == _reply_role(req) else ""), []
        entries = []
        if req.logprobs is not None:
            lps = c.prompt_logprobs or [None] * len(c.prompt.ids)
            entries = list(zip(c.prompt.ids, lps))
        return self._prompt_text(c.prompt), entries

    def _choice(self, req, c: _Choice, text: str, delta: bool, logprobs: dict | None, token_ids: list[int],
                first: bool) -> dict:
        chat = isinstance(req, ChatCompletionRequest)
        out = c.last
        reason = out.finish_reason if out is not None and out.finished else None
        if reason == "error" and out.error:  # its own constraints left no token: a 400 naming them
            raise self._engine_error(ValueError(out.error), req)
        if reason == "error":
            raise APIError("the engine failed while running this request (see the server's log)", None, 500,
                           "InternalServerError")
        choice = {"index": c.index, "logprobs": logprobs, "finish_reason": reason,
                  "stop_reason": out.stop_reason if reason else None}
        if not chat:
            choice["text"] = text
        elif tool_mode(req) is not None:
            calls, reason = self._tool_calls(req, c, text, delta, first, reason)
            choice["finish_reason"] = reason
            if delta:
                choice["delta"] = {"tool_calls": calls} if calls else {}
                if reason and not calls and tool_mode(req) == "required":  # cut short: the text, as a plain
                    choice["delta"]["content"] = "".join(c.text)  # response gives it (held back until now)
            else:
                choice["message"] = {"role": "assistant", "content": None if calls else text,
                                     **({"tool_calls": calls} if calls else {})}
        elif delta:
            choice["delta"] = {"content": text} if text or not reason else {}
        else:
            choice["message"] = {"role": _reply_role(req), "content": text}
        if req.return_token_ids:
            if not chat and first:
                choice["prompt_token_ids"] = c.prompt.ids
            choice["token_ids"] = token_ids
        if not chat and req.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(c.prompt_logprobs)
        return choice

    @staticmethod
    def _tool_calls(req, c: _Choice, text: str, delta: bool, first: bool, reason: str | None):
        """OpenAI's tool_calls for the text a tool grammar produced, and the finish reason to send.
        A named function: the text is its arguments (streamed piece by piece); "required": the text
        is a JSON list of {name, parameters}, one call each (sent whole, with the last chunk)."""
        mode = tool_mode(req)
        if mode == "required":
            if reason is None:
                return [], None
            try:
                calls = [{"name": x["name"], "arguments": json.dumps(x["parameters"], ensure_ascii=False)}
                         for x in json.loads("".join(c.text) if delta else text)]
            except (ValueError, TypeError, KeyError):  # cut short (max_tokens): no valid call to send
                return [], reason
            return [{"index": i, "id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function", "function": f}
                    for i, f in enumerate(calls)], "tool_calls" if reason == "stop" else reason
        if delta and not first:
            return ([{"index": 0, "function": {"arguments": text}}] if text else []), reason
        if c.tool_call_id is None:
            c.tool_call_id = f"chatcmpl-tool-{uuid.uuid4().hex}"
        call = {"id": c.tool_call_id, "type": "function", "function": {"name": mode, "arguments": text}}
        return [{"index": 0, **call} if delta else call], reason

    async def respond(self, req, kind: str):
        chat = isinstance(req, ChatCompletionRequest)
        rid, choices, prompts = await self._start(req, kind)
        head = {"id": rid, "created": int(time.time()), "model": self.model_name}
        echo_only = not chat and req.echo and req.max_tokens == 0
        if req.stream:
            return StreamingResponse(self._sse(req, choices, prompts, head, echo_only), media_type="text/event-stream")
        try:
            await asyncio.gather(*(c.drain() for c in choices))
        except (EngineDeadError, TypeError, ValueError) as e:
            raise self._engine_error(e, req) from e
        finally:
            for c in choices:
                c.stream.abort()
        body = {**head, "object": "chat.completion" if chat else "text_completion", "choices": []}
        for c in choices:
            lps = [(x.token_id, x) for x in c.logprobs or []] if _num_logprobs(req) is not None else None
            text, ids = "".join(c.text), c.token_ids
            if echo_only:
                text, ids, lps = "", [], ([] if lps is not None else None)
            prefix, entries = self._echo(req, c)
            if lps is None and entries:
                lps = []
            body["choices"].append(self._choice(req, c, prefix + text, delta=False, first=True, token_ids=ids,
                                                logprobs=self._logprobs(req, None if lps is None else entries + lps, 0)))
        if chat and req.return_token_ids:
            body["prompt_token_ids"] = prompts[0].ids
        if chat and req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(choices[0].prompt_logprobs)
        body["usage"] = self._usage(prompts, choices, echo_only)
        return JSONResponse(body)

    async def _sse(self, req, choices: list[_Choice], prompts: list[_Prompt], head: dict, echo_only: bool):
        """The choices' outputs as server-sent events, each chunk one choice's (with its index), in
        the order the engine gives them."""
        chat = isinstance(req, ChatCompletionRequest)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM's continuous_usage_stats: every chunk also says its choice's counts so far
        continuous = usage and req.stream_options.continuous_usage_stats
        obj = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(c.pump(queue)) for c in choices]
        left, opened = len(choices), not chat
        try:
            while left:
                c, out = await queue.get()
                if out is None:
                    left -= 1
                    continue
                if isinstance(out, BaseException):
                    raise self._engine_error(out, req)
                if not opened:  # a chat's first output: each choice's role first, then what echo repeats (vLLM's)
                    opened = True
                    for event in self._chat_opening(req, choices, obj, continuous):
                        yield _event(event)
                c.take(out)
                if not echo_only:
                    c.pending_ids += out.new_token_ids
                    if out.logprobs is not None:  # sent with the next chunk that goes out
                        c.pending = (c.pending or []) + [(x.token_id, x) for x in out.logprobs]
                text = "" if echo_only else out.new_text
                c.text.append(text)
                if not (text or out.finished or (c.sent == 0 and req.echo and not chat)):
                    continue  # text held back (half a character, a possible stop string)
                first = c.sent == 0
                if first and not chat:
                    prefix, entries = self._echo(req, c)
                    text = prefix + text
                    if entries:
                        c.pending = entries + (c.pending or [])
                lps = self._logprobs(req, c.pending, c.offset)
                if lps is not None and not chat:
                    c.offset += self._text_length([t for t, _ in c.pending])
                c.pending = None if c.pending is None else []
                choice = self._choice(req, c, text, delta=True, first=first, logprobs=lps, token_ids=c.pending_ids)
                c.pending_ids = []
                c.sent += 1
                event = {**obj, "choices": [choice]}
                if continuous:
                    done = 0 if echo_only else c.last.num_output_tokens
                    event["usage"] = {"prompt_tokens": len(c.prompt.ids), "completion_tokens": done,
                                      "total_tokens": len(c.prompt.ids) + done}
                yield _event(event)
            if usage:
                yield _event({**obj, "choices": [], "usage": self._usage(prompts, choices, echo_only)})
        except APIError as e:
            yield _event(e.body())
        finally:
            for task in pumps:
                task.cancel()
            for c in choices:
                c.stream.abort()
        yield "data: [DONE]\n\n"

    def _chat_opening(self, req, choices: list[_Choice], obj: dict, continuous: bool) -> list[dict]:
        """The chunks a chat stream starts with once the engine has the first output (so a client's TTFT
        is still the first token's): each choice's role with empty content, then, with echo, the last
        message's text when it has the reply's role (vLLM's chat_completion_stream_generator)."""
        def event(c: _Choice, delta: dict) -> dict:
            n = len(c.prompt.ids)
            usage = {"usage": {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n}} if continuous else {}
            return {**obj, "choices": [{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}],
                    **usage}

        roles = [event(c, {"role": _reply_role(req), "content": ""}) for c in choices]
        if req.return_token_ids:
            for e, c in zip(roles, choices):
                e["prompt_token_ids"] = c.prompt.ids
        echoed = self._echo(req, choices[0])[0]
        return roles + [event(c, {"content": echoed}) for c in choices if echoed]


def _reply_role(req) -> str:
    """The role of a chat reply: the assistant's, or with add_generation_prompt=false the last
    message's, which it continues (vLLM's get_chat_request_role)."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def _max_param(req) -> str:
    """The field that caps a request's output: chat's max_completion_tokens when given, else max_tokens."""
    return "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"


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


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None,
              max_model_len: int | None = None) -> FastAPI:
    """The FastAPI app serving `llm` as `model_name` (the caller owns and shuts down `llm`); with
    `api_key`, the /v1 routes ask for it (RequireKey); `max_model_len` as vLLM's flag (default: the
    model's context, or what the KV cache holds for one request if that is less)."""
    if llm.tokenizer is None:
        raise ValueError("the server needs the engine's tokenizer (LLMEngine(model, tokenizer, ...))")
    if api_key is not None and not api_key:
        raise ValueError("api_key is empty: pass a key, or None for an open server")
    app = FastAPI(title="nano_engine", docs_url=None, redoc_url=None)
    if api_key is not None:
        app.add_middleware(RequireKey, key=api_key)
    serving = OpenAIServing(llm, model_name, max_model_len)
    metrics = ServingMetrics(model_name, serving.max_model_len)
    metrics.attach(llm)
    app.state.serving, app.state.metrics = serving, metrics

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_, e: RequestValidationError):
        err = validation_error(e.errors())
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):  # an unknown path (404), a wrong method (405), ...
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(e.status_code, "BadRequestError")
        err = APIError(str(e.detail), None, e.status_code, kind)
        return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))

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

    # Plain functions: FastAPI runs them in its worker threads, so that a long text does not hold up the
    # event loop (every other request and /health)
    @app.post("/tokenize")
    def tokenize(body: TokenizeRequest):
        return serving.tokenize(body)

    @app.post("/detokenize")
    def detokenize(body: DetokenizeRequest):
        return serving.detokenize(body)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": serving.created, "owned_by": "nano_engine",
            # vLLM's root: the model's path (what it was loaded from), beside the name it is served as
            "root": getattr(llm.engine.model, "name_or_path", None) or model_name,
            "max_model_len": serving.max_model_len}]}

    @app.post("/v1/completions")
    @with_cancellation
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.respond(body, "cmpl")

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def chat(body: ChatCompletionRequest, raw: Request):
        return await serving.respond(body, "chatcmpl")

    return app

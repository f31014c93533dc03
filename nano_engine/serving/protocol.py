"""The OpenAI API's request bodies and error shape, as the server reads and writes them.

Field names and defaults follow OpenAI's API and vLLM's extras (`vllm/entrypoints/openai/protocol.py`:
CompletionRequest, ChatCompletionRequest, ErrorResponse): `top_k`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `priority`, `repetition_penalty`, `min_p` and `min_tokens` are vLLM's,
not OpenAI's. Unknown fields are accepted and ignored (clients send extras), but a field that asks for
something this engine does not do (n > 1, best_of, echo, tools, ...) is refused with a 400 naming it,
never silently dropped.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # None: 1.0, OpenAI's and vLLM's default
    top_p: float | None = None
    top_k: int | None = None  # vLLM: 0 or -1 = no limit
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only with the same salt
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None  # None: 0 (off)
    frequency_penalty: float | None = None  # None: 0 (off)
    repetition_penalty: float | None = None  # vLLM's; None: 1 (off)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> bias in [-100, 100]
    min_p: float | None = None  # vLLM's; None: 0 (off)
    min_tokens: int = 0  # vLLM's
    top_logprobs: int | None = None  # chat only (with logprobs=true): how many alternatives per token
    # Asked for, but not done by this engine: refused when set to anything but their defaults.
    best_of: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the top-k alternatives per token (0: the sampled token's logprob only)
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class _ChatTemplate(BaseModel):
    """vLLM's chat-template fields, on chat completions and on /tokenize."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is left open, to be continued
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template (enable_thinking, ...)


class ChatCompletionRequest(_ChatTemplate, _Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False  # the sampled tokens' logprobs; top_logprobs alternatives with each
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


# field -> the value meaning "not asked for"
UNSUPPORTED = {"best_of": (None, 1), "echo": (False,), "suffix": (None, ""), "tools": (None, [])}
# vLLM's default --max-logprobs: the most alternatives per token a request may ask for.
MAX_LOGPROBS = 20


class TokenizeRequest(_ChatTemplate):
    """vLLM's /tokenize body: a prompt (TokenizeCompletionRequest) or chat messages (TokenizeChatRequest)."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM: True for a prompt, False for messages (the template adds them)
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class APIError(Exception):
    """An error the client caused or should know of, sent as OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "BadRequestError", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def check_supported(req: _Common) -> None:
    for name, defaults in UNSUPPORTED.items():
        if name in type(req).model_fields and getattr(req, name) not in defaults:
            raise APIError(f"{name}={getattr(req, name)!r} is not supported by this server "
                           f"(leave it unset)", name)
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options can only be set when stream is true", "stream_options")
    if req.n != 1:
        raise APIError(f"n={req.n} is not supported: this server returns one choice per request (n=1)", "n")
    chat = isinstance(req, ChatCompletionRequest)
    k, name = (req.top_logprobs, "top_logprobs") if chat else (req.logprobs, "logprobs")
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise APIError(f"{name}={k} must be in [0, {MAX_LOGPROBS}]", name)
    if chat and k is not None and k > 0 and not req.logprobs:
        raise APIError(f"top_logprobs={k} needs logprobs=true", "top_logprobs")
    if not chat and req.top_logprobs is not None:
        raise APIError("top_logprobs is a chat parameter: completions take logprobs=<int>", "top_logprobs")
    fmt = getattr(req, "response_format", None)
    if fmt not in (None, {"type": "text"}):
        raise APIError(f"response_format={fmt!r} is not supported (only {{'type': 'text'}})", "response_format")


_FIELD = re.compile(r"^([a-z_]+)")


def param_of(error: Exception, rename: dict[str, str] | None = None) -> str | None:
    """The request field that an engine ValueError / TypeError names (its messages start with it)."""
    m = _FIELD.match(str(error))
    if not m:
        return None
    name = m.group(1)
    return (rename or {}).get(name, name)


def validation_error(errors: list[dict]) -> APIError:
    """A 400 from pydantic's errors: the first one, `param` its top-level field (OpenAI's params are)."""
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    return APIError(f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}", param)


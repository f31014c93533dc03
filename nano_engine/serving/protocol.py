"""The OpenAI API's request bodies and error shape, as the server reads and writes them.

Field names and defaults follow OpenAI's API and vLLM's extras (`vllm/entrypoints/openai/protocol.py`:
CompletionRequest, ChatCompletionRequest, ErrorResponse): `top_k`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `priority`, `repetition_penalty`, `min_p`, `min_tokens`,
`skip_special_tokens`, `allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`, `prompt_logprobs`,
`add_special_tokens`, `return_token_ids` and `return_tokens_as_token_ids` are vLLM's, not OpenAI's.
A field that vLLM or OpenAI defines and this engine does not do (UNSUPPORTED: best_of, beam search,
guided decoding, tools, ...) is refused with a 400 naming it when it asks for anything but its
default, never silently dropped. A field neither of them defines is ignored with a warning in the
server's log, as vLLM does (clients send extras of their own).

At the end, what a request asks of the grammar (structured.py): `structured_outputs` reads its one
constraint (response_format, structured_outputs, guided_*, or a tool call), `tool_mode` which tool
it calls, if any.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..structured import StructuredOutputsParams, parse as structured_parse

logger = logging.getLogger(__name__)


_SURROGATE = re.compile("[\ud800-\udfff]")


class FieldError(ValueError):
    """A refusal from a check of the whole body that knows the field it refuses (validation_error reads it)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


class _Text(BaseModel):
    """Every string of a body must be text: JSON may carry a lone UTF-16 surrogate ("\\ud800"), which no
    tokenizer reads and no response can echo. Refused first, naming where it is."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data):
        stack = [((), data)]
        while stack:  # no recursion: a body may nest deeply
            path, value = stack.pop()
            if isinstance(value, str):
                if _SURROGATE.search(value):
                    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
                    raise FieldError(f"{where or 'body'} holds a lone UTF-16 surrogate (an escape like \\ud800 "
                                     f"without its pair): send valid Unicode text", str(path[0]) if path else None)
            elif isinstance(value, dict):
                named = [(path + (_SURROGATE.sub("\ufffd", str(k)),), k, v) for k, v in value.items()]  # shown safely
                stack += [(p, k) for p, k, _ in named] + [(p, v) for p, _, v in named]
            elif isinstance(value, list):
                stack += [(path + (i,), v) for i, v in enumerate(value)]
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(_Text):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown(self):
        unknown = sorted(set(self.model_extra or ()) - set(UNSUPPORTED))
        if unknown:
            logger.warning("fields ignored (neither OpenAI nor vLLM defines them): %s", unknown)
        return self

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
    skip_special_tokens: bool = True  # vLLM's: the text leaves out special tokens
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    bad_words: list[str] | None = None  # vLLM's: words never generated
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: the context)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top k's
    return_token_ids: bool | None = None  # vLLM's: token ids beside the text (prompt_token_ids, token_ids)
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:<id>"
    # Structured output (one of these): OpenAI's response_format (json_object, json_schema), vLLM's
    # structured_outputs ({json | json_object | regex | choice | grammar}) and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # vLLM's: the backend; only xgrammar is here


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]  # a list of prompts: one choice per prompt (x n)
    logprobs: int | None = None  # the top-k alternatives per token (0: the sampled token's logprob only)
    echo: bool = False  # the prompt before the output (with its logprobs, when logprobs are asked for)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (BOS) around a text prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    # What a message may carry besides, handed to the chat template (tool calls and their results); the
    # other extras are not
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def template_fields(self) -> dict[str, Any]:
        """The fields the chat template sees: role, content, and those extras that are set."""
        return {"role": self.role, **{k: getattr(self, k) for k in MESSAGE_EXTRAS if getattr(self, k) is not None}}


MESSAGE_EXTRAS = ("name", "tool_calls", "tool_call_id", "reasoning_content")


class _ChatTemplate(BaseModel):
    """vLLM's chat-template fields, on chat completions and on /tokenize."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is left open, to be continued
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template (enable_thinking, ...)


class ChatCompletionRequest(_ChatTemplate, _Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False  # the sampled tokens' logprobs; top_logprobs alternatives with each
    # OpenAI's function tools: called through the grammar when tool_choice names one or is "required"
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # a named function is one call; "required" may make several
    echo: bool = False  # vLLM's: the reply starts with the last message when it has the reply's role
    chat_template: str | None = None  # vLLM's: a Jinja template instead of the tokenizer's
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens on top of the template's


# Fields of OpenAI's or vLLM's requests that this engine does not do -> the values meaning "not
# asked for" (what clients send by default). Anything else is refused by name.
UNSUPPORTED = {
    "best_of": (None, 1), "suffix": (None, ""), "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    "spaces_between_special_tokens": (None, True), "logits_processors": (None, []), "prompt_embeds": (None,),
    "structural_tag": (None,), "guided_whitespace_pattern": (None,), "functions": (None, []),
    "function_call": (None, "none"), "documents": (None,), "mm_processor_kwargs": (None,),
    "kv_transfer_params": (None,), "vllm_xargs": (None,), "reasoning_effort": (None,), "include_reasoning": (None, True),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
}
# vLLM's default --max-logprobs: the most alternatives per token a request may ask for.
MAX_LOGPROBS = 20
# OpenAI's and vLLM's max_tokens of a completion that sets none (a chat takes what the context leaves).
COMPLETION_MAX_TOKENS = 16
# The most choices one request may ask for (prompts x n); OpenAI caps n at 128.
MAX_N, MAX_CHOICES = 128, 1024


class TokenizeRequest(_ChatTemplate, _Text):
    """vLLM's /tokenize body: a prompt (TokenizeCompletionRequest) or chat messages (TokenizeChatRequest)."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM: True for a prompt, False for messages (the template adds them)
    return_token_strs: bool = False


class DetokenizeRequest(_Text):
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


def _same(value, defaults) -> bool:
    return any(value is d or (type(value) is type(d) and value == d) for d in defaults)


def check_supported(req: _Common) -> None:
    extra = req.model_extra or {}
    for name, defaults in UNSUPPORTED.items():
        if name in extra and not _same(extra[name], defaults):
            raise APIError(f"{name}={extra[name]!r} is not supported by this server (leave it unset)", name)
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options can only be set when stream is true", "stream_options")
    if not 1 <= req.n <= MAX_N:
        raise APIError(f"n={req.n} must be in [1, {MAX_N}]", "n")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError("prompt_logprobs are not available when stream is true (vLLM's rule)", "prompt_logprobs")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise APIError(f"prompt_logprobs={req.prompt_logprobs} must be in [0, {MAX_LOGPROBS}]", "prompt_logprobs")
    chat = isinstance(req, ChatCompletionRequest)
    k, name = (req.top_logprobs, "top_logprobs") if chat else (req.logprobs, "logprobs")
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise APIError(f"{name}={k} must be in [0, {MAX_LOGPROBS}]", name)
    if chat and k is not None and k > 0 and not req.logprobs:
        raise APIError(f"top_logprobs={k} needs logprobs=true", "top_logprobs")
    if not chat and req.top_logprobs is not None:
        raise APIError("top_logprobs is a chat parameter: completions take logprobs=<int>", "top_logprobs")
    if req.guided_decoding_backend not in (None, "auto", "xgrammar"):
        raise APIError(f"guided_decoding_backend={req.guided_decoding_backend!r} is not supported: this server "
                       f"uses xgrammar", "guided_decoding_backend")


_FIELD = re.compile(r"^([a-z_]+)")


def refusal(error: Exception, rename: dict[str, str]) -> APIError:
    """A 400 for what the engine refused, in the request's words. The engine's messages start with the
    field they refuse; `param` is that field as the request spells it (`rename`: engine name ->
    request field), and where the engine's field is the request's own under another name
    (max_tokens -> max_completion_tokens, structured_outputs -> response_format) the message says it too."""
    text = str(error)
    m = _FIELD.match(text)
    if not m:
        return APIError(text, None)
    name = m.group(1)
    param = rename.get(name, name)
    if name in _SAME_FIELD and param and param != name:
        text = param + text[len(name):]
    return APIError(text, param)


_SAME_FIELD = {"max_tokens", "structured_outputs"}


def validation_error(errors: list[dict]) -> APIError:
    """A 400 from pydantic's errors: the first one, `param` its top-level field (OpenAI's params are)."""
    first = errors[0]
    error = (first.get("ctx") or {}).get("error")
    if isinstance(error, FieldError):
        return APIError(str(error), error.param)
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
        return APIError(f"the body is not valid JSON: {first.get('msg', 'invalid')} at character "
                        f"{first.get('loc', (None, '?'))[-1]}", None)
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    return APIError(f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}", param)


# ----- what a request asks of the grammar: structured output and tool calls -----

def tool_mode(req) -> str | None:
    """None (no tool is called), "required", or the name of the function the request calls."""
    if not isinstance(req, ChatCompletionRequest) or req.tool_choice in (None, "none", "auto") and not req.tools:
        return None
    if not req.tools:  # vLLM's rule: a tool to call needs the tools
        raise APIError(f"tool_choice={req.tool_choice!r} needs tools: send the functions it may call",
                       "tool_choice")
    if req.tool_choice == "none":
        return None
    choice = req.tool_choice or "auto"  # OpenAI's default with tools
    if choice == "required":
        return "required"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(f"tool_choice={choice!r} must be {{'type': 'function', 'function': {{'name': ...}}}}",
                           "tool_choice")
        if name not in tool_functions(req):
            raise APIError(f"tool_choice names {name!r}, which is not in tools ({sorted(tool_functions(req))})",
                           "tool_choice")
        return name
    raise APIError(f"tool_choice={choice!r} is not supported: this server calls tools through a grammar, so name "
                   f"the function ({{'type': 'function', 'function': {{'name': ...}}}}) or send 'required' "
                   f"(there is no parser for 'auto')", "tool_choice")


def tool_functions(req) -> dict[str, dict]:
    """The request's tools: function name -> its definition (name, description, parameters)."""
    out = {}
    for i, tool in enumerate(req.tools or ()):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                           f"{{...}}}}}}", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        out[fn["name"]] = fn
    return out


def called_tools(req) -> list[dict] | None:
    """The tools to show the chat template: those of a request that calls one."""
    if not isinstance(req, ChatCompletionRequest) or tool_mode(req) is None:
        return None
    return [{"type": "function", "function": fn} for fn in tool_functions(req).values()]


EMPTY_OBJECT = {"type": "object", "properties": {}}


def structured_outputs(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """The grammar the request asks for and the field that asked (at most one may)."""
    asked = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError("response_format json_schema needs json_schema.schema, a JSON schema object",
                               "response_format")
            asked.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise APIError(f"response_format type {kind!r} must be one of text, json_object, json_schema",
                           "response_format")
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            asked.append((name, {key: getattr(req, name)}))
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", req.structured_outputs))
    mode = tool_mode(req)
    if mode == "required":  # vLLM's: a list of at least one {name, parameters}, each a tool's
        asked.append(("tool_choice", {"json": {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                              "parameters": fn.get("parameters") or EMPTY_OBJECT},
             "required": ["name", "parameters"]} for name, fn in tool_functions(req).items()]}}}))
    elif mode is not None:
        asked.append(("tool_choice", {"json": tool_functions(req)[mode].get("parameters") or EMPTY_OBJECT}))
    if len(asked) > 1:
        raise APIError(f"{asked[0][0]} and {asked[1][0]} both constrain the output: send one", asked[1][0])
    if not asked:
        return None, None
    param, spec = asked[0]
    try:
        return structured_parse(spec, param), param
    except (TypeError, ValueError) as e:
        raise APIError(str(e).replace("structured_outputs", param, 1), param) from e

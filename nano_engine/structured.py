"""Structured output: a grammar decides which tokens may come next, the sampler picks among them.

A request may ask that its output follow a JSON schema, be any JSON object, match a regular
expression, be one of a few strings, or follow a context-free grammar (EBNF). Each is compiled
once into a grammar over the model's vocabulary (xgrammar: the library vLLM uses by default,
`vllm/v1/structured_output/backend_xgrammar.py`); each request gets a matcher that walks it:

1. before a sampling step, the matcher fills a bitmask of the tokens that keep the output valid
   (one bit per token id; a token whose bytes would leave the grammar is off);
2. the row's logits outside the mask become -inf, before bias, penalties and temperature (vLLM
   applies the bitmask to the logits in the model runner, before its sampler);
3. the sampled token is fed to the matcher, which moves on; once the grammar is complete only a
   stop token (EOS) is allowed, and accepting it ends the request.

A row's mask depends on its own output only, so a request's tokens stay the same in any batch,
and a request without a grammar is untouched. Compiled grammars are cached by the compiler (the
same schema twice compiles once), up to CACHE_LIMIT_BYTES. A grammar is compiled in add_request,
on the engine's thread (vLLM compiles in a thread pool while the request waits): a schema that
takes long to compile holds up the steps for that long.

JSON is generated with xgrammar's standard separators (`any_whitespace=False`). vLLM's default
allows any whitespace between JSON tokens, which a small model tends to fill with newlines until
its token budget runs out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

# The library and the versions this module is written against (installed by scripts/setup.sh).
XGRAMMAR = "xgrammar==0.2.9"
CACHE_LIMIT_BYTES = 256 << 20  # compiled grammars kept per engine


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must follow: exactly one of these (vLLM's StructuredOutputsParams in
    vllm/sampling_params.py). `json` is a JSON schema (a dict or its JSON text); `json_object`
    any JSON object; `regex` a regular expression; `choice` one of these strings; `grammar` an
    EBNF grammar (xgrammar's dialect, root rule `root`)."""
    json: dict | str | None = field(default=None, hash=False)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        kinds = self.kinds
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {kinds or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise TypeError(f"structured_outputs json must be a JSON schema (a dict or its text), got "
                            f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) \
                    or not self.choice:
                raise ValueError(f"structured_outputs choice must be a list of non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise TypeError(f"structured_outputs json_object must be a bool, got {self.json_object!r}")

    @property
    def kinds(self) -> list[str]:
        return [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None] + (
            ["json_object"] if self.json_object else [])

    @property
    def key(self) -> tuple[str, str]:
        """(kind, its text): what compiles to one grammar."""
        kind = self.kinds[0]
        value = getattr(self, kind)
        if kind == "json":
            return kind, value if isinstance(value, str) else json.dumps(value)  # key order is the output's order
        if kind == "choice":
            return kind, json.dumps(list(value))
        return kind, "" if kind == "json_object" else value


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - setup.sh installs it
        raise ValueError(f"structured output needs xgrammar: pip install --no-deps {XGRAMMAR} "
                         f"apache-tvm-ffi (scripts/setup.sh does)") from e
    return xgrammar


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in r".^$*+?{}[]\|()/" else ch for ch in text)


class GrammarCompiler:
    """Compiles StructuredOutputsParams into grammars over one tokenizer's vocabulary (cached)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        # xgrammar keeps compiled grammars (the same schema twice compiles once), within a bound:
        # a server that runs for days sees many schemas.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                             cache_limit_bytes=CACHE_LIMIT_BYTES)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar; a ValueError naming structured_outputs for one that does not compile."""
        kind, text = params.key
        c = self._compiler
        try:
            if kind == "json":
                return c.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":
                return c.compile_builtin_json_grammar()
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "choice":
                return c.compile_regex("(" + "|".join(_regex_escape(s) for s in params.choice) + ")")
            return c.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
            why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip().splitlines()[0])[:300]
            raise ValueError(f"structured_outputs {kind} does not compile: {why}") from e

    def matcher(self, compiled) -> "Matcher":
        return Matcher(_xgrammar().GrammarMatcher(compiled), self.vocab_size)


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        xgr = _xgrammar()
        self._m, self.vocab_size = matcher, vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._fill = matcher.fill_next_token_bitmask

    def allowed(self) -> torch.Tensor:
        """A bool (vocab_size,) tensor: the tokens that may come next."""
        self._fill(self._bitmask, 0)
        bits = self._bitmask[0]  # int32 words, 32 token ids each, lowest id in the lowest bit
        shifts = torch.arange(32, dtype=torch.int32)
        return ((bits[:, None] >> shifts) & 1).bool().flatten()[:self.vocab_size]

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(int(token)))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return bool(self._m.is_terminated())


def apply_grammar(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> torch.Tensor:
    """logits (rows, V) with each grammar row's disallowed tokens at -inf (rows without a matcher as they are)."""
    if not any(m is not None for m in matchers):
        return logits
    logits = logits.clone()
    for row, m in enumerate(matchers):
        if m is not None:
            allowed = m.allowed()
            logits[row, :len(allowed)] = logits[row, :len(allowed)].masked_fill(~allowed, float("-inf"))
    return logits


def parse(value: Any, name: str) -> StructuredOutputsParams:
    """StructuredOutputsParams from a dict with vLLM's keys (json, json_object, regex, choice, grammar)."""
    if isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be an object with one of json, json_object, regex, choice, grammar")
    unknown = sorted(set(value) - {"json", "json_object", "regex", "choice", "grammar"})
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}: use one of json, json_object, regex, choice, grammar")
    return StructuredOutputsParams(**value)

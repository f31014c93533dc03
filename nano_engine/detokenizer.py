"""Incremental detokenization with stop strings: turning a growing list of token ids into text
that can be streamed to a client one piece at a time.

Why this is harder than ``tokenizer.decode(ids)`` after every step:

1. A token is not a piece of text. SmolLM2's tokenizer is byte-level BPE: a token stands for some
   bytes, and one character can be split over several tokens ("你" is two tokens, an emoji with a
   skin tone four or more). Decoding the tokens seen so far can end in half a character, which
   UTF-8 decoding shows as "\\ufffd". Send that and the client has a wrong character it can never
   take back. So we keep two offsets into the ids, as vLLM's slow path does: the text of the ids
   before ``read_offset`` is final; the ids after it are decoded together with a little context
   before them (from ``prefix_offset``, so tokenizers that look at neighbours decode the same
   way), and the offsets move on only when that text does not end in "\\ufffd". Until then only
   its last character is in doubt (UTF-8 resynchronises at once), so the rest counts as final.
   A "\\ufffd" in the middle is a real invalid sequence (or a real U+FFFD) and is kept, exactly as
   ``tokenizer.decode`` keeps it; one still pending when the request finishes is handed out then,
   again like decode (but, being in doubt, it never completes a stop string).
2. Stop strings are text, not tokens. "###" may be one token, or end inside a token, or span
   three. After each update we look for a stop string only where a new one can be: in the new
   text plus the ``len(stop) - 1`` characters before it (a long answer is never re-scanned). The
   output is cut at the start of the stop string, or after it with
   ``include_stop_str_in_output``. If one update brings text in which several stop strings
   complete, the one that completes first wins (ties: the one that starts first), so the result
   is what one token (one character) at a time would give, however the tokens were batched.
3. Streaming must never send text that a stop string later removes. While running we hold back
   the longest tail of the text that is still the beginning of some stop string: at most
   ``len(longest stop) - 1`` characters, vLLM's ``stop_buffer_length``. vLLM always holds that
   many; we hold only what could still become a stop, so "abX" with stop "abc" goes out as soon
   as the "X" shows it is not one. With ``include_stop_str_in_output`` nothing is held: text sent
   before a stop stays in the output anyway.

Mirrors vLLM's ``vllm/v1/engine/detokenizer.py`` (``BaseIncrementalDetokenizer.update``,
``get_next_output_text``, ``check_stop_strings``; the fast path there uses tokenizers'
``DecodeStream``, the same idea in Rust) and ``vllm/transformers_utils/detokenizer_utils.py``
(``detokenize_incrementally``: the prefix/read offsets, from Hugging Face's TGI). vLLM's
``SamplingParams`` validates ``stop`` the way `check_stop` does.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"  # what UTF-8 decoding shows for an incomplete or invalid sequence


def check_stop(stop) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings. A bare str is one stop string (as in OpenAI's
    API); None means none. Raises TypeError/ValueError naming ``stop`` for anything else."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if isinstance(stop, (bytes, bytearray)) or not isinstance(stop, Sequence):
        raise TypeError(f"stop={stop!r} must be a string or a list of strings, "
                        f"got {type(stop).__name__}")
    for s in stop:
        if not isinstance(s, str):
            raise TypeError(f"stop={stop!r} must be a string or a list of strings; "
                            f"{s!r} is a {type(s).__name__}")
        if not s:
            # "" would match at once, before any text: never what a caller means.
            raise ValueError(f"stop={stop!r} must not contain an empty string")
    return tuple(stop)


def find_stop(text: str, new_chars: int, stop: Sequence[str]) -> tuple[str, int] | None:
    """The stop string that completes first in ``text`` whose last ``new_chars`` characters are
    new (none completed before them), and where it starts; None if none does."""
    best = None  # (end, start, stop string)
    for s in stop:
        # A new match ends inside the new text, so it starts at most len(s) - 1 characters
        # before it: search no further back than that.
        start = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if start != -1 and (best is None or (start + len(s), start) < best[:2]):
            best = (start + len(s), start, s)
    return None if best is None else (best[2], best[1])


class IncrementalDetokenizer:
    """The text of one request's output tokens, built up as they are sampled.

    ``update(ids)`` after each engine step, ``take_delta(finished)`` for the text to stream.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True, min_tokens: int = 0):
        """`stop`, `include_stop_str_in_output` and `min_tokens` as SamplingParams has checked them. As in
        vLLM, no stop string is looked for in the text of the first `min_tokens` tokens: one may end
        there and reach past it, but not lie wholly inside it."""
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset]: context for decoding the rest
        self.read_offset = 0  # the text of the ids before it is in _text
        self._text = ""  # text of ids[:read_offset], cut at a stop string
        self._tail = ""  # text of the pending ids after read_offset: "" or ends in "\ufffd"
        self._sent = 0  # characters of output_text already handed out by take_delta
        self.stop_reason: str | None = None  # the stop string that ended the output

    def _decode(self, ids: Sequence[int]) -> str:
        # No space clean-up: it looks at neighbouring tokens, so pieces would not add up.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_next(self) -> None:
        """Decode the pending ids (the newest one included) and commit them if their text ends
        in a whole character; else keep it as the tail."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset:])
        if len(text) <= len(prefix_text):
            return  # no text yet: a skipped special token
        new_text = text[len(prefix_text):]
        if new_text.endswith(REPLACEMENT_CHAR):
            # Maybe half a character: wait for the next token. Only that last "\ufffd" can
            # still change; what comes before it is final (UTF-8 resynchronises at once).
            self._tail = new_text
            return
        self._text += new_text
        self._tail = ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)

    @property
    def _whole_text(self) -> str:
        """The text known to be final: all of it but a trailing incomplete character."""
        return self._text + self._tail[:-1]

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Add newly sampled tokens. Returns the stop string that matched (output_text is then cut
        there and further update() calls raise), else None."""
        if self.stop_reason is not None:
            raise RuntimeError(f"update() after the stop string {self.stop_reason!r} ended "
                               "the output")
        before = len(self._whole_text)
        for token_id in new_token_ids:
            # One id at a time, so that "\ufffd" is only ever judged at the end of the text.
            self.token_ids.append(int(token_id))
            self._decode_next()
            if len(self.token_ids) <= self.min_tokens:
                before = len(self._whole_text)  # min_tokens: this token's text is no place for a stop
        text = self._whole_text
        if not self.stop or len(text) == before:
            return None
        match = find_stop(text, len(text) - before, self.stop)
        if match is None:
            return None
        self.stop_reason, start = match
        end = start + len(self.stop_reason) if self.include_stop_str_in_output else start
        self._text, self._tail = text[:end], ""
        return self.stop_reason

    @property
    def output_text(self) -> str:
        """All text so far, cut at a stop string; equal to tokenizer.decode of all the ids when
        no stop string matched (a trailing incomplete character shows as "\ufffd", as there)."""
        return self._text + self._tail

    def _held_back(self) -> int:
        """How many trailing characters of the committed text may still begin a stop string."""
        if self.include_stop_str_in_output:
            return 0
        held, text = 0, self._whole_text
        for s in self.stop:
            # Longest proper prefix of s that the text ends with; a full s was cut already.
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet. While not finished, hold back an incomplete UTF-8 character and
        a tail that may still begin a stop string (at most len(longest stop)-1 characters); when
        finished (or stopped), hand out everything."""
        if finished or self.stop_reason is not None:
            end = len(self.output_text)
        else:
            end = len(self._whole_text) - self._held_back()
        if end <= self._sent:
            return ""
        delta, self._sent = self.output_text[self._sent:end], end
        return delta

"""Incremental detokenization and stop strings (nano_engine/detokenizer.py) on the embedded model's
real tokenizer (SmolLM2, byte-level BPE): streamed text joined equals the non-streamed text, no
delta carries half a character, and stop strings cut the text the same way however the tokens
arrive."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nano_engine.detokenizer import IncrementalDetokenizer, find_stop
from nano_engine.models.loading import load_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "家族: 👨‍👩‍👧‍👦 👍🏽 👋🏿 🏳️‍🌈 🇫🇷 and 🧑🏻‍💻 at work",
    "Ça coûte 5 €, naïve façade, Ångström, e\u0301 (combining), ß ẞ",
    "Mixed: English, 日本語のテキスト, 한국어, русский, العربية, עברית, हिन्दी",
    "def f(x):\n\tif x:\r\n        return  x ** 2   # odd   spacing\n\n\n    \u00a0\u2003",
    "replacement \ufffd in the text \ufffd\ufffd and at the end \ufffd",
    "\ufffd",
    "   leading and trailing spaces   ",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def byte_token(tok, b: int) -> int:
    """The id of the byte-level token standing for the single byte ``b`` (GPT-2's byte table)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {c: chr(c) for c in printable}
    others = (c for c in range(256) if c not in printable)
    chars.update({c: chr(256 + n) for n, c in enumerate(others)})
    return tok.convert_tokens_to_ids(chars[b])


def chunked(ids, rng):
    """``ids`` cut into random consecutive chunks (some of them empty)."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(0, 4)
        out.append(ids[i:i + n])
        i += n
    return out


def stream(tok, chunks, **kwargs):
    """Feed the chunks one update at a time, taking a delta after each; returns (detokenizer,
    deltas, stop string). Checks on the way that nothing ever comes after a stop."""
    d = IncrementalDetokenizer(tok, **kwargs)
    deltas, reason = [], None
    for chunk in chunks:
        if reason is not None:
            with pytest.raises(RuntimeError, match="stop string"):
                d.update(chunk)
            assert d.take_delta(finished=False) == ""
            continue
        reason = d.update(chunk)
        deltas.append(d.take_delta(finished=False))
    deltas.append(d.take_delta(finished=True))
    assert d.take_delta(finished=True) == ""
    return d, deltas, reason


def check_deltas(deltas, final):
    """Every delta is whole text: each running join is a prefix of the final text (so a "\\ufffd"
    in it is one the final text has there too, never half a character sent early)."""
    sent = ""
    for delta in deltas:
        assert delta.encode("utf-8").decode("utf-8") == delta
        sent += delta
        assert final.startswith(sent), (sent, final)
    assert sent == final


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_decode(tok, text, skip_special_tokens):
    """Special tokens are skipped by default, as in vLLM."""
    ids = tok.encode(text) + [tok.eos_token_id]  # the EOS the engine passes on too
    final = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ("<|im_end|>" in final) is not skip_special_tokens
    rng = random.Random(text)
    kwargs = {} if skip_special_tokens else {"skip_special_tokens": False}
    for chunks in [[[i] for i in ids], [ids], *(chunked(ids, rng) for _ in range(5))]:
        d, deltas, reason = stream(tok, chunks, **kwargs)
        assert reason is None
        assert d.output_text == final
        check_deltas(deltas, final)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 49151), st.integers(100, 400)), max_size=24),
       seed=st.integers(0, 2**16))
def test_any_ids_stream_like_decode(tok, ids, seed):
    """Random ids, many of them lone bytes that make invalid or unfinished UTF-8."""
    final = tok.decode(ids, skip_special_tokens=True)
    d, deltas, _ = stream(tok, chunked(ids, random.Random(seed)))
    assert d.output_text == final
    check_deltas(deltas, final)


def test_incomplete_character_is_held_until_finished(tok):
    lead = byte_token(tok, 0xE4)  # the first of the three bytes of "你" (E4 BD A0)
    ids = tok.encode("ok") + [lead]
    d = IncrementalDetokenizer(tok)
    d.update(ids)
    assert d.take_delta(finished=False) == "ok"  # not "ok\ufffd": the character may still come
    assert d.take_delta(finished=True) == "\ufffd" == tok.decode([lead])
    assert d.output_text == tok.decode(ids) == "ok\ufffd"  # completed, it is sent whole: test_streamed_text_equals_decode


def test_text_before_a_pending_character_is_final(tok):
    """One token can hold a whole character and the start of the next (" " + half an emoji):
    the whole one is sent and checked against the stop strings at once."""
    space_half_emoji = tok.convert_tokens_to_ids("ĠðŁ")
    d = IncrementalDetokenizer(tok)
    d.update(tok.encode("ok") + [space_half_emoji])
    assert d.take_delta(finished=False) == "ok "
    d = IncrementalDetokenizer(tok, stop=[" "])
    assert d.update(tok.encode("ok") + [space_half_emoji]) == " "
    assert d.output_text == "ok"


def expected_cut(text, stop, include):
    """The stop that one character at a time would meet first (ties: the one starting first).
    A "\\ufffd" at the very end may be half a character until the next token: no stop uses it."""
    whole = text[:-1] if text.endswith("\ufffd") else text
    hits = [(whole.find(s) + len(s), whole.find(s), s) for s in stop if s in whole]
    if not hits:
        return text, None
    end, start, s = min(hits)
    return text[:end if include else start], s


CASES = [  # (text, stop, stop string that matches)
    ("Hello world, how are you?", ["wor"], "wor"),  # inside the one token " world"
    ("The answer is 42. ### End of answer", ["###"], "###"),
    ("说你好吗？我很好。", ["很好"], "很好"),  # spans tokens
    ("Hello there", ["Hel"], "Hel"),  # at the very first token
    ("one two three four", ["three", "two"], "two"),  # earliest in the text, not first listed
    ("xabcdx", ["abcd", "bc"], "bc"),  # "bc" completes first, even when "abcd" arrives at once
    ("emoji 👍🏽 stop", ["🏽"], "🏽"),  # a stop made of half an emoji's tokens
    ("no stop here", ["zzz", "heree"], None),
]


@pytest.mark.parametrize("text, stop, matched", CASES)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(tok, text, stop, matched, include):
    ids = tok.encode(text)
    want_text, want_stop = expected_cut(text, stop, include)
    assert want_stop == matched
    rng = random.Random(text)
    for chunks in [[[i] for i in ids], [ids], *(chunked(ids, rng) for _ in range(5))]:
        d, deltas, reason = stream(tok, chunks, stop=stop, include_stop_str_in_output=include)
        assert (reason, d.output_text) == (matched, want_text)
        check_deltas(deltas, want_text)


@settings(max_examples=150, deadline=None)
@given(text=st.sampled_from(TEXTS), data=st.data(), include=st.booleans(),
       seed=st.integers(0, 2**16))
def test_stop_strings_any_chunking(tok, text, data, include, seed):
    """Stops cut from the text itself (or not in it), in any chunking: the result is the
    one-character-at-a-time one, and while running at most len(longest stop) - 1 characters
    of whole text are held back."""
    piece = st.integers(0, len(text)).flatmap(lambda i: st.integers(i + 1, i + 6).map(
        lambda j: text[i:j]))
    stop = data.draw(st.lists(st.one_of(piece, st.text(min_size=1, max_size=3)), min_size=1,
                              max_size=3).filter(lambda s: all(s)))
    ids = tok.encode(text)
    want_text, want_stop = expected_cut(text, stop, include)
    d = IncrementalDetokenizer(tok, stop=stop, include_stop_str_in_output=include)
    sent, seen, reason = "", [], None
    for chunk in chunked(ids, random.Random(seed)):
        seen += chunk
        reason = d.update(chunk)
        sent += d.take_delta(finished=False)
        if reason is not None:
            break
        so_far = tok.decode(seen)
        if not so_far.endswith("\ufffd"):
            assert len(sent) >= len(so_far) - (0 if include else max(map(len, stop)) - 1)
    sent += d.take_delta(finished=True)
    assert (reason, d.output_text, sent) == (want_stop, want_text, want_text)


def test_no_stop_string_is_looked_for_within_min_tokens(tok):
    """vLLM's rule: the text of the first min_tokens tokens is no place for a stop string (EOS and
    stop_token_ids are masked there too); a stop that ends after them counts, even if it began inside."""
    ids = [tok.encode(t)[0] for t in ["a", ",", "b", ",", "c"]]
    for min_tokens, stop, want in ((0, [","], "a"), (2, [","], "a,b"), (3, [","], "a,b"), (4, [","], "a,b,c"),
                                   (3, [",c"], "a,b"), (4, ["b,c"], "a,"), (5, ["a"], "a,b,c")):
        for chunks in ([[i] for i in ids], [ids]):
            d, deltas, reason = stream(tok, chunks, stop=stop, min_tokens=min_tokens)
            assert d.output_text == want and (reason is None) == (want == "a,b,c"), (min_tokens, stop, chunks)
            check_deltas(deltas, want)


def test_partial_stop_then_divergence_is_sent_at_once(tok):
    a, b, x = (tok.convert_tokens_to_ids(c) for c in "abX")
    d = IncrementalDetokenizer(tok, stop=["abc"])
    assert d.update([a]) is None and d.take_delta(finished=False) == ""  # may become "abc"
    assert d.update([b]) is None and d.take_delta(finished=False) == ""
    assert d.update([x]) is None and d.take_delta(finished=False) == "abX"  # cannot any more
    d = IncrementalDetokenizer(tok, stop=["abc"])
    assert [d.update([i]) for i in (a, b, tok.convert_tokens_to_ids("c"))] == [None, None, "abc"]
    assert d.take_delta(finished=False) == "" and d.output_text == ""


class Text(str):
    """A str that records where each find() starts."""

    def find(self, sub, start=None, *args):
        self.starts.append(start)
        return str.find(self, sub, start, *args)


def test_find_stop_never_scans_a_long_answer_again():
    # The new text is the last 2 characters: a match of "abc" ending in it starts at 10 - 2 - 3 + 1
    # at the earliest, so nothing before that is read again.
    text = Text("0123456789")
    text.starts = []
    assert find_stop(text, 2, ["abc", "z"]) is None
    assert text.starts and min(text.starts) >= 10 - 2 - 3 + 1

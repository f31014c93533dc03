"""Stop strings in SamplingParams (vLLM's `stop`, `include_stop_str_in_output`), honoured by the
LLMEngine itself: the request finishes in the step whose token completes the string, its text is
cut there, `stop_reason` names the string, and nothing else about the run changes (the tokens
before the stop, the other requests of the batch, the blocks)."""

import pytest

from nano_engine import LLMEngine, SamplingParams
from nano_engine.models.loading import load_tokenizer
from nano_engine.tiny import tiny_model

# Ids up to 600 of SmolLM2's tokenizer: byte tokens and common merges (" the", "in", ...), so
# the text of a random model's output has multi-character tokens and strings spanning tokens.
MODEL = tiny_model(seed=3, vocab_size=600, num_layers=1, eos_token_id=2)
PROMPTS = [[17, 300, 301, 45], [120, 121, 122], [400, 33, 250, 251, 252, 90]]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def text_of(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def unstopped(tok, prompt, **kw):
    req = LLMEngine(MODEL, tok, num_blocks=64, block_size=4).generate(
        [prompt], SamplingParams(max_tokens=40, ignore_eos=True, **kw))[0]
    return req.output_ids, text_of(tok, req.output_ids)


def first_token_completing(tok, ids, stop):
    """How many output tokens it takes until `stop` appears in their text."""
    for n in range(1, len(ids) + 1):
        if stop in text_of(tok, ids[:n]):
            return n
    raise AssertionError(f"{stop!r} is not in the output")


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "drafts"])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_its_request_where_its_text_completes_and_nothing_else_changes(tok, include, spec):
    """Also with speculative decoding: a stop completed by an accepted draft ends the output there, and
    the drafts after it are dropped."""
    alone = [unstopped(tok, p) for p in PROMPTS]
    ids, text = alone[1]
    stop = text[len(text) // 2:len(text) // 2 + 3]  # from the middle: it spans a token boundary when there is one
    assert stop.strip(), "the test needs a visible stop string"
    n, start = first_token_completing(tok, ids, stop), text.find(stop)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, **kw) for kw in (
        {}, {"stop": stop, "include_stop_str_in_output": include},  # a bare str is one stop string
        {"stop": ["\x00never"], "include_stop_str_in_output": include})]
    assert params[1].stop == (stop,)
    eng = LLMEngine(MODEL, tok, num_blocks=64, block_size=4, max_num_batched_tokens=5, speculative_config=spec)
    out = eng.generate(PROMPTS, params)
    if spec is not None:
        assert eng.stats.spec_num_accepted_tokens > 0
    # the tokens before the stop are those of the run without stops, and the other requests' are theirs
    assert [r.output_ids for r in out] == [alone[0][0], ids[:n], alone[2][0]]
    assert [(r.finish_reason, r.stop_reason) for r in out] == [("length", None), ("stop", stop), ("length", None)]
    assert out[1].output_text == (text[:start + len(stop)] if include else text[:start])
    assert out[2].output_text == alone[2][1]  # a stop string never seen leaves the text whole
    assert out[0].output_text is None  # only requests with stop strings carry text
    assert eng.block_pool.num_free == 64 and not eng.requests


def test_a_stop_string_inside_the_first_min_tokens_does_not_end_the_request(tok):
    """min_tokens holds back stop strings as it holds back EOS and stop_token_ids (vLLM's rule): the text of
    the first min_tokens tokens is not searched."""
    ids, text = unstopped(tok, PROMPTS[1])
    stop = text[len(text) // 2:len(text) // 2 + 3]
    n = first_token_completing(tok, ids, stop)
    eng = LLMEngine(MODEL, tok, num_blocks=64, block_size=4)
    req = eng.generate([PROMPTS[1]], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop], min_tokens=n))[0]
    assert req.output_ids == ids[:len(req.output_ids)] and len(req.output_ids) > n  # it ran past the stop


def test_stop_token_ids_and_eos_give_vllms_stop_reason(tok):
    ids, _ = unstopped(tok, PROMPTS[2])
    stop_id = ids[6]
    first = ids.index(stop_id)
    eng = LLMEngine(MODEL, tok, num_blocks=64, block_size=4)
    req = eng.generate([PROMPTS[2]], SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert req.output_ids == ids[:first + 1] and req.finish_reason == "stop" and req.stop_reason == stop_id
    eos = tiny_model(seed=3, vocab_size=600, num_layers=1, eos_token_id=ids[4])
    req = LLMEngine(eos, tok, num_blocks=64, block_size=4).generate([PROMPTS[2]], SamplingParams(max_tokens=40))[0]
    assert req.output_ids[-1] == ids[4] and req.finish_reason == "stop" and req.stop_reason is None


def test_stop_strings_without_a_tokenizer_are_refused_before_anything_changes():
    eng = LLMEngine(MODEL, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match=r"stop=\['ab'\] needs a tokenizer"):
        eng.add_request([1, 2, 3], SamplingParams(stop=["ab"]))
    assert not eng.requests and eng.block_pool.num_free == 16
    assert eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0].output_ids  # the engine serves on


@pytest.mark.parametrize("bad, error", [("", ValueError), (["a", ""], ValueError), ([1], TypeError),
                                        (b"ab", TypeError), ({"a"}, TypeError)])
def test_bad_stop_strings_are_refused_by_name(bad, error):
    with pytest.raises(error, match="^stop="):
        SamplingParams(stop=bad)


def test_stop_in_sampling_params_is_a_tuple_of_strings():
    assert SamplingParams(stop=None).stop == () and SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop=("a",)))
    with pytest.raises(TypeError, match="include_stop_str_in_output=1"):
        SamplingParams(stop="a", include_stop_str_in_output=1)


def test_the_async_engine_streams_the_engines_text_once_and_its_stop_reason(tok):
    """AsyncLLM reads a stop-string request's text from the engine's detokenizer: the streamed
    deltas join to the engine's cut text, and the last output says which string stopped it."""
    import asyncio

    from nano_engine.serving.async_llm import AsyncLLM

    _, text = unstopped(tok, PROMPTS[0])
    stop = text[len(text) // 2:len(text) // 2 + 2]
    llm = AsyncLLM(LLMEngine(MODEL, tok, num_blocks=64, block_size=4))

    async def main():
        sp = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])
        return [o async for o in llm.generate(PROMPTS[0], sp)]

    try:
        outs = asyncio.run(asyncio.wait_for(main(), timeout=60))
    finally:
        llm.shutdown()
    assert "".join(o.new_text for o in outs) == text[:text.find(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert not llm.engine.requests and llm.engine.block_pool.num_free == 64


def test_a_stop_string_inside_the_accepted_drafts_ends_the_output_there(tok):
    """The embedded model copying a text: each step keeps several drafts, and the stop string completes
    in the middle of them. The output ends where it ends without drafts; the drafts after it are dropped."""
    from nano_engine.models.loading import chat_prompt_ids

    engine = LLMEngine.from_pretrained(speculative_config=SPEC)
    plain = LLMEngine(engine.model, engine.tokenizer)
    text = "The old lighthouse keeper climbed the stairs every night, lit the lamp and wound the clock."
    prompt = chat_prompt_ids(engine.tokenizer, f"Repeat this text exactly: {text}")
    last_steps = []
    for stop in ("stairs every", "the lamp", "wound"):
        params = SamplingParams(max_tokens=40, stop=stop)
        want, got = plain.generate([prompt], params)[0], engine.generate([prompt], params)[0]
        assert (got.output_ids, got.output_text, got.stop_reason) == (want.output_ids, want.output_text, stop)
        last_steps.append(got.token_times.count(got.token_times[-1]))  # tokens its last step added
    assert max(last_steps) > 1  # a stop completed after kept drafts, in the middle of a step's tokens
    assert engine.block_pool.num_free == engine.block_pool.num_blocks

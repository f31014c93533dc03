"""Bad input gets a TypeError or ValueError naming the field, the value and what is allowed, raised
before anything changes; a step that raises leaves the engine usable."""

import math
import sys

import numpy as np
import pytest
import torch

from nano_engine import EngineConfig, LLMEngine, SamplingParams, checks, sampling
from nano_engine.request import SEED_MAX, SEED_MIN
from nano_engine.tiny import tiny_model
from helpers import whole


# ----- SamplingParams -----
@pytest.mark.parametrize("kw, error, match", [
    (dict(max_tokens=0), ValueError, r"max_tokens=0 must be an integer >= 1"),
    (dict(max_tokens=True), TypeError, r"max_tokens=True must be an integer, not a bool"),
    (dict(max_tokens=2.0), TypeError, r"max_tokens=2.0 must be an integer"),
    (dict(temperature=-0.5), ValueError, r"temperature=-0.5 must be a number >= 0"),
    (dict(temperature=float("nan")), ValueError, r"temperature=nan must be a finite number"),
    (dict(temperature=float("inf")), ValueError, r"temperature=inf must be a finite number"),
    (dict(temperature=True), TypeError, r"temperature=True must be a real number, got a bool"),
    (dict(temperature="0.7"), TypeError, r"temperature='0.7' must be a real number, got str"),
    (dict(top_p=0.0), ValueError, r"top_p=0.0 must be a number in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, r"top_p=1.5 must be a number in \(0, 1\]"),
    (dict(top_k=-1), ValueError, r"top_k=-1 must be an integer >= 0"),
    (dict(top_k=None), TypeError, r"top_k=None must be an integer"),
    (dict(seed=1.5), TypeError, r"seed=1.5 must be an integer"),
    (dict(seed=True), TypeError, r"seed=True must be an integer, not a bool"),
    (dict(seed=SEED_MAX + 1), ValueError,
     rf"seed={SEED_MAX + 1} must be an integer in \[{SEED_MIN}, {SEED_MAX}\]"),
    (dict(seed=SEED_MIN - 1), ValueError, r"seed=.* must be an integer in"),
    (dict(stop_token_ids=5), TypeError, r"stop_token_ids must be a sequence of token ids"),
    (dict(stop_token_ids=[1.7]), TypeError, r"stop_token_ids\[0\]=1.7 must be an integer"),
    (dict(stop_token_ids=["a"]), TypeError, r"stop_token_ids\[0\]='a' must be an integer"),
    (dict(stop_token_ids=[3, -1]), ValueError, r"stop_token_ids\[1\]=-1 must be >= 0"),
    (dict(ignore_eos="no"), TypeError, r"ignore_eos='no' must be True or False"),
    (dict(ignore_eos=1), TypeError, r"ignore_eos=1 must be True or False"),
])
def test_bad_sampling_params(kw, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kw)


def test_numpy_and_torch_scalars_are_fine_and_normalized():
    sp = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), top_k=torch.tensor(2),
                        seed=np.uint64(SEED_MAX), stop_token_ids=np.array([4, 5]), ignore_eos=np.bool_(True))
    assert sp == SamplingParams(max_tokens=3, temperature=0.5, top_k=2, seed=SEED_MAX, stop_token_ids=(4, 5),
                                ignore_eos=True)
    assert type(sp.max_tokens) is int and type(sp.temperature) is float and type(sp.stop_token_ids[0]) is int
    # The whole seed range is one torch.Generator takes.
    for seed in (SEED_MIN, SEED_MAX):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)


def test_tiny_temperature_and_top_p_are_numerically_safe(tiny):
    """Below vLLM's _SAMPLING_EPS a temperature is greedy; a top_p that rounds to 0 keeps the top token."""
    prompts = [[5, 6, 7], [9, 1]]
    greedy = [r.output_ids for r in LLMEngine(tiny).generate(prompts, SamplingParams(max_tokens=6))]
    for sp in [SamplingParams(max_tokens=6, temperature=1e-9), SamplingParams(max_tokens=6, temperature=1e-300),
               SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-300, seed=0),
               SamplingParams(max_tokens=6, temperature=1e-5, top_p=5e-324, seed=0)]:
        assert [r.output_ids for r in LLMEngine(tiny).generate(prompts, sp)] == greedy, sp


# ----- EngineConfig and LLMEngine(...) -----
@pytest.mark.parametrize("kw, error, match", [
    (dict(num_blocks=0), ValueError, r"num_blocks=0"),
    (dict(num_blocks=True), TypeError, r"num_blocks=True"),
    (dict(num_blocks=2.5), TypeError, r"num_blocks=2.5"),
    (dict(block_size=-4), ValueError, r"block_size=-4"),
    (dict(block_size="16"), TypeError, r"block_size='16'"),
    (dict(enable_prefix_caching="no"), TypeError, r"enable_prefix_caching='no'"),
    (dict(enable_prefix_caching=0), TypeError, r"enable_prefix_caching=0"),
    (dict(step_log_size=-1), ValueError, rf"step_log_size=-1"),
    (dict(step_log_size=1e4), TypeError, r"step_log_size=10000.0"),
    (dict(step_log_size=2**63), ValueError,  # a deque's maxlen is a C ssize_t
     rf"step_log_size={2**63}"),
])
def test_bad_engine_settings(tiny, kw, error, match):
    with pytest.raises(error, match=match):
        EngineConfig.from_settings(**kw)
    with pytest.raises(error, match=match):
        LLMEngine(tiny, **kw)


def test_engine_config_accepts_numpy_integers(tiny):
    cfg = EngineConfig.from_settings(num_blocks=np.int32(8), block_size=np.int64(4), step_log_size=np.uint8(3))
    cache = cfg.cache_config
    assert (cache.num_blocks, cache.block_size, cfg.step_log_size) == (8, 4, 3) and type(cache.num_blocks) is int
    assert LLMEngine(tiny, config=cfg).step_log.maxlen == 3


def test_bad_engine_arguments(tiny):
    """Each refusal names the argument and says what to pass instead."""
    cases = [
        (lambda: LLMEngine(tiny, config={"num_blocks": 8}), TypeError, "config must be an EngineConfig"),
        (lambda: LLMEngine(None), TypeError, "model must be a nano_engine Transformer"),
        (lambda: LLMEngine("HuggingFaceTB/SmolLM2-135M"), TypeError, "model must be a nano_engine Transformer"),
        (lambda: LLMEngine(tiny, EngineConfig()), TypeError, "the second argument is the tokenizer"),
        (lambda: LLMEngine(tiny, {"num_blocks": 8}), TypeError, "the second argument is the tokenizer"),
        (lambda: LLMEngine(tiny, num_block=8), TypeError, r"unknown engine settings \['num_block'\]; allowed: .*num_blocks"),
        (lambda: LLMEngine(tiny, config=EngineConfig(), num_blocks=8), ValueError, "either config or keyword settings"),
        (lambda: LLMEngine(tiny, scheduler_cls="fcfs"), TypeError, "scheduler_cls must be a class"),
        (lambda: LLMEngine(tiny, block_pool_cls=object()), TypeError, "block_pool_cls must be a class"),
        (lambda: EngineConfig(scheduler_config={"max_num_seqs": 2}), TypeError, "scheduler_config must be a SchedulerConfig"),
        (lambda: EngineConfig(attention_backend="cuda"), ValueError, "attention_backend='cuda'"),
        (lambda: LLMEngine(tiny, policy="static", enable_chunked_prefill=True), ValueError,
         "enable_chunked_prefill=True .*policy='static'"),
    ]
    for make, error, match in cases:
        with pytest.raises(error, match=match):
            make()


def test_kv_pool_larger_than_memory_is_refused_before_allocating(tiny, monkeypatch):
    with pytest.raises(ValueError, match=r"KV cache of num_blocks=1000000000 x block_size=16 .* "
                                         r"needs 8,192,000,000,000 bytes "
                                         r"\(7629.39 GiB\), more than 90% of the [0-9,]+ bytes .* available"):
        LLMEngine(tiny, num_blocks=10**9)  # would be 8 TB: refused at once, nothing allocated
    cfg = tiny.config  # float64, 2 layers, 2 KV heads of 8: 2 * 2 * 16 * 4 * 2 * 8 * 8 bytes
    need = 2 * cfg.num_hidden_layers * 16 * 4 * cfg.num_key_value_heads * cfg.head_dim * 8
    assert LLMEngine(tiny, num_blocks=16, block_size=4).runner.kv_cache.nbytes == need
    monkeypatch.setattr(checks, "memory_available", lambda: math.ceil(need / 0.9))
    LLMEngine(tiny, num_blocks=16, block_size=4)  # exactly at the limit: fine
    monkeypatch.setattr(checks, "memory_available", lambda: need)
    with pytest.raises(ValueError, match=rf"needs {need:,} bytes .* more than 90% of the {need:,} bytes"):
        LLMEngine(tiny, num_blocks=16, block_size=4)


# ----- add_request -----
def test_bad_prompts_are_refused(tiny):
    engine = LLMEngine(tiny, num_blocks=4, block_size=4, max_num_batched_tokens=8)
    for bad, error, match in [
        ([], ValueError, "prompt_ids is empty"),
        ([1, 64], ValueError, r"prompt_ids\[1\]=64 is outside the vocabulary \[0, 64\)"),
        ([-1], ValueError, r"prompt_ids\[0\]=-1 is outside the vocabulary"),
        ([1, 1.7], TypeError, r"prompt_ids\[1\]=1.7 must be an integer, got float"),
        ([1, True], TypeError, r"prompt_ids\[1\]=True must be an integer, not a bool"),
        (None, TypeError, r"prompt_ids must be a sequence of token ids .* got NoneType"),
        (5, TypeError, r"prompt_ids must be a sequence of token ids .* got int"),
        ("hello", TypeError, r"prompt_ids must be a sequence of token ids .* got str"),
        (torch.tensor(5), TypeError, r"prompt_ids must be a 1-D integer tensor .* shape \(\)"),
        (torch.tensor([1.0, 2.0]), TypeError, r"prompt_ids must be a 1-D integer tensor .* torch.float32"),
        (torch.tensor([[1, 2], [3, 4]]), TypeError,
         r"prompt_ids must be a 1-D integer tensor or array, got shape \(2, 2\)"),
        (np.array([1.5, 2.0]), TypeError,
         r"prompt_ids must be a 1-D integer tensor or array, got shape \(2,\) and dtype float64"),
    ]:
        with pytest.raises(error, match=match):
            engine.add_request(bad)
    with pytest.raises(ValueError, match=r"can never fit: prompt 10 \+ max_tokens 8 needs 5 blocks "
                                         r"of 4 tokens, the pool has 4"):
        engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=8))
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or None, got dict"):
        engine.add_request([1], {"max_tokens": 3})
    assert not engine.requests and not engine.has_unfinished() and not engine.step_log


def test_every_prompt_form_gives_the_same_tokens(tiny):
    forms = [[3, 4, 5], (3, 4, 5), [np.int64(3), 4, torch.tensor(5)], np.array([3, 4, 5], dtype=np.int32),
             torch.tensor([3, 4, 5]), torch.tensor([3, 4, 5], dtype=torch.int16), range(3, 6)]
    outs = LLMEngine(tiny).generate(forms, SamplingParams(max_tokens=4))
    assert all(r.prompt_ids == [3, 4, 5] and type(r.prompt_ids[0]) is int for r in outs)
    assert len({tuple(r.output_ids) for r in outs}) == 1
    batch = LLMEngine(tiny).generate(torch.tensor([[3, 4, 5], [3, 4, 5]]), SamplingParams(max_tokens=4))
    assert [r.output_ids for r in batch] == [outs[0].output_ids] * 2


def test_bad_priority_and_arrival_time(tiny):
    engine = LLMEngine(tiny, policy="priority")
    for kw, error, match in [
        (dict(priority="high"), TypeError, r"priority='high' must be an integer, got str"),
        (dict(priority=1.5), TypeError, r"priority=1.5 must be an integer"),
        (dict(priority=None), TypeError, r"priority=None must be an integer"),
        (dict(arrival_time="x"), TypeError, r"arrival_time='x' must be a real number, got str"),
        (dict(arrival_time=float("nan")), ValueError, r"arrival_time=nan must be a finite number"),
        (dict(arrival_time=True), TypeError, r"arrival_time=True must be a real number, got a bool"),
    ]:
        with pytest.raises(error, match=match):
            engine.add_request([1, 2], **kw)
    assert not engine.requests
    a = engine.add_request([1, 2], SamplingParams(max_tokens=2), priority=np.int8(-1), arrival_time=np.float32(2.5))
    assert engine.requests[a].priority == -1 and engine.requests[a].arrival_time == 2.5
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[a].finish_reason == "length"


def test_request_ids(tiny):
    engine = LLMEngine(tiny)
    p, sp = [5, 6], SamplingParams(max_tokens=2)
    assert engine.add_request(p, sp, request_id="1") == "1"
    # Automatic ids skip the ones the caller chose.
    done = engine.generate([p, p, p], sp)
    assert [r.request_id for r in done] == ["0", "2", "3"]
    assert engine.add_request(p, sp) == "4"
    # Request ids are strings, as in vLLM: an int is refused everywhere, not silently converted.
    with pytest.raises(TypeError, match=r"request_id=5 must be a str .* got int"):
        engine.add_request(p, sp, request_id=5)
    with pytest.raises(TypeError, match=r"request_id=5 must be a str"):
        engine.abort(5)
    with pytest.raises(ValueError, match=r"request_id='' must be a non-empty string"):
        engine.add_request(p, sp, request_id="")
    with pytest.raises(ValueError, match=r"request_id='4' is already in use \(unfinished\)"):
        engine.add_request(p, sp, request_id="4")
    with pytest.raises(ValueError, match=r"request '4' is waiting: abort\(\) it or run it to the end"):
        engine.release("4")
    # A finished request keeps its id until it is released; the old request is never replaced.
    first = engine.requests["1"]
    with pytest.raises(ValueError, match=r"request_id='1' is already in use \(finished but not released\)"):
        engine.add_request([7], sp, request_id="1")
    assert engine.release("1") is first and "1" not in engine.requests
    with pytest.raises(KeyError, match=r"no request with id '1' \(released, or never added\)"):
        engine.release("1")
    assert engine.add_request([7], sp, request_id="1") == "1" and engine.requests["1"] is not first
    engine.abort("1")
    assert engine.release("1").finish_reason == "abort"


def test_without_chunking_a_request_larger_than_the_budget_is_refused(tiny):
    engine = LLMEngine(tiny, max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"without chunked prefill.*max_num_batched_tokens=8"):
        engine.add_request(list(range(1, 8)), SamplingParams(max_tokens=4))


def test_request_longer_than_the_model_is_refused(tiny):
    engine = LLMEngine(tiny, num_blocks=1024)
    with pytest.raises(ValueError, match="max_position_embeddings=4096"):
        engine.add_request([1] * 4000, SamplingParams(max_tokens=200))


# ----- generate -----
def test_generate_is_all_or_nothing(tiny):
    engine = LLMEngine(tiny, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match=r"prompts\[1\]: |can never fit"):
        engine.generate([[1, 2], list(range(1, 30))], SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match=r"prompts\[1\]\[0\]=1.5 must be an integer"):
        engine.generate([[1, 2], [1.5]], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished() and engine.block_pool.num_free == 4 and not engine.requests


def test_bad_generate_arguments(tiny):
    engine = LLMEngine(tiny)
    with pytest.raises(TypeError, match=r"got a list of ints: for one prompt, pass \[prompt_ids\]"):
        engine.generate([1, 2, 3])
    with pytest.raises(TypeError, match=r"prompts must be a list of prompts .* got str"):
        engine.generate("hello")
    with pytest.raises(TypeError, match=r"prompts as a tensor must be 2-D"):
        engine.generate(torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams, a list of them"):
        engine.generate([[1]], {"max_tokens": 2})
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams, got int"):
        engine.generate([[1], [2]], [SamplingParams(), 3])
    with pytest.raises(ValueError, match="1 sampling params for 2 prompts"):
        engine.generate([[1], [2]], [SamplingParams()])
    assert not engine.requests and not engine.step_log
    assert engine.generate([], None) == []


def test_abort_frees_everything(tiny):
    engine = LLMEngine(tiny, num_blocks=16, block_size=4)
    a = engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=20))
    b = engine.add_request(list(range(1, 4)), SamplingParams(max_tokens=20))
    engine.step()
    assert engine.block_pool.num_free < 16
    engine.abort(a)
    engine.abort(b)
    engine.abort(b)  # finished already: nothing happens
    assert engine.requests[a].finish_reason == "abort" and not engine.has_unfinished()
    assert engine.block_pool.num_free == 16 and not engine.requests[a].block_ids
    with pytest.raises(KeyError, match="no request with id 'zzz'"):
        engine.abort("zzz")


def test_tiny_model_arguments():
    for kw, error, match in [
        (dict(seed="0"), TypeError, r"seed='0' must be an integer"),
        (dict(seed=SEED_MAX + 1), ValueError, r"seed=.* must be an integer in"),
        (dict(dtype="float64"), TypeError, r"dtype='float64' must be a floating-point torch.dtype"),
        (dict(dtype=torch.int64), TypeError, r"dtype=torch.int64 must be a floating-point torch.dtype"),
        (dict(vocab_size=0), ValueError, r"vocab_size=0 must be an integer >= 2"),
        (dict(num_layers=True), TypeError, r"num_layers=True must be an integer, not a bool"),
        (dict(num_layers=0), ValueError, r"^num_layers=0 must be an integer >= 1$"),
        (dict(qk_norm="yes"), TypeError, r"qk_norm='yes' must be True or False"),
        (dict(eos_token_id=64), ValueError, r"eos_token_id=64 must be an integer in \[0, 63\]"),
    ]:
        with pytest.raises(error, match=match):
            tiny_model(**kw)
    assert tiny_model(seed=np.int64(3), num_layers=1, vocab_size=16).config.num_hidden_layers == 1


# ----- a step that raises -----
@pytest.mark.parametrize("where", ["model", "sampling", "scheduler"])
def test_a_failing_step_poisons_nothing(tiny, monkeypatch, where):
    prompts = [list(range(1, 9)), [3, 4, 5], list(range(10, 30))]
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    expected = [r.output_ids for r in LLMEngine(tiny).generate(prompts, sp)]
    engine = LLMEngine(tiny, num_blocks=16, block_size=4, max_num_batched_tokens=16)
    calls = {"n": 0}

    def fault(real):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:  # the third step: requests prefilling, decoding and holding blocks
                raise RuntimeError(f"injected fault in the {where}")
            return real(*args, **kwargs)
        return wrapped

    if where == "model":
        monkeypatch.setattr(engine.runner, "forward", fault(engine.runner.forward))
    elif where == "sampling":
        monkeypatch.setattr("nano_engine.engine.sample", fault(sampling.sample))
    else:
        monkeypatch.setattr(engine.scheduler, "schedule", fault(engine.scheduler.schedule))
    keep = engine.add_request([7, 7, 7], sp, request_id="kept")  # not generate()'s: survives unless in the step
    with pytest.raises(RuntimeError, match=f"injected fault in the {where}"):
        engine.generate(prompts, sp)
    rec = engine.step_log[-1]
    assert rec.error == f"RuntimeError: injected fault in the {where}" and engine.stats.num_errors == 1
    # generate() aborted and released its requests; the one of the failed step that was not
    # generate()'s finished with "error" and is kept for the caller to see.
    assert set(engine.requests) == {keep} and set(rec.finished) >= {keep}
    assert engine.requests[keep].finish_reason == "error" and not engine.requests[keep].block_ids
    assert not engine.has_unfinished() and engine.block_pool.num_free == 16
    engine.block_pool.check()
    # The next call works and gives the same tokens as a fresh engine.
    assert [r.output_ids for r in engine.generate(prompts, sp)] == expected
    assert engine.block_pool.num_free == 16


def test_a_failing_step_finishes_only_its_own_requests(tiny, monkeypatch):
    engine = LLMEngine(tiny, max_num_seqs=1)
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    b = engine.add_request([4, 5, 6], SamplingParams(max_tokens=3))
    real = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda batch: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.step()
    assert engine.requests[a].finish_reason == "error" and engine.step_log[-1].finished == [a]
    assert not engine.requests[b].is_finished  # it was waiting, untouched: it runs on
    monkeypatch.setattr(engine.runner, "forward", real)
    while engine.has_unfinished():
        engine.step()
    alone = LLMEngine(tiny).generate([[4, 5, 6]], SamplingParams(max_tokens=3))[0]
    assert engine.requests[b].output_ids == alone.output_ids


# ----- nano_engine.checks, the rules every entry above uses, message by message -----
C = checks
CHECK_MESSAGES = [
    (C.integer, ("n", True), TypeError, "n=True must be an integer, not a bool"),
    (C.integer, ("n", np.bool_(True)), TypeError, "n=np.True_ must be an integer, not a bool"),
    (C.integer, ("n", torch.tensor(True)), TypeError, "n=tensor(True) must be an integer, not a bool"),
    (C.integer, ("n", torch.tensor([1, 2])), TypeError,
     "n=tensor([1, 2]) must be an integer, got a tensor of shape (2,) and dtype torch.int64"),
    (C.integer, ("n", torch.tensor(1.0)), TypeError,
     "n=tensor(1.) must be an integer, got a tensor of shape () and dtype torch.float32"),
    (C.integer, ("n", 1.5), TypeError, "n=1.5 must be an integer, got float"),
    (C.integer, ("n", 5, 1, 4), ValueError, "n=5 must be an integer in [1, 4]"),
    (C.integer, ("n", 0, 1, 4), ValueError, "n=0 must be an integer in [1, 4]"),
    (C.integer, ("n", 0, 1), ValueError, "n=0 must be an integer >= 1"),
    (C.integer, ("n", 9, None, 4), ValueError, "n=9 must be an integer <= 4"),
    (C.number, ("x", True), TypeError, "x=True must be a real number, got a bool"),
    (C.number, ("x", np.bool_(False)), TypeError, "x=np.False_ must be a real number, got a bool"),
    (C.number, ("x", "1"), TypeError, "x='1' must be a real number, got str"),
    (C.number, ("x", float("nan")), ValueError, "x=nan must be a finite number"),
    (C.number, ("x", float("-inf"), 0), ValueError, "x=-inf must be a finite number"),
    (C.number, ("x", 0.0, 0.0, 1.0, True), ValueError, "x=0.0 must be a number in (0.0, 1.0]"),
    (C.number, ("x", 2, 0, 1), ValueError, "x=2 must be a number in [0, 1]"),
    (C.number, ("x", -1, 0), ValueError, "x=-1 must be a number >= 0"),
    (C.number, ("x", 0, 0, None, True), ValueError, "x=0 must be a number > 0"),
    (C.number, ("x", 5, None, 4), ValueError, "x=5 must be a number <= 4"),
    (C.flag, ("f", 1), TypeError, "f=1 must be True or False, got int"),
    (C.flag, ("f", "no"), TypeError, "f='no' must be True or False, got str"),
    (C.choice, ("p", "x", ["a", "b"]), ValueError, "p='x' is not one of ('a', 'b')"),
    (C.choice, ("p", 1, ["a"]), ValueError, "p=1 is not one of ('a',)"),
    (C.token_ids, ("ids", "abc"), TypeError,
     "ids must be a sequence of token ids (ints) or a 1-D integer tensor, got str"),
    (C.token_ids, ("ids", b"a"), TypeError,
     "ids must be a sequence of token ids (ints) or a 1-D integer tensor, got bytes"),
    (C.token_ids, ("ids", None), TypeError,
     "ids must be a sequence of token ids (ints) or a 1-D integer tensor, got NoneType"),
    (C.token_ids, ("ids", 5), TypeError,
     "ids must be a sequence of token ids (ints) or a 1-D integer tensor, got int"),
    (C.token_ids, ("ids", torch.zeros(2, 2, dtype=torch.long)), TypeError,
     "ids must be a 1-D integer tensor or array, got shape (2, 2) and dtype torch.int64"),
    (C.token_ids, ("ids", torch.zeros(2)), TypeError,
     "ids must be a 1-D integer tensor or array, got shape (2,) and dtype torch.float32"),
    (C.token_ids, ("ids", torch.zeros(2, dtype=torch.complex64)), TypeError,
     "ids must be a 1-D integer tensor or array, got shape (2,) and dtype torch.complex64"),
    (C.token_ids, ("ids", torch.tensor([True])), TypeError,
     "ids must be a 1-D integer tensor or array, got shape (1,) and dtype torch.bool"),
    (C.token_ids, ("ids", np.zeros(2)), TypeError,
     "ids must be a 1-D integer tensor or array, got shape (2,) and dtype float64"),
    (C.token_ids, ("ids", np.zeros((1, 2), dtype=np.int64)), TypeError,
     "ids must be a 1-D integer tensor or array, got shape (1, 2) and dtype int64"),
    (C.token_ids, ("ids", [1, 2.0]), TypeError, "ids[1]=2.0 must be an integer, got float"),
    (C.token_ids, ("ids", [1, 9], 9), ValueError, "ids[1]=9 is outside the vocabulary [0, 9)"),
    (C.token_ids, ("ids", [-1], 9), ValueError, "ids[0]=-1 is outside the vocabulary [0, 9)"),
    (C.token_ids, ("ids", torch.tensor([3, 4]), 4), ValueError, "ids[1]=4 is outside the vocabulary [0, 4)"),
    (C.instance, ("x", 1, str, "a str"), TypeError, "x must be a str, got int"),
    (C.request_id, (1,), TypeError, "request_id=1 must be a str (request ids are strings, as in vLLM), got int"),
    (C.request_id, ("",), ValueError, "request_id='' must be a non-empty string"),
    (C.cache_salt, (3,), TypeError, "cache_salt=3 must be a str or None, got int"),
    (C.cache_salt, ("",), ValueError, "cache_salt='' must be a non-empty string (or None: no salt)"),
    (C.prompt_batch, ("ab", None, SamplingParams), TypeError,
     "prompts must be a list of prompts (each a list of token ids or a 1-D integer tensor), got str"),
    (C.prompt_batch, (b"ab", None, SamplingParams), TypeError,
     "prompts must be a list of prompts (each a list of token ids or a 1-D integer tensor), got bytes"),
    (C.prompt_batch, (5, None, SamplingParams), TypeError,
     "prompts must be a list of prompts (each a list of token ids or a 1-D integer tensor), got int"),
    (C.prompt_batch, (torch.zeros(3, dtype=torch.long), None, SamplingParams), TypeError,
     "prompts as a tensor must be 2-D (one prompt per row), got shape (3,)"),
    (C.prompt_batch, (np.zeros((1, 2, 2), dtype=np.int64), None, SamplingParams), TypeError,
     "prompts as a tensor must be 2-D (one prompt per row), got shape (1, 2, 2)"),
    (C.prompt_batch, ([1, 2], None, SamplingParams), TypeError,
     "prompts must be a list of prompts, got a list of ints: for one prompt, pass [prompt_ids]"),
    (C.prompt_batch, ([np.int64(1)], None, SamplingParams), TypeError,
     "prompts must be a list of prompts, got a list of ints: for one prompt, pass [prompt_ids]"),
    (C.prompt_batch, ([[1]], "x", SamplingParams), TypeError,
     "sampling_params must be a SamplingParams, a list of them (one per prompt) or None, got str"),
    (C.prompt_batch, ([[1]], 5, SamplingParams), TypeError,
     "sampling_params must be a SamplingParams, a list of them (one per prompt) or None, got int"),
    (C.prompt_batch, ([[1], [2]], [SamplingParams()], SamplingParams), ValueError,
     "1 sampling params for 2 prompts"),
    (C.prompt_batch, ([[1], [2]], [None, 3], SamplingParams), TypeError,
     "sampling_params[1] must be a SamplingParams, got int"),
]


@pytest.mark.parametrize("check, args, error, message", CHECK_MESSAGES,
                         ids=[f"{c.__name__}-{i}" for i, (c, *_) in enumerate(CHECK_MESSAGES)])
def test_each_check_names_the_value_and_what_is_allowed_whole(check, args, error, message):
    with pytest.raises(error, match=whole(message)):
        check(*args)


def test_checks_return_plain_python_values_and_bounds_are_inclusive():
    for value in (3, np.int8(3), torch.tensor(3)):
        v = checks.integer("n", value, minimum=3, maximum=3)
        assert v == 3 and type(v) is int
    v = checks.number("x", np.float32(0.5), 0.5, 0.5)
    assert v == 0.5 and type(v) is float
    assert checks.number("x", 1, 0, 1, exclusive_minimum=True) == 1.0  # only the minimum is exclusive
    assert checks.number("x", 1e-300, 0, exclusive_minimum=True) == 1e-300
    assert checks.flag("f", np.bool_(False)) is False and checks.flag("f", True) is True
    assert checks.choice("p", "b", ["a", "b"]) == "b"
    for ids in ([1, 8], (1, 8), np.array([1, 8]), torch.tensor([1, 8]), range(1, 9, 7), iter([1, 8])):
        out = checks.token_ids("ids", ids, vocab_size=9)
        assert out == [1, 8] and all(type(t) is int for t in out)
    assert checks.token_ids("ids", torch.tensor([0, 3], dtype=torch.int8), vocab_size=4) == [0, 3]
    assert checks.token_ids("ids", [10**6]) == [10**6]  # no vocabulary given: no upper bound
    assert checks.instance("x", "s", (int, str), "an int or a str") == "s"
    assert checks.request_id("r") == "r" and checks.cache_salt("s") == "s" and checks.cache_salt(None) is None
    sp = SamplingParams()
    assert checks.prompt_batch([[1], [2]], None, SamplingParams) == [None, None]
    assert checks.prompt_batch([[1], [2]], sp, SamplingParams) == [sp, sp]
    assert checks.prompt_batch(torch.zeros(2, 3, dtype=torch.long), (None, sp), SamplingParams) == [None, sp]
    assert checks.prompt_batch([], None, SamplingParams) == []


def test_memory_available_reads_meminfo_and_falls_back_to_sysconf(monkeypatch, tmp_path):
    import builtins
    import os

    real_open = builtins.open
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:         300 kB\nMemAvailable:    700 kB\n")
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: real_open(meminfo if p == "/proc/meminfo" else p, *a, **k))
    assert checks.memory_available() == 700 * 1024  # MemAvailable, not MemFree or MemTotal

    def no_file(p, *a, **k):
        raise FileNotFoundError(p)
    monkeypatch.setattr(builtins, "open", no_file)
    sizes = {"SC_AVPHYS_PAGES": 5, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: sizes[name])
    assert checks.memory_available() == 5 * 4096

    def no_sysconf(name):
        raise ValueError(name)  # what os.sysconf raises for a name this system does not know
    monkeypatch.setattr(os, "sysconf", no_sysconf)
    assert checks.memory_available() is None
    meminfo.write_text("MemTotal:       1000 kB\n")  # no MemAvailable line (an old kernel): sysconf
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: real_open(meminfo if p == "/proc/meminfo" else p, *a, **k))
    monkeypatch.setattr(os, "sysconf", lambda name: sizes[name])
    assert checks.memory_available() == 5 * 4096


def test_fits_in_memory_message_whole_and_its_limit(monkeypatch):
    monkeypatch.setattr(checks, "memory_available", lambda: 2**30)
    checks.fits_in_memory("kv", int(0.9 * 2**30))  # at the limit: fine
    checks.fits_in_memory("kv", 2**30, fraction=1.0)
    checks.fits_in_memory("kv", 2**29, fraction=0.5)  # exactly the fraction: fine (refused only above it)
    with pytest.raises(ValueError, match=whole(
            "kv needs 1,000,000,000 bytes (0.93 GiB), more than 90% of the 1,073,741,824 bytes (1.00 GiB) "
            "this machine has available")):
        checks.fits_in_memory("kv", 10**9)
    with pytest.raises(ValueError, match=r"^kv needs 600,000,000 bytes \(0\.56 GiB\), more than 50% of the "):
        checks.fits_in_memory("kv", 6 * 10**8, fraction=0.5)
    monkeypatch.setattr(checks, "memory_available", lambda: None)
    checks.fits_in_memory("kv", 10**15)  # nothing known about the machine: not refused


def test_tiny_model_is_the_documented_shape_seeded_and_in_eval_mode():
    from dataclasses import asdict

    m = tiny_model()
    assert asdict(m.config) == {
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "attention_bias": False, "qk_norm": False, "eos_token_id": 0,
        "model_type": "llama"}
    assert not m.training and all(p.dtype == torch.float64 for p in m.parameters())
    q = tiny_model(seed=SEED_MIN, dtype=torch.float32, vocab_size=2, num_layers=1, qk_norm=True, eos_token_id=1)
    assert (q.config.model_type, q.config.qk_norm, q.config.eos_token_id, q.config.vocab_size) == ("qwen3", True, 1, 2)
    assert q.config.num_hidden_layers == 1 and all(p.dtype == torch.float32 for p in q.parameters())
    tiny_model(seed=SEED_MAX)  # both ends of the seed range are seeds
    # Weights are N(0, 0.3^2) from the seed: the same seed gives the same model, another seed another.
    flat = torch.cat([p.flatten() for p in m.parameters()])
    assert flat.std().item() == pytest.approx(0.3, rel=0.05) and abs(flat.mean().item()) < 0.01
    same = torch.cat([p.flatten() for p in tiny_model(seed=0).parameters()])
    other = torch.cat([p.flatten() for p in tiny_model(seed=1).parameters()])
    assert torch.equal(flat, same) and not torch.equal(flat, other)

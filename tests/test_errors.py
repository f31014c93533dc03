"""Bad input gets a TypeError or ValueError naming the field and the value (and what is allowed, where
that is the point), raised before anything changes; a step that raises leaves the engine usable.

That every bad value is refused, naming its field, and changes nothing is test_api_properties.py's
(random values against the rules); the tables here keep what a refusal must name (the value, the limit,
what is wrong with a tensor) and the cases those generators do not reach: tiny_model, LLMEngine's own
arguments, the KV pool against memory, generate(), request ids, abort and release.
The tests check what a refusal names, not its sentence: the wording may change, the names may not."""

import contextlib
import math

import numpy as np
import pytest
import torch

from nano_engine import EngineConfig, LLMEngine, SamplingParams, checks, sampling
from nano_engine.request import SEED_MAX, SEED_MIN
from nano_engine.tiny import tiny_model


@contextlib.contextmanager
def refused(error, *named):
    """Expect `error`, its message naming each of `named` (a field=value, a limit), in whatever words."""
    with pytest.raises(error) as e:
        yield
    assert all(n in str(e.value) for n in named), str(e.value)


# ----- SamplingParams, EngineConfig and tiny_model: what a refusal names -----
SP, EC = SamplingParams, EngineConfig.from_settings
REFUSALS = [  # (what is called, with what, the error, what its message names)
    (SP, dict(max_tokens=0), ValueError, ["max_tokens=0", ">= 1"]),
    # what passes for the right kind is refused: a bool is not a number, a number is not a flag, 2.0 is not 2
    (SP, dict(max_tokens=True), TypeError, ["max_tokens=True", "bool"]),
    (SP, dict(temperature=True), TypeError, ["bool"]), (SP, dict(ignore_eos=1), TypeError, ["ignore_eos=1"]),
    (SP, dict(max_tokens=2.0), TypeError, ["max_tokens=2.0"]),
    (SP, dict(top_k=torch.tensor([1, 2])), TypeError, ["top_k", "(2,)"]),  # a tensor: its shape
    (SP, dict(top_k=torch.tensor(1.0)), TypeError, ["top_k", "torch.float32"]),  # or its dtype
    (SP, dict(top_p=0.0), ValueError, ["top_p=0.0", "(0, 1]"]),
    (SP, dict(seed=SEED_MAX + 1), ValueError, [f"seed={SEED_MAX + 1}", f"[{SEED_MIN}, {SEED_MAX}]"]),
    (SP, dict(stop_token_ids=[3, -1]), ValueError, ["stop_token_ids[1]=-1"]),  # which element
    (SP, dict(logit_bias={1: -101}), ValueError, ["logit_bias[1]=-101", "[-100.0, 100.0]"]),
    (SP, dict(logit_bias={3: 1.0, torch.tensor(3): 2.0}), ValueError, ["logit_bias", "token 3 twice"]),  # none lost
    (SP, dict(min_tokens=9, max_tokens=8), ValueError, ["min_tokens=9", "max_tokens=8"]),
    (EC, dict(num_blocks=0), ValueError, ["num_blocks=0", ">= 1"]),
    # torch.distributed keeps a timeout in milliseconds in a C int: 1e10 s failed deep inside it
    (EC, dict(worker_timeout_s=1e10), ValueError, ["worker_timeout_s=10000000000.0", "604800"]),
    (EC, dict(min_new_token_ratio=0.8), ValueError, ["min_new_token_ratio=0.8", "init_new_token_ratio=0.7"]),
    (tiny_model, dict(seed="0"), TypeError, ["seed='0'"]), (tiny_model, dict(dtype=torch.int64), TypeError, ["dtype"]),
    (tiny_model, dict(dtype="float64"), TypeError, ["dtype='float64'", "torch.dtype"]),
    (tiny_model, dict(vocab_size=0), ValueError, ["vocab_size=0", ">= 2"]),
    (tiny_model, dict(num_layers=True), TypeError, ["num_layers=True"]),
    (tiny_model, dict(qk_norm="yes"), TypeError, ["qk_norm='yes'"]),
    (tiny_model, dict(eos_token_id=64), ValueError, ["eos_token_id=64", "63"]),  # inside the vocabulary
]


@pytest.mark.parametrize("make, kw, error, named", REFUSALS,
                         ids=[f"{getattr(m, '__name__', 'EngineConfig')}-{next(iter(kw))}" for m, kw, *_ in REFUSALS])
def test_a_bad_value_is_refused_naming_it(make, kw, error, named):
    with refused(error, *named):
        make(**kw)


def test_tiny_temperature_and_top_p_are_numerically_safe(tiny):
    """Below vLLM's _SAMPLING_EPS a temperature is greedy; a top_p that rounds to 0 keeps the top token."""
    prompts = [[5, 6, 7], [9, 1]]
    greedy = [r.output_ids for r in LLMEngine(tiny).generate(prompts, SamplingParams(max_tokens=6))]
    for sp in [SamplingParams(max_tokens=6, temperature=1e-9), SamplingParams(max_tokens=6, temperature=1e-300),
               SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-300, seed=0),
               SamplingParams(max_tokens=6, temperature=1e-5, top_p=5e-324, seed=0)]:
        assert [r.output_ids for r in LLMEngine(tiny).generate(prompts, sp)] == greedy, sp


# ----- LLMEngine(...) -----
def test_bad_engine_arguments(tiny):
    """Each refusal names the argument; a misplaced or misspelt one is told what it should be."""
    cases = [
        (lambda: LLMEngine(tiny, config={"num_blocks": 8}), TypeError, ["config", "EngineConfig"]),
        (lambda: LLMEngine("HuggingFaceTB/SmolLM2-135M"), TypeError, ["model"]),
        (lambda: LLMEngine(tiny, EngineConfig()), TypeError, ["tokenizer"]),
        (lambda: LLMEngine(tiny, num_block=8), TypeError, ["num_block'", "num_blocks"]),
        (lambda: LLMEngine(tiny, config=EngineConfig(), num_blocks=8), ValueError, ["config"]),
        (lambda: LLMEngine(tiny, scheduler_cls="fcfs"), TypeError, ["scheduler_cls"]),
        (lambda: LLMEngine(tiny, block_pool_cls=object()), TypeError, ["block_pool_cls"]),
        (lambda: EngineConfig(scheduler_config={"max_num_seqs": 2}), TypeError, ["scheduler_config"]),
        (lambda: EngineConfig(attention_backend="cuda"), ValueError, ["attention_backend='cuda'"]),
        (lambda: LLMEngine(tiny, policy="static", enable_chunked_prefill=True), ValueError,
         ["enable_chunked_prefill=True", "static"]),  # the engine's flat settings reach SchedulerConfig's checks
    ]
    for make, error, named in cases:
        with refused(error, *named):
            make()


def test_kv_pool_larger_than_memory_is_refused_before_allocating(tiny, monkeypatch):
    with refused(ValueError, "num_blocks=1000000000", "8,192,000,000,000 bytes", "90%"):
        LLMEngine(tiny, num_blocks=10**9)  # would be 8 TB: refused at once, nothing allocated
    cfg = tiny.config  # float64, 2 layers, 2 KV heads of 8: 2 * 2 * 16 * 4 * 2 * 8 * 8 bytes
    need = 2 * cfg.num_hidden_layers * 16 * 4 * cfg.num_key_value_heads * cfg.head_dim * 8
    assert LLMEngine(tiny, num_blocks=16, block_size=4).runner.kv_cache.nbytes == need
    monkeypatch.setattr(checks, "memory_available", lambda: math.ceil(need / 0.9))
    LLMEngine(tiny, num_blocks=16, block_size=4)  # exactly at the limit: fine
    monkeypatch.setattr(checks, "memory_available", lambda: need)
    with refused(ValueError, f"{need:,} bytes", "90%"):
        LLMEngine(tiny, num_blocks=16, block_size=4)
    monkeypatch.setattr(checks, "memory_available", lambda: None)
    checks.fits_in_memory("a KV cache", 10**15)  # nothing known about the machine: not refused


# ----- add_request -----
def test_bad_prompts_are_refused(tiny):
    engine = LLMEngine(tiny, num_blocks=4, block_size=4, max_num_batched_tokens=8)
    for bad, error, named in [
        ([], ValueError, ["prompt_ids"]), ([1, 64], ValueError, ["prompt_ids[1]=64", "[0, 64)"]),  # the vocabulary
        (torch.tensor([[1, 2], [3, 4]]), TypeError, ["prompt_ids", "(2, 2)"]),
        (np.array([1.5, 2.0]), TypeError, ["prompt_ids", "float64"]),
    ]:
        with refused(error, *named):
            engine.add_request(bad)
    with refused(ValueError, "max_tokens 8", "5 blocks", "4"):  # what it needs, what the pool has
        engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=8))
    # only EOS and stop tokens allowed, all masked by min_tokens: no first token could be sampled (greedy
    # took a token outside allowed_token_ids; sampling failed inside torch, with the whole step's requests)
    eos = tiny.config.eos_token_id
    for kw in (dict(allowed_token_ids=[eos]), dict(allowed_token_ids=[eos, 7], stop_token_ids=[7], temperature=1.0)):
        with refused(ValueError, "allowed_token_ids", "min_tokens=2"):
            engine.add_request([1, 2], SamplingParams(max_tokens=4, min_tokens=2, **kw))
    assert not engine.requests and not engine.has_unfinished() and not engine.step_log
    engine.add_request([1, 2], SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=[eos], ignore_eos=True))


def test_every_prompt_form_gives_the_same_tokens(tiny):
    forms = [[3, 4, 5], [np.int64(3), 4, torch.tensor(5)], np.array([3, 4, 5], dtype=np.int32), range(3, 6)]
    outs = LLMEngine(tiny).generate(forms, SamplingParams(max_tokens=4))
    assert all(r.prompt_ids == [3, 4, 5] for r in outs) and len({tuple(r.output_ids) for r in outs}) == 1
    batch = LLMEngine(tiny).generate(torch.tensor([[3, 4, 5], [3, 4, 5]]), SamplingParams(max_tokens=4))
    assert [r.output_ids for r in batch] == [outs[0].output_ids] * 2


def test_request_ids(tiny):
    engine = LLMEngine(tiny)
    p, sp = [5, 6], SamplingParams(max_tokens=2)
    assert engine.add_request(p, sp, request_id="1") == "1"
    # Automatic ids skip the ones the caller chose.
    done = engine.generate([p, p, p], sp)
    assert [r.request_id for r in done] == ["0", "2", "3"]
    assert engine.add_request(p, sp) == "4"
    # Request ids are strings, as in vLLM: an int is refused everywhere, not silently converted.
    for call, error, named in [(lambda: engine.add_request(p, sp, request_id=5), TypeError, ["request_id=5", "str"]),
                               (lambda: engine.abort(5), TypeError, ["request_id=5"]),
                               (lambda: engine.release("4"), ValueError, ["'4'", "waiting"])]:  # not finished yet
        with refused(error, *named):
            call()
    # A finished request keeps its id until it is released; the old request is never replaced.
    first = engine.requests["1"]
    with refused(ValueError, "request_id='1'", "in use"):
        engine.add_request([7], sp, request_id="1")
    assert engine.release("1") is first and "1" not in engine.requests
    with refused(KeyError, "'1'"):
        engine.release("1")
    assert engine.add_request([7], sp, request_id="1") == "1" and engine.requests["1"] is not first
    engine.abort("1")
    assert engine.release("1").finish_reason == "abort"


# ----- generate -----
def test_generate_is_all_or_nothing(tiny):
    engine = LLMEngine(tiny, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match=r"prompts\[1\]: |can never fit"):
        engine.generate([[1, 2], list(range(1, 30))], SamplingParams(max_tokens=2))
    with refused(TypeError, "prompts[1][0]=1.5"):
        engine.generate([[1, 2], [1.5]], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished() and engine.block_pool.num_free == 4 and not engine.requests


def test_bad_generate_arguments(tiny):
    engine = LLMEngine(tiny)
    for args, error, named in [(([1, 2, 3],), TypeError, ["[prompt_ids]"]),  # one prompt: what to pass instead
                               (("hello",), TypeError, ["prompts", "str"]),
                               ((b"hi",), TypeError, ["prompts", "bytes"]),
                               ((torch.tensor([1, 2, 3]),), TypeError, ["prompts", "2-D"]),
                               (([[1]], {"max_tokens": 2}), TypeError, ["sampling_params", "dict"]),
                               (([[1], [2]], [SamplingParams(), 3]), TypeError, ["sampling_params[1]", "int"]),
                               (([[1], [2]], [SamplingParams()]), ValueError, ["1 sampling params", "2 prompts"])]:
        with refused(error, *named):
            engine.generate(*args)
    assert not engine.requests and not engine.step_log
    assert engine.generate([], None) == []


def test_abort_frees_everything_and_takes_stop_or_abort(tiny):
    engine = LLMEngine(tiny, num_blocks=16, block_size=4)
    a = engine.add_request(list(range(1, 10)), SamplingParams(max_tokens=20))
    b = engine.add_request(list(range(1, 4)), SamplingParams(max_tokens=20))
    engine.step()
    assert engine.block_pool.num_free < 16
    with refused(ValueError, "finish_reason='halt'"):
        engine.abort(a, "halt")
    assert not engine.requests[a].is_finished  # refused before anything changed
    engine.abort(a)
    engine.abort(b, "stop")
    engine.abort(b)  # finished already: nothing happens
    assert (engine.requests[a].finish_reason, engine.requests[b].finish_reason) == ("abort", "stop")
    assert not engine.has_unfinished() and engine.block_pool.num_free == 16 and not engine.requests[a].block_ids
    with refused(KeyError, "'zzz'"):
        engine.abort("zzz")


def test_tiny_model_is_float64_in_eval_mode_and_the_same_for_the_same_seed():
    m = tiny_model()
    assert not m.training and all(p.dtype == torch.float64 for p in m.parameters())
    q = tiny_model(seed=SEED_MIN, dtype=torch.float32, vocab_size=2, num_layers=1, qk_norm=True, eos_token_id=1)
    assert (q.config.model_type, q.config.num_hidden_layers, q.config.vocab_size) == ("qwen3", 1, 2)  # qk_norm: Qwen3
    assert all(p.dtype == torch.float32 for p in q.parameters())
    tiny_model(seed=np.uint64(SEED_MAX))  # the whole seed range, numpy's integers too
    weights = [torch.cat([p.flatten() for p in tiny_model(seed=s).parameters()]) for s in (0, 0, 1)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


# ----- a step that raises -----
@pytest.mark.parametrize("where", ["model", "sampling", "scheduler"])
def test_a_failing_step_poisons_nothing(tiny, monkeypatch, where):
    prompts = [list(range(1, 9)), [3, 4, 5], list(range(10, 30))]
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    expected = [r.output_ids for r in LLMEngine(tiny).generate(prompts, sp)]
    engine = LLMEngine(tiny, num_blocks=16, block_size=4, max_num_batched_tokens=16)
    pool, calls = engine.block_pool, {"n": 0}

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
    rec = engine.step_log[-1]  # the step log says which error ended the step; it sampled nothing
    assert "RuntimeError" in rec.error and f"injected fault in the {where}" in rec.error and rec.num_sampled == 0
    assert engine.stats.num_errors == 1 and engine.block_pool is pool
    # generate() aborted and released its requests; the one of the failed step that was not
    # generate()'s finished with "error" and is kept for the caller to see.
    assert set(engine.requests) == {keep} and set(rec.finished) >= {keep}
    assert engine.requests[keep].finish_reason == "error" and not engine.requests[keep].block_ids
    assert not engine.has_unfinished() and engine.block_pool.num_free == 16
    engine.block_pool.check()
    # The next call works and gives the same tokens as a fresh engine; the blocks the failed call
    # filled are still in the prefix cache.
    again = engine.generate(prompts, sp)
    assert [r.output_ids for r in again] == expected and again[2].num_cached_tokens > 0
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

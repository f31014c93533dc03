"""The async engine (async_engine.py): concurrent callers, cancellation, idling, shutdown, failures.

A tiny random model without a tokenizer: token ids only (text and stop strings are tested on the
embedded model in test_server.py and test_detokenizer.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from nano_engine import LLMEngine, SamplingParams
from nano_engine.async_engine import AsyncLLM, EngineDeadError

PROMPTS = [list(range(1 + i, 6 + 3 * i)) for i in range(8)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


@pytest.fixture
def make(tiny):
    made = []

    def build(**settings):
        llm = AsyncLLM(LLMEngine(tiny, **settings))
        made.append(llm)
        return llm

    yield build
    for llm in made:
        llm.shutdown()
        assert not llm._thread.is_alive()


async def collect(llm, prompt, params, **kw):
    outs = [o async for o in llm.generate(prompt, params, **kw)]
    return outs


def test_concurrent_callers_get_generates_tokens_and_share_steps(tiny, make):
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [r.output_ids for r in LLMEngine(tiny).generate(PROMPTS, sp)]
    llm = make(max_num_batched_tokens=32, num_blocks=64, block_size=4)

    async def main():
        return await asyncio.gather(*(collect(llm, p, sp) for p in PROMPTS))

    results = run(main())
    for outs, want, prompt in zip(results, expected, PROMPTS):
        assert [t for o in outs for t in o.new_token_ids] == want
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert all(not o.finished for o in outs[:-1])
        assert sum(len(o.token_times) for o in outs) == len(want)
        assert outs[-1].num_output_tokens == len(want) and outs[-1].num_prompt_tokens == len(prompt)
    # Requests were batched together: some step ran several of them.
    assert max(rec.num_requests for rec in llm.engine.step_log) >= 4
    # Everything was released: no request left in the engine, every block free.
    assert not llm.engine.requests and llm.engine.block_pool.num_free == 64 and llm.num_streams == 0


def test_a_cancelled_caller_aborts_its_request_and_frees_its_blocks(make):
    llm = make(num_blocks=64, block_size=4)
    finals = []  # the engine thread's last output of each request (nobody reads the cancelled one)
    llm.on_output = lambda out: finals.append((out.request_id, out.finish_reason)) if out.finished else None
    sp = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        stream = await llm.add_request(list(range(1, 20)), sp, "long")
        other = asyncio.ensure_future(collect(llm, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))

        async def read_two():
            n = 0
            async with stream:
                async for _ in stream:
                    n += 1
                    if n == 2:
                        await asyncio.sleep(3600)  # cancelled here, mid-stream
        task = asyncio.ensure_future(read_two())
        while llm.engine.requests.get("long") is None or len(llm.engine.requests["long"].output_ids) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await other

    outs = run(main())
    assert outs[-1].finish_reason == "length"
    deadline = time.time() + 10
    while (llm.engine.requests or llm.engine.block_pool.num_free != 64) and time.time() < deadline:
        time.sleep(0.01)
    assert not llm.engine.requests and llm.engine.block_pool.num_free == 64
    assert not llm.engine.has_unfinished()
    assert ("long", "abort") in finals and len(finals) == 2


def test_the_engine_thread_sleeps_when_idle(make):
    llm = make()
    run(collect(llm, [1, 2, 3], SamplingParams(max_tokens=2)))
    steps, turns = llm.engine.stats.steps, llm.num_wakeups
    time.sleep(0.5)
    assert llm.engine.stats.steps == steps  # no step, idle or not, without work
    assert llm.num_wakeups == turns  # and no turn of the loop: it waits on its condition
    assert llm._thread.is_alive()


def test_a_refused_request_raises_in_the_caller_and_queues_nothing(make):
    llm = make(num_blocks=4, block_size=4)

    async def main():
        with pytest.raises(ValueError, match="can never fit"):
            await llm.add_request(list(range(1, 10)), SamplingParams(max_tokens=20))
        with pytest.raises(ValueError, match="prompt_ids"):
            await llm.add_request([], SamplingParams())
        with pytest.raises(TypeError, match="request_id"):
            await llm.add_request([1, 2], SamplingParams(), request_id=5)
        with pytest.raises(ValueError, match=r"stop=\['ab'\] needs a tokenizer"):  # this engine has none
            await llm.add_request([1, 2], SamplingParams(stop=["ab"]))
        return await collect(llm, [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))

    outs = run(main())
    assert [t for o in outs for t in o.new_token_ids] and not llm.engine.requests
    assert llm.engine.block_pool.num_free == 4


def test_a_failing_step_ends_its_requests_with_error_and_the_engine_serves_on(tiny, make, monkeypatch):
    llm = make()
    real = llm.engine.runner.forward
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real(batch)

    monkeypatch.setattr(llm.engine.runner, "forward", flaky)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    first = run(collect(llm, [1, 2, 3], sp))
    assert first[-1].finished and first[-1].finish_reason == "error"
    again = run(collect(llm, [1, 2, 3], sp))
    want = LLMEngine(tiny).generate([[1, 2, 3]], sp)[0].output_ids
    assert [t for o in again for t in o.new_token_ids] == want


def test_shutdown_aborts_what_is_left_and_refuses_new_requests(make):
    llm = make()
    got: list = []

    async def main():
        stream = await llm.add_request(list(range(1, 9)), SamplingParams(max_tokens=4000, ignore_eos=True))
        async for out in stream:
            got.append(out)
            if len(got) == 2:
                threading.Thread(target=llm.shutdown).start()
        with pytest.raises(EngineDeadError):
            await llm.add_request([1, 2], SamplingParams())

    run(main())
    assert got[-1].finished and got[-1].finish_reason == "abort"
    llm._thread.join(10)
    assert not llm._thread.is_alive() and not llm.engine.requests


def test_build_makes_the_engine_in_the_engine_thread_and_serves_it(tiny):
    # Where speed matters the model is loaded and stepped in one thread (AsyncLLM.build's docstring:
    # GNU OpenMP keeps a worker team per thread that ran torch, and two teams on 2 cores halve a step).
    where = []

    def make_engine():
        where.append(threading.current_thread())
        return LLMEngine(tiny, max_num_batched_tokens=32, num_blocks=64, block_size=4)

    llm = AsyncLLM.build(make_engine)
    try:
        assert where == [llm._thread] and llm._thread is not threading.current_thread()
        assert llm._thread.name == "nano_engine-core"
        sp = SamplingParams(max_tokens=6, ignore_eos=True)
        want = LLMEngine(tiny).generate([PROMPTS[3]], sp)[0].output_ids
        outs = run(collect(llm, PROMPTS[3], sp))
        assert [t for o in outs for t in o.new_token_ids] == want and outs[-1].finished
    finally:
        llm.shutdown()
    assert not llm._thread.is_alive()


@pytest.mark.parametrize("make_engine, error, text", [
    (lambda: (_ for _ in ()).throw(FileNotFoundError("no model at /nowhere")), FileNotFoundError,
     "no model at /nowhere"),
    (lambda: "not an engine", TypeError, "got str"),
])
def test_build_raises_what_make_engine_raised_and_leaves_no_thread(make_engine, error, text):
    before = {t for t in threading.enumerate() if t.name == "nano_engine-core"}
    with pytest.raises(error) as e:
        AsyncLLM.build(make_engine)
    assert text in str(e.value)
    assert {t for t in threading.enumerate() if t.name == "nano_engine-core"} == before

"""The async engine (async_engine.py): concurrent callers, cancellation, idling, shutdown, failures.

A tiny random model without a tokenizer: token ids only (text and stop strings are tested on the
embedded model in test_server.py and test_detokenizer.py)."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import pytest

from nano_engine import LLMEngine, SamplingParams
from nano_engine.serving.async_llm import AsyncLLM, EngineDeadError, _Abort, _Add

PROMPTS = [list(range(1 + i, 6 + 3 * i)) for i in range(8)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))  # the tiny model: each request takes well under 1 s


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


def wait_until(condition, timeout: float = 20.0) -> bool:
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.01)
    return condition()


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
    llm.subscribe(lambda out: finals.append((out.request_id, out.finish_reason)) if out.finished else None)
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
    assert wait_until(lambda: not llm.engine.requests and llm.engine.block_pool.num_free == 64, 10)
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


def test_a_failing_step_ends_its_requests_with_error_and_the_engine_serves_on(tiny, make, monkeypatch, caplog):
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
    with caplog.at_level(logging.ERROR, logger="nano_engine.serving.async_llm"):
        first = run(collect(llm, [1, 2, 3], sp))
    assert first[-1].finished and first[-1].finish_reason == "error"
    assert [(r.getMessage(), r.exc_info[1].args) for r in caplog.records] == [("engine step 1 failed",
                                                                              ("injected fault",))]
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


def test_a_function_makes_the_engine_in_the_engine_thread_and_serves_it(tiny):
    # Where speed matters the model is loaded and stepped in one thread (AsyncLLM's docstring:
    # GNU OpenMP keeps a worker team per thread that ran torch, and two teams on 2 cores halve a step).
    where = []

    def make_engine():
        where.append(threading.current_thread())
        return LLMEngine(tiny, max_num_batched_tokens=32, num_blocks=64, block_size=4)

    llm = AsyncLLM(make_engine)
    try:
        assert where == [llm._thread] and llm._thread is not threading.current_thread()
        sp = SamplingParams(max_tokens=6, ignore_eos=True)
        want = LLMEngine(tiny).generate([PROMPTS[3]], sp)[0].output_ids
        outs = run(collect(llm, PROMPTS[3], sp))
        assert [t for o in outs for t in o.new_token_ids] == want and outs[-1].finished
    finally:
        llm.shutdown()
    assert not llm._thread.is_alive()


def no_model():
    raise FileNotFoundError("no model at /nowhere")


@pytest.mark.parametrize("make_engine, error, text", [
    (no_model, FileNotFoundError, "no model at /nowhere"),
    (lambda: "not an engine", TypeError, "got str"),
])
def test_a_failing_engine_function_raises_here_and_leaves_no_thread(make_engine, error, text):
    before = set(threading.enumerate())
    with pytest.raises(error) as e:
        AsyncLLM(make_engine)
    assert text in str(e.value)
    assert set(threading.enumerate()) <= before


class WordsTokenizer:
    """Enough of a tokenizer for the detokenizer: id i reads " w<i>"."""

    def decode(self, ids, **kwargs):
        return "".join(f" w{i}" for i in ids)


def test_the_engine_thread_is_a_daemon_calling_the_hooks_with_the_engines_tokenizer(tiny):
    """A daemon thread (a process that forgets shutdown() still exits); on_output and subscribers
    see every output; text comes from the engine's tokenizer, under the engine's lock."""
    seen, later, tokenizer = [], [], WordsTokenizer()
    with pytest.raises(TypeError, match="engine must be an LLMEngine"):
        AsyncLLM("an engine")
    llm = AsyncLLM(LLMEngine(tiny, tokenizer), on_output=seen.append)
    llm.subscribe(later.append)
    try:
        assert llm._thread.daemon and llm.tokenizer is tokenizer
        assert llm.tokenizer_lock is llm.engine.tokenizer_lock
        outs = run(collect(llm, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
        assert seen == outs and later == outs
        ids = [t for o in outs for t in o.new_token_ids]
        assert "".join(o.new_text for o in outs) == tokenizer.decode(ids)
    finally:
        llm.shutdown()
    bare = AsyncLLM(LLMEngine(tiny))
    try:
        outs = run(collect(bare, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
        assert bare.tokenizer is None and all(o.new_text == "" for o in outs)  # tokens, no text
    finally:
        bare.shutdown()


def test_generate_passes_the_request_id_and_the_engines_keywords(make):
    llm = make()
    priorities = []
    llm.subscribe(lambda out: priorities.append(llm.engine.requests[out.request_id].priority))
    outs = run(collect(llm, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), request_id="mine",
                       priority=7))
    assert {o.request_id for o in outs} == {"mine"} and priorities[0] == 7


def blocked_engine(llm, monkeypatch):
    """Make the engine thread's next forward pass wait: returns (entered, release) events."""
    entered, release, real = threading.Event(), threading.Event(), llm.engine.runner.forward

    def forward(batch):
        entered.set()
        assert release.wait(30), "the test never released the forward pass"
        return real(batch)

    monkeypatch.setattr(llm.engine.runner, "forward", forward)
    return entered, release


def test_shutdown_waits_thirty_seconds_by_default_and_no_longer_than_asked(make, monkeypatch):
    llm = make()
    entered, release = blocked_engine(llm, monkeypatch)
    try:
        async def main():
            await llm.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
            assert await asyncio.to_thread(entered.wait, 10)
            t0 = time.monotonic()
            llm.shutdown(timeout=0.2)  # the step is still running: give up waiting, do not hang
            return time.monotonic() - t0

        assert run(main()) < 5 and llm._thread.is_alive()
    finally:
        release.set()
    llm._thread.join(10)
    assert not llm._thread.is_alive()
    waits, real_join = [], llm._thread.join
    monkeypatch.setattr(llm._thread, "join", lambda timeout=None: waits.append(timeout) or real_join(timeout))
    llm.shutdown()
    assert waits == [30.0]


def test_shutdown_refuses_the_adds_still_queued_and_skips_queued_aborts(make, monkeypatch):
    """A request added while a step runs waits in the command queue; a shutdown in that step ends
    the thread before the queue is read: the caller gets EngineDeadError, not a wait forever."""
    llm = make()
    entered, release = blocked_engine(llm, monkeypatch)
    try:
        async def main():
            running = await llm.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
            assert await asyncio.to_thread(entered.wait, 10)
            pending = asyncio.ensure_future(llm.add_request([4, 5], SamplingParams(max_tokens=2)))
            gone = asyncio.ensure_future(llm.add_request([6, 7], SamplingParams(max_tokens=2), "gone"))
            await asyncio.sleep(0)
            gone.cancel()  # a caller that gives up queues an abort behind its add
            await asyncio.sleep(0)
            assert [type(c) for c in llm._commands] == [_Add, _Add, _Abort] and gone.cancelled()
            stopper = threading.Thread(target=llm.shutdown)
            stopper.start()
            while not llm._stopping:
                await asyncio.sleep(0.01)
            release.set()
            with pytest.raises(EngineDeadError) as e:
                await asyncio.wait_for(pending, 10)
            assert str(e.value) == "the engine shut down before the request was added"
            last = [out async for out in running][-1]
            stopper.join(10)
            return last

        last = asyncio.run(main())
    finally:
        release.set()
    assert last.finished and last.finish_reason == "abort" and not llm.engine.requests


def test_each_turn_of_the_engine_loop_is_one_step_for_a_lone_request(make):
    llm = make()
    time.sleep(0.1)
    assert llm.num_wakeups == 0  # nothing to do yet: the thread waits from the start
    run(collect(llm, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    assert llm.engine.stats.steps == 4 and llm.num_wakeups == 4


class Bug(Exception):
    pass


@pytest.mark.parametrize("broken", ["nothing else", "abort", "publish"])
def test_a_bug_in_the_engine_thread_marks_it_dead_and_tells_every_caller(make, monkeypatch, caplog, broken):
    """A bug outside a step (here in _publish) ends the engine thread: it records why, logs it,
    ends each request with "abort", or, where the abort or the last publish fails too, raises
    EngineDeadError in its caller: nobody waits forever on a dead engine."""
    llm = make()
    real_publish, armed = llm._publish, []

    def publish():
        if armed:
            if broken != "publish":
                armed.clear()
            raise Bug("bug in publish")
        real_publish()

    def broken_abort(request_id):
        raise Bug(f"cannot abort {request_id}")

    monkeypatch.setattr(llm, "_publish", publish)
    if broken == "abort":
        monkeypatch.setattr(llm.engine, "abort", broken_abort)

    async def main():
        stream = await llm.add_request([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True), "r")
        got = []
        try:
            async for out in stream:
                got.append(out)
                armed.append(True)
        except EngineDeadError as e:
            assert stream.finished is True and [out async for out in stream] == []  # ended, not waiting
            return got, e
        return got, None

    with caplog.at_level(logging.ERROR, logger="nano_engine.serving.async_llm"):
        got, error = asyncio.run(asyncio.wait_for(main(), 20))
    llm._thread.join(10)
    assert not llm._thread.is_alive() and isinstance(llm.dead, Bug) and str(llm.dead) == "bug in publish"
    logged = [(r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert ("the engine thread died", True) in logged
    if broken == "nothing else":
        assert error is None and got[-1].finished and got[-1].finish_reason == "abort"
    else:
        assert not got[-1].finished and str(error) == "the engine stopped before request r finished (bug in publish)"
        assert {"abort": ("abort of r during shutdown failed", True),
                "publish": ("the last outputs could not be handed out", True)}[broken] in logged
    with pytest.raises(EngineDeadError) as e:
        run(llm.add_request([1], SamplingParams()))
    assert str(e.value) == "the engine is not running (bug in publish)"


def test_an_aborted_stream_ends_at_once_and_aborts_once(make):
    llm = make()
    sent = []

    async def main():
        stream = await llm.add_request([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True))
        real_submit = llm._submit
        llm._submit = lambda command: sent.append(command) or real_submit(command)
        assert stream.finished is False
        stream.abort()
        stream.abort()
        return stream, [out async for out in stream]

    stream, after = run(main())
    assert stream.finished is True and after == [] and sent == [_Abort(stream.request_id)]


def test_a_shutdown_that_cannot_abort_a_request_tells_its_caller(make, monkeypatch):
    llm = make()

    def broken_abort(request_id):
        raise Bug(f"cannot abort {request_id}")

    async def main():
        stream = await llm.add_request([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True), "r")
        await stream.__anext__()
        monkeypatch.setattr(llm.engine, "abort", broken_abort)
        threading.Thread(target=llm.shutdown).start()
        with pytest.raises(EngineDeadError) as e:
            async for _ in stream:
                pass
        return str(e.value)

    assert run(main()) == "the engine stopped before request r finished (shut down)"


def test_a_failing_on_output_is_logged_and_the_stream_goes_on(make, caplog):
    llm = make()

    def on_output(out):
        raise Bug("metrics are broken")

    llm.subscribe(on_output)
    with caplog.at_level(logging.ERROR, logger="nano_engine.serving.async_llm"):
        outs = run(collect(llm, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert sum(len(o.new_token_ids) for o in outs) == 3 and outs[-1].finished
    logged = {(r.getMessage(), str(r.exc_info[1])) for r in caplog.records}
    assert logged == {("on_output failed", "metrics are broken")}


def test_a_caller_whose_event_loop_closed_has_its_request_aborted(make):
    """asyncio.run closes its loop on return: a stream left unread there can never be handed an
    output, so the engine thread aborts its request at the next output and serves on."""
    llm = make(num_blocks=64, block_size=4)
    finals = []
    llm.subscribe(lambda out: finals.append((out.request_id, out.finish_reason)) if out.finished else None)
    asyncio.run(llm.add_request(list(range(1, 9)), SamplingParams(max_tokens=200, ignore_eos=True), "orphan"))
    assert wait_until(lambda: not llm.engine.requests)
    assert finals == [("orphan", "abort")] and llm.num_streams == 0
    assert llm.engine.block_pool.num_free == 64 and llm.dead is None and llm._thread.is_alive()
    outs = run(collect(llm, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
    assert sum(len(o.new_token_ids) for o in outs) == 2 and outs[-1].finish_reason == "length"


def test_a_shutdown_whose_abort_fails_still_tells_a_caller_behind_a_closed_loop_one(make, monkeypatch):
    """The engine cannot abort at shutdown, and the first stream's caller has closed its loop: it
    cannot be told, and must not be aborted again (that would fail too and leave the rest waiting)."""
    llm = make(max_num_seqs=1)

    def broken_abort(request_id):
        raise Bug(f"cannot abort {request_id}")

    async def main():
        first = await llm.add_request([1, 2, 3], SamplingParams(max_tokens=4000, ignore_eos=True), "first")
        await first.__anext__()  # running: the ones below wait (max_num_seqs=1) and get no output
        await asyncio.to_thread(asyncio.run, llm.add_request([4, 5], SamplingParams(max_tokens=2), "gone"))
        last = await llm.add_request([6, 7], SamplingParams(max_tokens=2), "last")
        assert list(llm._streams) == ["first", "gone", "last"]
        monkeypatch.setattr(llm.engine, "abort", broken_abort)
        threading.Thread(target=llm.shutdown).start()
        with pytest.raises(EngineDeadError) as e:
            await asyncio.wait_for(last.__anext__(), 10)
        return str(e.value)

    assert run(main()) == "the engine stopped before request last finished (shut down)"
    assert wait_until(lambda: not llm._thread.is_alive())


def test_a_request_that_waits_its_turn_does_not_hold_back_the_others_outputs(make):
    """Under the priority policy the later-added, more urgent request runs first: the one that waits
    (and so has no output) comes first in the engine thread's streams, and must not hold back the
    outputs of those after it: each step's token reaches its caller in that step."""
    llm = make(max_num_seqs=1, policy="priority")
    order = []
    llm.subscribe(lambda out: order.append((out.request_id, len(out.new_token_ids))))
    sp = SamplingParams(max_tokens=3, ignore_eos=True)

    async def main():
        with llm._cond:  # held: the engine thread takes both adds in one turn, so they meet in one step
            tasks = [asyncio.ensure_future(collect(llm, [1, 2, 3], sp, request_id="later", priority=1)),
                     asyncio.ensure_future(collect(llm, [4, 5, 6], sp, request_id="urgent", priority=0))]
            while len(llm._commands) < 2:
                await asyncio.sleep(0)
        return await asyncio.gather(*tasks)

    later, urgent = run(main())
    assert [len(o.new_token_ids) for o in urgent] == [1, 1, 1]  # one output per step, none held back
    assert order == [("urgent", 1)] * 3 + [("later", 1)] * 3
    assert [len(o.new_token_ids) for o in later] == [1, 1, 1]


def test_requests_without_a_priority_or_an_id_get_zero_and_a_fresh_id(make):
    llm = make()
    seen = []
    llm.subscribe(lambda out: None if out.finished else seen.append(
        (out.request_id, llm.engine.requests[out.request_id].priority)))  # a finished one is released
    for _ in range(2):
        run(collect(llm, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
    (a, pa), (b, pb) = seen
    assert pa == pb == 0 and a != b
    assert re.fullmatch(r"req-0-[0-9a-f]{8}", a) and re.fullmatch(r"req-1-[0-9a-f]{8}", b)


def test_after_shutdown_an_add_says_the_engine_shut_down(make):
    llm = make()
    llm.shutdown()
    with pytest.raises(EngineDeadError) as e:
        run(llm.add_request([1, 2], SamplingParams()))
    assert str(e.value) == "the engine is not running (shut down)"


def test_without_a_tokenizer_the_text_is_empty(make):
    outs = run(collect(make(), [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert [o.new_text for o in outs] == ["", "", ""] and [o.stop_reason for o in outs] == [None] * 3


class LettersTokenizer:
    """Every token reads "a": with the stop string "ab", the text always ends in what may begin it."""

    def decode(self, ids, **kwargs):
        return "a" * len(ids)


def test_a_held_back_tail_is_handed_out_with_the_last_output(tiny):
    llm = AsyncLLM(LLMEngine(tiny, LettersTokenizer()))
    try:
        outs = run(collect(llm, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True, stop=["ab"])))
    finally:
        llm.shutdown()
    assert [o.new_text for o in outs] == ["", "a", "a", "aa"]  # the last "a" might have begun "ab"
    assert outs[-1].finish_reason == "length" and outs[-1].stop_reason is None

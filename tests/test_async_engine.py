"""The async engine (serving/async_llm.py): concurrent callers, cancellation, idling, shutdown, failures.

A tiny random model, mostly without a tokenizer: token ids only (two toy tokenizers check where the
text comes from; text and stop strings proper are tested on the embedded model in test_server.py and
test_detokenizer.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from nano_engine import LLMEngine, SamplingParams
from nano_engine.serving.async_llm import AsyncLLM, EngineDeadError

PROMPTS = [list(range(1 + i, 6 + 3 * i)) for i in range(8)]
LONG = SamplingParams(max_tokens=500, ignore_eos=True)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))  # the tiny model: each request takes well under 1 s


@pytest.fixture
def make(tiny):
    made = []

    def build(tokenizer=None, on_output=None, **settings):
        llm = AsyncLLM(LLMEngine(tiny, tokenizer, **settings), on_output)
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
    return [o async for o in llm.generate(prompt, params, **kw)]


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


def finals_of(llm):
    """(request id, finish reason) of each request's last output, as the engine thread hands it out."""
    finals = []
    llm.subscribe(lambda out: finals.append((out.request_id, out.finish_reason)) if out.finished else None)
    return finals


def all_freed(llm):
    pool = llm.engine.block_pool
    return not llm.engine.requests and pool.num_free == pool.num_blocks and llm.num_streams == 0


# ----- callers -----
def test_concurrent_callers_get_generates_tokens_and_share_steps(tiny, make):
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [r.output_ids for r in LLMEngine(tiny).generate(PROMPTS, sp)]
    llm = make(max_num_batched_tokens=32, num_blocks=64, block_size=4)

    async def main():
        return await asyncio.gather(*(collect(llm, p, sp) for p in PROMPTS))

    results = run(main())
    for outs, want, prompt in zip(results, expected, PROMPTS):
        assert tokens(outs) == want
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert all(not o.finished for o in outs[:-1]) and all(o.new_text == "" for o in outs)  # no tokenizer
        assert sum(len(o.token_times) for o in outs) == len(want)
        assert outs[-1].num_output_tokens == len(want) and outs[-1].num_prompt_tokens == len(prompt)
    # Requests were batched together: some step ran several of them.
    assert max(rec.num_requests for rec in llm.engine.step_log) >= 4
    assert all_freed(llm)  # no request left in the engine, every block free


def test_a_request_that_waits_its_turn_does_not_hold_back_the_others_outputs(make):
    """Under the priority policy the more urgent requests run first, one at a time: "later", which waits
    (and so has no output), comes first in the engine thread's streams, and must not hold back the
    outputs of those after it: each step's token reaches its caller in that step. A request without
    a priority has priority 0 (it goes before "later"), and one without an id gets a fresh one."""
    llm = make(max_num_seqs=1, policy="priority")
    order = []
    llm.subscribe(lambda out: order.append((out.request_id, len(out.new_token_ids))))
    sp = SamplingParams(max_tokens=3, ignore_eos=True)

    async def main():
        with llm._cond:  # held: the engine thread takes the adds in one turn, so they meet in one step
            tasks = [asyncio.ensure_future(collect(llm, [1, 2, 3], sp, request_id="later", priority=1)),
                     asyncio.ensure_future(collect(llm, [4, 5, 6], sp, request_id="urgent", priority=0)),
                     asyncio.ensure_future(collect(llm, [7, 8, 9], sp))]
            while len(llm._commands) < 3:
                await asyncio.sleep(0)
        return await asyncio.gather(*tasks)

    results = run(main())
    anon = results[2][0].request_id
    assert anon not in ("", "later", "urgent") and {o.request_id for o in results[2]} == {anon}
    assert order == [("urgent", 1)] * 3 + [(anon, 1)] * 3 + [("later", 1)] * 3
    assert all([len(o.new_token_ids) for o in outs] == [1, 1, 1] for outs in results)  # none held back


def test_a_refused_request_raises_in_the_caller_and_queues_nothing(make):
    """What add_request refuses (test_errors.py, test_api_properties.py) raises in the caller's task."""
    llm = make(num_blocks=4, block_size=4)

    async def main():
        with pytest.raises(ValueError, match="max_tokens 20"):  # can never fit the pool
            await llm.add_request(list(range(1, 10)), SamplingParams(max_tokens=20))
        with pytest.raises(TypeError, match="request_id"):
            await llm.add_request([1, 2], SamplingParams(), request_id=5)
        return await collect(llm, [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))

    outs = run(main())
    assert tokens(outs) and all_freed(llm)


# ----- cancellation -----
def test_a_caller_that_cancels_aborts_or_goes_away_ends_its_request_and_frees_its_blocks(make):
    """Cancelled mid-stream inside `async with`, or stream.abort(): the request ends with "abort",
    the stream at once. asyncio.run closes its loop on return: a stream left unread there can never
    be handed an output, so the engine thread aborts its request at its next output. The other
    callers are served all along."""
    llm = make()
    finals = finals_of(llm)  # nobody reads an aborted request's last output: the hook sees it
    asyncio.run(llm.add_request(list(range(1, 9)), SamplingParams(max_tokens=200, ignore_eos=True), "orphan"))

    async def main():
        stream = await llm.add_request(list(range(1, 20)), SamplingParams(max_tokens=200, ignore_eos=True), "long")
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
        dropped = await llm.add_request([1, 2, 3], LONG, "dropped")
        dropped.abort()
        dropped.abort()  # a second abort is harmless
        assert dropped.finished is True and [out async for out in dropped] == []  # ended at once
        return await other

    outs = run(main())
    assert outs[-1].finish_reason == "length"
    assert wait_until(lambda: all_freed(llm), 10)
    assert {("orphan", "abort"), ("long", "abort"), ("dropped", "abort")} <= set(finals) and len(finals) == 4
    assert llm.dead is None


# ----- idling -----
def test_the_engine_thread_sleeps_when_idle_and_turns_once_per_step(make):
    llm = make()
    time.sleep(0.1)
    assert llm.num_wakeups == 0  # nothing to do yet: the thread waits from the start
    run(collect(llm, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    assert llm.engine.stats.steps == 4 and llm.num_wakeups == 4  # a lone request: one turn per step
    time.sleep(0.5)
    assert llm.engine.stats.steps == 4  # no step, idle or not, without work
    assert llm.num_wakeups == 4  # and no turn of the loop: it waits on its condition
    assert llm._thread.is_alive()


# ----- shutdown -----
def test_shutdown_aborts_what_is_left_refuses_new_requests_and_waits_no_longer_than_asked(make, monkeypatch):
    """A shutdown during a step returns after its timeout; the step ends, then the thread: the running
    request ends with "abort"; one added during the step, still waiting to be taken in, raises
    EngineDeadError in its caller, not a wait forever (the queued abort of a caller that gave up is
    harmless); so does any request added after."""
    llm = make()
    entered, release, real = threading.Event(), threading.Event(), llm.engine.runner.forward

    def forward(batch):  # the engine thread's forward pass waits for the test
        entered.set()
        assert release.wait(30), "the test never released the forward pass"
        return real(batch)

    monkeypatch.setattr(llm.engine.runner, "forward", forward)
    try:
        async def main():
            running = await llm.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
            assert await asyncio.to_thread(entered.wait, 10)
            pending = asyncio.ensure_future(llm.add_request([4, 5], SamplingParams(max_tokens=2)))
            gone = asyncio.ensure_future(llm.add_request([6, 7], SamplingParams(max_tokens=2), "gone"))
            await asyncio.sleep(0)
            gone.cancel()  # a caller that gives up queues an abort behind its add
            await asyncio.sleep(0)
            t0 = time.monotonic()
            llm.shutdown(timeout=0.2)  # the step is still running: give up waiting, do not hang
            assert time.monotonic() - t0 < 5 and llm._thread.is_alive() and gone.cancelled()
            release.set()
            with pytest.raises(EngineDeadError, match="shut down"):
                await asyncio.wait_for(pending, 10)
            return [out async for out in running][-1]

        last = run(main())
    finally:
        release.set()
    assert last.finished and last.finish_reason == "abort" and not llm.engine.requests
    llm._thread.join(10)
    assert not llm._thread.is_alive()
    with pytest.raises(EngineDeadError, match="shut down"):
        run(llm.add_request([1, 2], SamplingParams()))


class Bug(Exception):
    pass


def broken_abort(request_id):
    raise Bug(f"cannot abort {request_id}")


def test_a_shutdown_that_cannot_abort_still_tells_every_caller(make, monkeypatch):
    """The engine cannot abort at shutdown: the running and the waiting request's callers get
    EngineDeadError; a caller behind a closed event loop cannot be told, and must not hold up the rest."""
    llm = make(max_num_seqs=1)

    async def main():
        first = await llm.add_request([1, 2, 3], SamplingParams(max_tokens=4000, ignore_eos=True), "first")
        await first.__anext__()  # running: the ones below wait (max_num_seqs=1) and get no output
        await asyncio.to_thread(asyncio.run, llm.add_request([4, 5], SamplingParams(max_tokens=2), "gone"))
        last = await llm.add_request([6, 7], SamplingParams(max_tokens=2), "last")
        monkeypatch.setattr(llm.engine, "abort", broken_abort)
        threading.Thread(target=llm.shutdown).start()
        for stream in (first, last):
            with pytest.raises(EngineDeadError, match=f"request {stream.request_id} .*shut down"):
                async for _ in stream:
                    pass

    run(main())
    assert wait_until(lambda: not llm._thread.is_alive())


# ----- failures -----
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
    assert [str(r.exc_info[1]) for r in caplog.records] == ["injected fault"]  # logged once, with the cause
    again = run(collect(llm, [1, 2, 3], sp))
    assert tokens(again) == LLMEngine(tiny).generate([[1, 2, 3]], sp)[0].output_ids


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

    monkeypatch.setattr(llm, "_publish", publish)
    if broken == "abort":
        monkeypatch.setattr(llm.engine, "abort", broken_abort)

    async def main():
        stream = await llm.add_request([1, 2, 3], LONG, "r")
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
    assert not llm._thread.is_alive() and isinstance(llm.dead, Bug)
    assert any(r.exc_info and r.exc_info[1] is llm.dead for r in caplog.records)  # the crash is logged
    if broken == "nothing else":
        assert error is None and got[-1].finished and got[-1].finish_reason == "abort"
    else:
        assert not got[-1].finished and "request r " in str(error) and "bug in publish" in str(error)
    with pytest.raises(EngineDeadError, match="bug in publish"):
        run(llm.add_request([1], SamplingParams()))


# ----- making the engine, hooks and text -----
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
        outs = run(collect(llm, PROMPTS[3], SamplingParams(max_tokens=6, ignore_eos=True)))
        assert len(tokens(outs)) == 6 and outs[-1].finished
    finally:
        llm.shutdown()
    assert not llm._thread.is_alive()


def no_model():
    raise FileNotFoundError("no model at /nowhere")


@pytest.mark.parametrize("engine, error, text", [
    (no_model, FileNotFoundError, "no model at /nowhere"),
    (lambda: "not an engine", TypeError, "got str"),
    ("an engine", TypeError, "got str"),
])
def test_a_failing_engine_or_function_raises_here_and_leaves_no_thread(engine, error, text):
    before = set(threading.enumerate())
    with pytest.raises(error, match=text):
        AsyncLLM(engine)
    assert set(threading.enumerate()) <= before


class WordsTokenizer:
    """Enough of a tokenizer for the detokenizer: id i reads " w<i>"."""

    def decode(self, ids, **kwargs):
        return "".join(f" w{i}" for i in ids)


def test_hooks_see_every_output_and_text_comes_from_the_engines_tokenizer(make, caplog):
    """on_output and subscribers see every output (a failing one is logged and the rest go on); text
    comes from the engine's tokenizer, under the engine's lock; the thread is a daemon (a process that
    forgets shutdown() still exits)."""
    seen, later, tokenizer = [], [], WordsTokenizer()
    llm = make(tokenizer, seen.append)

    def broken(out):
        raise Bug("metrics are broken")

    llm.subscribe(broken)
    llm.subscribe(later.append)
    assert llm._thread.daemon and llm.tokenizer is tokenizer
    assert llm.tokenizer_lock is llm.engine.tokenizer_lock
    with caplog.at_level(logging.ERROR, logger="nano_engine.serving.async_llm"):
        outs = run(collect(llm, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
    assert len(outs) == 2 and outs[-1].finished and seen == outs and later == outs
    assert "".join(o.new_text for o in outs) == tokenizer.decode(tokens(outs))
    assert {str(r.exc_info[1]) for r in caplog.records} == {"metrics are broken"}


class SpelledTokenizer(WordsTokenizer):
    """WordsTokenizer that also encodes (a character's id is its code point mod 64), counting the calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, text, add_special_tokens=False):
        self.calls += 1
        return {"input_ids": [ord(c) % 64 for c in text]}


def test_bad_words_are_prepared_off_the_engine_thread_while_the_others_run(make, monkeypatch):
    """add_request has the engine prepare a request's bad words (and grammar: a large schema compiles for
    seconds) in a worker thread before it joins the engine: while that runs, the other requests' steps go
    on; the engine then takes what was prepared instead of tokenizing again."""
    tokenizer = SpelledTokenizer()
    llm = make(tokenizer)
    gate, entered, real = threading.Event(), threading.Event(), llm.engine.prepare
    threads = []

    def slow_prepare(params):
        threads.append(threading.current_thread())
        entered.set()
        assert gate.wait(20)
        real(params)

    monkeypatch.setattr(llm.engine, "prepare", slow_prepare)
    banned = SamplingParams(max_tokens=3, ignore_eos=True, bad_words=("xy", "z"))

    async def main():
        other = asyncio.ensure_future(collect(llm, [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)))
        waiting = asyncio.ensure_future(collect(llm, [4, 5], banned, request_id="banned"))
        assert await asyncio.to_thread(entered.wait, 20)
        done = await other  # to its end, while the preparation waits
        calls = tokenizer.calls
        gate.set()
        return done, await waiting, calls

    done, outs, calls = run(main())
    assert len(tokens(done)) == 20 and len(tokens(outs)) == 3 and calls == 0
    assert threads and llm._thread not in threads
    assert tokenizer.calls == 4  # two spellings of each word, in prepare; none in add_request


class LettersTokenizer:
    """Every token reads "a": with the stop string "ab", the text always ends in what may begin it."""

    def decode(self, ids, **kwargs):
        return "a" * len(ids)


def test_a_held_back_tail_is_handed_out_with_the_last_output(make):
    llm = make(LettersTokenizer())
    outs = run(collect(llm, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True, stop=["ab"])))
    assert [o.new_text for o in outs] == ["", "a", "a", "aa"]  # the last "a" might have begun "ab"
    assert outs[-1].finish_reason == "length" and outs[-1].stop_reason is None


def test_a_request_added_after_another_waits_for_its_prompt_and_shares_its_blocks(make):
    """Parallel sampling: children added with `after=` the first reach the engine once it has computed
    the prompt, so each computes only what the prefix cache lacks; a refusal comes out of the stream."""
    # The prompt takes two steps (16 + 14 tokens): children let in after the first would find only
    # its first half cached, and the second step's 2 spare tokens would start them on the rest.
    llm = make(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    prompt = list(range(1, 31))  # 7 full blocks and 2 tokens

    async def main():
        first = await llm.add_request(prompt, SamplingParams(max_tokens=3), "0_r")
        rest = [await llm.add_request(prompt, SamplingParams(max_tokens=3, seed=i), f"{i}_r", after="0_r")
                for i in (1, 2)]
        outs = [[o async for o in s] for s in (first, *rest)]
        bad = await llm.add_request([10 ** 6], SamplingParams(), "bad", after="0_r")  # after a released request
        with pytest.raises(ValueError, match="vocabulary"):
            [o async for o in bad]
        return outs

    outs = run(main())
    assert all(o[-1].finished for o in outs)
    computed = {}
    for rec in llm.engine.step_log:
        for rid, n, kind in rec.scheduled:
            if kind == "prefill":
                computed[rid] = computed.get(rid, 0) + n
    assert computed == {"0_r": 30, "1_r": 2, "2_r": 2}
    assert [o[0].num_cached_tokens for o in outs] == [0, 28, 28]

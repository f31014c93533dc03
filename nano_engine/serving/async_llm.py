"""The async engine: one LLMEngine serving many concurrent callers.

A server answers requests on an asyncio event loop, while one forward pass of the model blocks for
tens to hundreds of milliseconds. So the engine loop runs in its own thread, as vLLM's `AsyncLLM`
runs its EngineCore in a separate process (`vllm/v1/engine/async_llm.py`, `core_client.py`):

* callers never touch the `LLMEngine`: `add_request` and aborts become commands in a queue, which
  the engine thread applies between two steps (vLLM: requests enter the core between steps too);
* the engine thread steps while any request is unfinished and otherwise sleeps on a condition
  variable until a command arrives (no busy spin);
* after each step it turns every request's new tokens into a `RequestOutput` (new token ids, new
  text, their times) and hands it to that request's asyncio queue, on the caller's event loop
  (`loop.call_soon_threadsafe`: asyncio objects are not thread-safe);
* text is made by an `IncrementalDetokenizer` per request (detokenizer.py). A request with stop
  strings (`SamplingParams.stop`) gets its detokenizer from the LLMEngine, which finishes it with
  "stop" in the step whose token completes one (vLLM's OutputProcessor does this in
  `vllm/v1/engine/output_processor.py`, then aborts the request in the core); the stream reads
  its text from there, so the text is decoded once;
* a caller that stops listening (a closed stream, a cancelled task, a client gone) aborts its
  request, so its blocks come back; a finished request is released from the engine right after
  its last output, so a server that runs for days holds only the requests in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from ..detokenizer import IncrementalDetokenizer
from ..engine import LLMEngine
from ..request import SamplingParams
from ..executor import WorkerError

logger = logging.getLogger(__name__)
THREAD_NAME = "nano_engine-core"


@dataclass
class RequestOutput:
    """What one step added to one request (vLLM's RequestOutput in DELTA mode)."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_times: list[float]  # time.perf_counter() when each new token was sampled
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache at admission
    num_output_tokens: int  # all output tokens so far
    arrival_time: float  # time.perf_counter() when the request was added
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # One sampling.SampleLogprobs per new token (from the raw logits), if the request asked for logprobs
    logprobs: list | None = None
    # With prompt_logprobs: one per prompt token (None for the first), in the request's first output
    prompt_logprobs: list | None = None
    first_scheduled_time: float | None = None  # time.perf_counter() when its first step began
    num_draft_tokens: int = 0  # speculative decoding: drafts checked so far, and of them kept
    num_accepted_tokens: int = 0
    error: str | None = None  # with "error": why, when the request's own constraints left no token (Request.error)


class EngineDeadError(RuntimeError):
    """The engine thread is gone (shut down, or it crashed): no request can be served."""


@dataclass
class _Stream:
    """The engine thread's view of one caller."""
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    detokenizer: IncrementalDetokenizer | None
    num_sent: int = 0  # output tokens already handed out
    sent_any: bool = False  # has an output gone out (the first carries the prompt logprobs)


@dataclass
class _Add:
    """A command to the engine thread: add this request, then settle `accepted` (None or the refusal)."""
    stream: _Stream
    prompt_ids: Sequence[int]
    params: SamplingParams | None
    priority: int
    cache_salt: str | None
    accepted: asyncio.Future
    after: str | None = None  # added only once this request has computed its prompt (add_request)

    @property
    def awaited(self) -> bool:
        """Does the caller await `accepted` (else a refusal goes to the stream)?"""
        return self.after is None


@dataclass
class _Abort:
    """A command to the engine thread: abort this request, if the engine still has it unfinished."""
    request_id: str


class RequestStream:
    """The outputs of one request, as an async iterator. Leaving it early aborts the request:
    use `async with`, or call `abort()` in a `finally`."""

    def __init__(self, owner: "AsyncLLM", request_id: str, queue: asyncio.Queue):
        self.request_id, self._owner, self._queue = request_id, owner, queue
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._queue.get()
        if isinstance(out, BaseException):
            self.finished = True
            raise out
        self.finished = out.finished
        return out

    def abort(self) -> None:
        """Stop the request and free its blocks (nothing happens once it has finished)."""
        if not self.finished:
            self.finished = True
            self._owner._submit(_Abort(self.request_id))

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


class AsyncLLM:
    """Serve one LLMEngine to concurrent asyncio callers from an engine thread.

    `on_output(output)` is called in the engine thread for every output (the
    server's metrics use it). `shutdown()` stops the thread; unfinished requests end with "abort".
    """

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine],
                 on_output: Callable[[RequestOutput], None] | None = None):
        """`engine`: an LLMEngine, or a function that makes one, called in the engine thread (load
        the model there); whatever it raises is raised here, and no thread is left behind.

        Pass a function where speed matters (the server does). torch runs its operators on OpenMP,
        and GNU OpenMP keeps a team of worker threads for every thread that ever ran a parallel
        region. Once there are more such workers than cores, each one sleeps at the end of every
        region instead of spinning, and waking them costs time in every one of a step's hundreds
        of operators. A model loaded on the caller's thread and stepped on the engine thread
        leaves two teams behind: on 2 cores that made a decode step about twice as long. Made in
        the engine thread, it is the only one that runs torch (as vLLM's EngineCore process loads
        and steps its model in one thread).
        """
        if not (isinstance(engine, LLMEngine) or callable(engine)):
            raise TypeError(f"engine must be an LLMEngine or a function that makes one, got {type(engine).__name__}")
        self._listeners: list[Callable[[RequestOutput], None]] = [on_output] if on_output else []
        self._step_listeners: list[Callable[[int], None]] = []
        self.engine: LLMEngine | None = None  # set by the engine thread before anything else runs
        self._cond = threading.Condition()
        self._commands: deque[_Add | _Abort] = deque()
        self._deferred: list[_Add] = []  # engine thread only: adds waiting for their `after` request
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._ids = itertools.count()
        self._stopping = False
        self.dead: BaseException | None = None  # why the engine thread stopped, if it did
        self.num_wakeups = 0  # turns of the engine loop: flat while idle (no busy spin)
        ready, failure = threading.Event(), []

        def make_then_run() -> None:
            try:
                made = engine if isinstance(engine, LLMEngine) else engine()
                if not isinstance(made, LLMEngine):
                    raise TypeError(f"the engine function must return an LLMEngine, got {type(made).__name__}")
                self.engine = made
            except BaseException as e:
                failure.append(e)
                return
            finally:
                ready.set()
            self._run()

        self._thread = threading.Thread(target=make_then_run, name=THREAD_NAME, daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]

    def subscribe_steps(self, on_step: Callable[[int], None]) -> None:
        """Call `on_step(num_tokens)` in the engine thread after each step that computed tokens."""
        with self._cond:
            self._step_listeners = [*self._step_listeners, on_step]

    def _stepped(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        for listener in self._step_listeners:
            try:
                listener(num_tokens)
            except Exception:
                logger.exception("on_step failed")

    def subscribe(self, on_output: Callable[[RequestOutput], None]) -> None:
        """Call `on_output(output)` in the engine thread for every output from now on."""
        with self._cond:
            self._listeners = [*self._listeners, on_output]  # a new list: the engine thread may be reading

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def tokenizer_lock(self) -> threading.Lock:
        """Fast tokenizers are not safe to call from two threads at once ("Already borrowed"): the
        server encodes on the event loop while the engine thread decodes. One lock, the engine's."""
        return self.engine.tokenizer_lock

    # ----- the callers' side (event loop) -----
    async def add_request(self, prompt_ids: Sequence[int], sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, *, priority: int = 0,
                          cache_salt: str | None = None, after: str | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it. Raises the engine's
        TypeError / ValueError for a request it refuses (nothing is queued then). Stop strings are
        `sampling_params.stop`, as in vLLM.

        `after`: the id of a request with the same prompt (parallel sampling, n > 1). This one
        is added to the engine only once that one has computed its prompt, so that the prefix
        cache hands it the prompt's full blocks instead of computing them again (requests admitted
        in one step would each compute it: a block is named only once its KV is written). The stream
        is returned at once; a refusal by the engine then comes out of it, as its first item.
        """
        self._check_alive()
        sp = sampling_params
        if isinstance(sp, SamplingParams) and (sp.structured_outputs is not None or sp.bad_words):
            # A grammar compiles (a large schema for seconds) and bad words are tokenized in a worker thread:
            # the engine thread, where add_request runs, goes on stepping the other requests meanwhile.
            await asyncio.to_thread(self.engine.prepare, sp)
        loop = asyncio.get_running_loop()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        queue: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        stream = _Stream(request_id, loop, queue, None)
        self._submit(_Add(stream, prompt_ids, sampling_params, priority, cache_salt, accepted, after))
        try:
            if after is None:
                await accepted
        except asyncio.CancelledError:
            self._submit(_Abort(request_id))  # it may have been added meanwhile
            raise
        return RequestStream(self, request_id, queue)

    async def generate(self, prompt_ids: Sequence[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, **kwargs) -> AsyncIterator[RequestOutput]:
        """add_request, then its outputs; the request is aborted if the caller stops early."""
        stream = await self.add_request(prompt_ids, sampling_params, request_id, **kwargs)
        async with stream:
            async for out in stream:
                yield out

    def _submit(self, command: _Add | _Abort) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _check_alive(self) -> None:
        if self.dead is not None or self._stopping:
            raise EngineDeadError(f"the engine is not running ({self.dead or 'shut down'})")

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step; unfinished requests end with "abort"."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    # ----- the engine thread -----
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or self._deferred or self.engine.has_unfinished()):
                        self._cond.wait()
                    if self._stopping:
                        break
                    self.num_wakeups += 1
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    self._apply(command)
                self._add_deferred()
                if self.engine.has_unfinished():
                    tokens = self.engine.stats.tokens
                    try:
                        self.engine.step()
                    except WorkerError:  # a rank (tensor or pipeline parallel) is gone: no step can run again
                        raise
                    except Exception:  # the engine finished that step's requests with "error"
                        logger.exception("engine step %d failed", self.engine.stats.steps - 1)
                    self._stepped(self.engine.stats.tokens - tokens)
                self._publish()
        except BaseException as e:  # a bug here, or a dead rank: callers must not wait forever
            self.dead = e
            logger.exception("the engine thread died")
        finally:
            self._close_all()
            self.engine.close()  # the worker processes, if any

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            if command.request_id in self.engine.requests:
                self.engine.abort(command.request_id)
            else:  # not added yet: it never will be
                self._deferred = [d for d in self._deferred if d.stream.request_id != command.request_id]
            return
        caching = self.engine.config.cache_config.enable_prefix_caching
        if command.after is not None and caching and command.after in self.engine.requests:
            self._deferred.append(command)
            return
        self._add(command)

    def _add(self, command: _Add) -> None:
        stream, request_id = command.stream, command.stream.request_id
        try:
            self.engine.add_request(command.prompt_ids, command.params, request_id, priority=command.priority,
                                    cache_salt=command.cache_salt)
        except Exception as e:
            if command.awaited:
                stream.loop.call_soon_threadsafe(_settle, command.accepted, e)
            else:
                self._deliver(stream, e)
            return
        # Text: the engine's detokenizer for a request with stop strings, else one of our own.
        req = self.engine.requests[request_id]
        if req.detokenizer is not None:
            stream.detokenizer = req.detokenizer
        elif self.tokenizer is not None:
            stream.detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=req.sampling_params.skip_special_tokens)
        self._streams[request_id] = stream
        stream.loop.call_soon_threadsafe(_settle, command.accepted, None)

    def _add_deferred(self) -> None:
        """Add the deferred requests whose `after` request has computed its prompt (or is gone)."""
        waiting = []
        for command in self._deferred:
            first = self.engine.requests.get(command.after)
            if first is None or first.is_finished or first.num_computed >= first.num_prompt_tokens:
                self._add(command)
            else:
                waiting.append(command)
        self._deferred = waiting

    def _publish(self) -> None:
        """Hand every request's new tokens (and text) to its caller; release the finished."""
        for rid, stream in list(self._streams.items()):
            req = self.engine.requests[rid]
            new_ids = req.output_ids[stream.num_sent:]
            if not new_ids and not req.is_finished:
                continue
            text, detok = "", stream.detokenizer
            if detok is not None:
                if detok is not req.detokenizer:  # our own: text only (the engine's is up to date)
                    with self.tokenizer_lock:
                        detok.update(new_ids)
                text = detok.take_delta(finished=req.is_finished)
            sp = req.sampling_params
            out = RequestOutput(
                request_id=rid, new_token_ids=list(new_ids), new_text=text,
                token_times=list(req.token_times[stream.num_sent:]), num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=max(req.num_cached_tokens, 0), num_output_tokens=len(req.output_ids),
                arrival_time=req.arrival_time, finished=req.is_finished, finish_reason=req.finish_reason,
                stop_reason=req.stop_reason if req.is_finished else None, error=req.error,
                logprobs=list(req.logprobs[stream.num_sent:]) if sp.logprobs is not None else None,
                prompt_logprobs=(list(req.prompt_logprobs) if sp.prompt_logprobs is not None and not stream.sent_any
                                 else None),
                first_scheduled_time=req.first_scheduled_time, num_draft_tokens=req.num_draft_tokens,
                num_accepted_tokens=req.num_accepted_tokens)
            stream.sent_any = True
            stream.num_sent = len(req.output_ids)
            if req.is_finished:
                self.engine.release(rid)
                del self._streams[rid]
            self._deliver(stream, out)

    def _deliver(self, stream: _Stream, item) -> None:
        if isinstance(item, RequestOutput):
            for listener in self._listeners:
                try:
                    listener(item)
                except Exception:
                    logger.exception("on_output failed")
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            if isinstance(item, RequestOutput) and not item.finished:
                # As a cancelled caller's abort: applied in the next turn, whose _publish then
                # hands out its "abort" output (on_output counts it) and releases it.
                self._submit(_Abort(stream.request_id))

    def _close_all(self) -> None:
        """On shutdown (or a crash): abort what is left, tell every caller, refuse queued adds."""
        for command in [*self._commands, *self._deferred]:
            if isinstance(command, _Add):
                error = EngineDeadError("the engine shut down before the request was added")
                if command.awaited:
                    command.stream.loop.call_soon_threadsafe(_settle, command.accepted, error)
                else:  # its caller listens to the stream
                    self._deliver(command.stream, error)
        self._commands.clear()
        self._deferred.clear()
        for rid in list(self._streams):
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("abort of %s during shutdown failed", rid)
        if not isinstance(self.dead, WorkerError):  # a dead rank ended its step's requests: they hear why below
            try:
                self._publish()
            except Exception:
                logger.exception("the last outputs could not be handed out")
        # A request the broken engine could not end: its caller hears why instead of waiting forever.
        for rid, stream in list(self._streams.items()):
            del self._streams[rid]
            why = self.dead or "shut down"
            self._deliver(stream, EngineDeadError(f"the engine stopped before request {rid} finished ({why})"))


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


__all__ = ["AsyncLLM", "EngineDeadError", "RequestOutput", "RequestStream"]

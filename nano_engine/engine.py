"""The engine loop: requests in, one scheduled forward pass per step, tokens out.

`LLMEngine.step()` is three calls, as in vLLM V1's `vllm/v1/engine/core.py` (EngineCore.step):
schedule, run the model, update the requests from its output. A step that raises finishes its
requests with finish_reason "error" and frees their blocks before the exception leaves, so the
engine stays usable. Each step is recorded in `step_log` (steplog.py: who got how many tokens,
preemptions, free blocks, queue lengths; the most recent `step_log_size` steps), which is what
the chapters' traces and timelines are drawn from. Finished requests stay in `requests` until
`release()` (as vLLM's output processor drops a request once its final output is out).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields
from typing import Sequence

import torch

from . import checks
from .mini_llm import Transformer
from .detokenizer import IncrementalDetokenizer
from .paged import BlockPool, CacheConfig
from .policies import scheduler_class
from .request import Request, RequestStatus, SamplingParams
from .runner import ATTENTION_BACKENDS, ModelRunner, SeqChunk, build_batch
from . import sampling
from .sampling import SamplingMetadata, sample
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .spec_decode import SpeculativeConfig, make_proposer
from .steplog import EngineStats, StepRecord
from .executor import ParallelConfig, ParallelRunner
from .kv_transfer import KVTransferConfig, make_connector


@dataclass
class EngineConfig:
    """The engine's settings: the scheduler's, the KV cache's and the processes', each a config that
    checks itself when it is made, and the engine's own (as vLLM's VllmConfig holds a
    SchedulerConfig, a CacheConfig and a ParallelConfig, `vllm/config/vllm.py`).
    `EngineConfig.from_settings(max_num_batched_tokens=64, num_blocks=10)` takes the flat names of
    vLLM's EngineArgs and hands each to its config."""

    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    # "torch": the chapters' attention; "c": one compiled call per layer (kernels/paged_attention.py);
    # "auto": c where it runs the model's dtype and builds here, else torch (what serve runs).
    attention_backend: str = "torch"
    step_log_size: int = 10_000  # records kept in LLMEngine.step_log, the most recent ones; 0 = none
    # Speculative decoding (spec_decode.py), vLLM's speculative_config: a SpeculativeConfig or a dict
    # such as {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}; None = off.
    speculative_config: SpeculativeConfig | None = None
    # Disaggregated prefill (kv_transfer.py), vLLM's kv_transfer_config: a KVTransferConfig or a dict
    # such as {"kv_role": "kv_consumer", "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}.
    kv_transfer_config: KVTransferConfig | None = None

    def __post_init__(self):
        checks.instance("scheduler_config", self.scheduler_config, SchedulerConfig, "a SchedulerConfig")
        checks.instance("cache_config", self.cache_config, CacheConfig, "a CacheConfig")
        checks.instance("parallel_config", self.parallel_config, ParallelConfig, "a ParallelConfig")
        self.attention_backend = checks.choice("attention_backend", self.attention_backend,
                                               ("auto", *ATTENTION_BACKENDS))
        # A deque's maxlen is a C ssize_t: refuse more here rather than deep inside LLMEngine.
        self.step_log_size = checks.integer("step_log_size", self.step_log_size, minimum=0, maximum=sys.maxsize)
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        self.kv_transfer_config = KVTransferConfig.of(self.kv_transfer_config)
        if self.kv_transfer_config is not None and self.parallel_config.world_size > 1:
            raise ValueError("kv_transfer_config with tensor or pipeline parallelism: not yet, one process only")

    @classmethod
    def from_settings(cls, **settings) -> "EngineConfig":
        """An EngineConfig from flat settings, each to the config whose field it is."""
        parts = {"scheduler_config": SchedulerConfig, "cache_config": CacheConfig, "parallel_config": ParallelConfig}
        names = {f.name: part for part in parts.values() for f in fields(part)}
        names.update({f.name: cls for f in fields(cls) if f.name not in parts})
        unknown = sorted(set(settings) - set(names))
        if unknown:
            raise TypeError(f"unknown engine settings {unknown}; allowed: {', '.join(names)}")
        groups = {kind: {} for kind in (*parts.values(), cls)}
        for name, value in settings.items():
            groups[names[name]][name] = value
        return cls(**{key: part(**groups[part]) for key, part in parts.items()}, **groups[cls])


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer=None, config: EngineConfig | None = None,
                 scheduler_cls: type[Scheduler] | None = None, block_pool_cls: type[BlockPool] | None = None,
                 **settings):
        """Settings come as `config` or as keywords (EngineConfig.from_settings). `scheduler_cls`
        swaps in another Scheduler, `block_pool_cls` another BlockPool (a learner's, in the
        exercises); by default the config's policy picks the scheduler (policies.scheduler_class)."""
        checks.instance("model", model, Transformer, "a nano_engine Transformer (Transformer.from_pretrained(path) "
                        "or nano_engine.tiny.tiny_model())")
        if isinstance(tokenizer, (EngineConfig, dict)):
            raise TypeError("the second argument is the tokenizer: pass settings as config=EngineConfig(...) "
                            "or as keywords")
        checks.instance("config", config, (EngineConfig, type(None)), "an EngineConfig or None (or pass the "
                        "settings as keywords, e.g. LLMEngine(model, max_num_batched_tokens=64))")
        if config is not None and settings:
            raise ValueError("pass either config or keyword settings, not both")
        for name, cls in (("scheduler_cls", scheduler_cls), ("block_pool_cls", block_pool_cls)):
            if cls is not None and not isinstance(cls, type):
                raise TypeError(f"{name} must be a class, got {cls!r}")
        self.config = config or EngineConfig.from_settings(**settings)
        cache, sched = self.config.cache_config, self.config.scheduler_config
        self.model, self.tokenizer = model, tokenizer
        # Fast tokenizers are not safe to call from two threads at once ("Already borrowed"): the
        # engine decodes stop-string requests' text while a server may be encoding prompts.
        self.tokenizer_lock = threading.Lock()
        # The KV cache first: it refuses a pool larger than memory before anything is allocated.
        if self.config.parallel_config.world_size == 1:
            self.runner = ModelRunner(model, cache.num_blocks, cache.block_size, self.config.attention_backend)
        else:  # the ranks start here, each with its part of the model and of every block (executor.py)
            self.runner = ParallelRunner(model, cache.num_blocks, cache.block_size,
                                         self.config.attention_backend, self.config.parallel_config)
        try:
            self.block_pool = (block_pool_cls or BlockPool)(cache.num_blocks, cache.enable_prefix_caching)
            self.scheduler = (scheduler_cls or scheduler_class(sched.policy))(sched, self.block_pool, cache.block_size)
            spec = self.config.speculative_config
            self.proposer = make_proposer(spec, model, self.runner.attention_backend) if spec is not None else None
            self.kv_connector = make_connector(self.config.kv_transfer_config, cache.block_size)
            self.scheduler.kv_connector = self.kv_connector
        except BaseException:
            self.close()  # no worker left behind by an engine that never was
            raise
        eos = model.config.eos_token_id
        self.eos_token_ids = {eos} if isinstance(eos, int) else set(eos or ())
        self.requests: dict[str, Request] = {}  # unfinished ones, and finished ones not yet released
        self.step_log: deque[StepRecord] = deque(maxlen=self.config.step_log_size)
        self.stats = EngineStats()
        self._next_id = 0  # automatic request ids: the lowest free number from here
        self._num_added = 0  # arrival order (Request.seq)
        self._added: list[str] = []  # events since the last record
        self._aborted: list[str] = []
        self._drafts: list[tuple[str, int, int]] = []  # this step's verifications: (request_id, drafts, kept)
        self._t0 = time.perf_counter()
        self._grammars = None  # structured.GrammarCompiler, made for the first structured-output request
        # prepare()'s work, for add_request to find: bad words' token ids by the words (a few lists)
        self._prepared_words: OrderedDict[tuple[str, ...], list[list[int]]] = OrderedDict()
        self._prepare_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path=None, dtype=None, **kwargs) -> "LLMEngine":
        """The embedded model (or `path`, or $NANO_ENGINE_MODEL) with its tokenizer."""
        from .models.loading import load_tokenizer

        model = Transformer.from_pretrained(path, dtype=dtype or torch.float32)
        return cls(model, load_tokenizer(path), **kwargs)

    def close(self) -> None:
        """Stop the engine's worker processes (tensor or pipeline parallelism); nothing to do with one process.
        Steps after it fail; requests still unfinished stay as they are."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----- requests -----
    def add_request(self, prompt_ids: Sequence[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> str:
        """Queue a request; returns its id. Refuses (TypeError, ValueError) anything that could never run,
        before changing anything. Requests share cached prefix blocks only when their `cache_salt` is
        the same (None: no salt), so one user's prompts cannot be probed by another's timings."""
        return self._add(prompt_ids, sampling_params, request_id, priority, arrival_time, "prompt_ids", cache_salt)

    def _add(self, prompt_ids, sampling_params, request_id, priority, arrival_time, name: str,
             cache_salt: str | None = None) -> str:
        params = checks.instance("sampling_params", sampling_params, (SamplingParams, type(None)),
                                 "a SamplingParams or None") or SamplingParams()
        ids = checks.token_ids(name, prompt_ids, self.model.config.vocab_size)
        if not ids:
            raise ValueError(f"{name} is empty: a request needs at least one prompt token")
        total = len(ids) + params.max_tokens
        max_len = self.model.config.max_position_embeddings
        if total > max_len:
            raise ValueError(f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) = {total} tokens, "
                             f"above the model's max_position_embeddings={max_len}")
        vocab = self.model.config.vocab_size
        for token in params.logit_bias or ():
            if token >= vocab:
                raise ValueError(f"logit_bias key {token} is outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs={params.logprobs} must be <= the vocabulary size {vocab}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} must be <= the vocabulary size {vocab}")
        for i, t in enumerate(params.allowed_token_ids or ()):
            if t >= vocab:
                raise ValueError(f"allowed_token_ids[{i}]={t} is outside the vocabulary [0, {vocab})")
        if params.min_tokens > 0 and params.allowed_token_ids is not None and set(params.allowed_token_ids) <= (
                set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)):
            raise ValueError(f"allowed_token_ids={list(params.allowed_token_ids)} holds only EOS and stop tokens, "
                             f"which min_tokens={params.min_tokens} masks: no first token could be sampled")
        if params.bad_words and self.tokenizer is None:
            raise ValueError(f"bad_words={list(params.bad_words)!r} needs a tokenizer (they are text), and this "
                             f"engine has none: LLMEngine(model, tokenizer) or LLMEngine.from_pretrained()")
        grammar = None
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer (a grammar is over the tokens' text), and this "
                                 "engine has none: LLMEngine(model, tokenizer) or LLMEngine.from_pretrained()")
            grammar = self._grammar(params.structured_outputs)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={list(params.stop)!r} needs a tokenizer (stop strings are text), and this "
                             f"engine has none: LLMEngine(model, tokenizer) or LLMEngine.from_pretrained()")
        priority = checks.integer("priority", priority)
        cache_salt = checks.cache_salt(cache_salt)
        if arrival_time is not None:
            arrival_time = checks.number("arrival_time", arrival_time)
        if request_id is None:
            auto = self._next_id
            while str(auto) in self.requests:  # never collide with an id the caller chose
                auto += 1
            rid = str(auto)
        else:
            rid = checks.request_id(request_id)
            if rid in self.requests:
                state = "finished but not released" if self.requests[rid].is_finished else "unfinished"
                raise ValueError(f"request_id={rid!r} is already in use ({state}); release() a finished "
                                 f"request to reuse its id")
        req = Request(rid, ids, params, priority=priority, seq=self._num_added, cache_salt=cache_salt,
                      arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        if params.stop:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                                     params.skip_special_tokens, params.min_tokens)
        if params.bad_words:
            req.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        req.grammar = grammar
        self.scheduler.add_request(req)  # may refuse a request that can never fit
        self.requests[rid] = req
        self._num_added += 1
        if request_id is None:
            self._next_id = int(rid) + 1
        self._added.append(rid)
        return rid

    def prepare(self, sampling_params: SamplingParams) -> None:
        """Do the slow part of add_request for these params now, from any thread: compile their grammar
        (the compiler keeps it) and tokenize their bad words (kept for add_request). A large schema takes
        seconds to compile and a long word list to tokenize; AsyncLLM calls this in a worker thread, so
        that the engine thread, which add_request runs on, goes on stepping the other requests. Raises
        the ValueError add_request would raise for them."""
        params = checks.instance("sampling_params", sampling_params, SamplingParams, "a SamplingParams")
        if params.structured_outputs is not None and self.tokenizer is not None:
            self._compiler().compile(params.structured_outputs)  # xgrammar lets other threads run meanwhile
        if params.bad_words and self.tokenizer is not None:
            seqs = self._tokenize_bad_words(params.bad_words)
            with self._prepare_lock:
                self._prepared_words[params.bad_words] = seqs
                while len(self._prepared_words) > 16:  # a few requests' worth, never more
                    self._prepared_words.popitem(last=False)

    def _compiler(self):
        from .structured import GrammarCompiler

        with self._prepare_lock:  # made once, by whichever thread comes first
            if self._grammars is None:
                with self.tokenizer_lock:
                    self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size,
                                                     self.eos_token_ids)
            return self._grammars

    def _grammar(self, params):
        """A matcher of this structured-output request's grammar (the compiler keeps compiled grammars)."""
        compiler = self._compiler()
        return compiler.matcher(compiler.compile(params))

    def _bad_words_token_ids(self, words) -> list[list[int]]:
        """Each bad word's tokens as it would start the text and as it would follow a space (BPE
        tokenizers spell the two differently); each distinct sequence once. prepare()'s, if it ran."""
        with self._prepare_lock:
            seqs = self._prepared_words.pop(tuple(words), None)
        return seqs if seqs is not None else self._tokenize_bad_words(words)

    def _tokenize_bad_words(self, words) -> list[list[int]]:
        seqs: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for word in words:
            with self.tokenizer_lock:  # a word at a time: the engine thread decodes in between
                found = [[int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
                         for text in (word.lstrip(), " " + word.lstrip())]
            for ids in found:
                if ids and tuple(ids) not in seen:
                    seen.add(tuple(ids))
                    seqs.append(ids)
        return seqs

    def _get(self, request_id) -> Request:
        req = self.requests.get(checks.request_id(request_id))
        if req is None:
            raise KeyError(f"no request with id {request_id!r} (released, or never added)")
        return req

    def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        """Stop a request and free everything it holds (nothing happens if it has finished).
        finish_reason "stop": the caller decided the output is complete (stop strings in
        SamplingParams are found by the engine itself, in the step that completes them)."""
        req = self._get(request_id)
        finish_reason = checks.choice("finish_reason", finish_reason, ("abort", "stop"))
        if not req.is_finished:
            self.scheduler.finish(req, finish_reason)
            if self.proposer is not None:
                self.proposer.forget(req.request_id)
            if request_id in self._added:  # no step has seen it: it leaves no trace in the log
                self._added.remove(request_id)
            else:
                self._aborted.append(request_id)

    def release(self, request_id: str) -> Request:
        """Forget a finished request (its id may then be reused); returns it."""
        req = self._get(request_id)
        if not req.is_finished:
            raise ValueError(f"request {request_id!r} is {req.status.value}: abort() it or run it to the end "
                             f"before releasing it")
        return self.requests.pop(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----- one step -----
    def step(self) -> list[Request]:
        """Schedule, run one forward pass, sample and update. Returns the requests that finished.

        If anything in the step raises, its requests finish with "error" (all unfinished ones if the
        scheduler itself raised), their blocks are freed, and the exception is re-raised.
        """
        t = time.perf_counter()
        out, finished, num_sampled = None, [], 0
        try:
            out = self.scheduler.schedule()
            for c in out.chunks:
                if c.request.first_scheduled_time is None:
                    c.request.first_scheduled_time = t
            for req, start, end in out.kv_loads:  # KV another engine computed (kv_transfer.py)
                self.kv_connector.load_kv(req, self.runner.kv_cache, start, end)
                bs = self.config.cache_config.block_size  # whole blocks of it: later prompts may share them
                self.block_pool.cache_blocks(req.block_ids, self.scheduler.hashes(req, end // bs), start // bs)
            if out.chunks:
                chunks = self._chunks(out)
                logits = self.runner.forward(build_batch(chunks, self.config.cache_config.block_size))
                samplers = [c.request for c in out.chunks if c.start + c.n >= c.request.num_tokens]
                num_sampled = len(samplers)
                if len(logits) == len(samplers):  # one row each (no prompt logprobs, no drafts)
                    sampled = sample(logits, SamplingMetadata.from_requests(samplers, self.eos_token_ids))
                    tokens = {r.request_id: ([t], [lp]) for r, t, lp
                              in zip(samplers, sampled.token_ids, sampled.logprobs)}
                else:
                    tokens = self._sample_rows(out, chunks, logits)
                self._update(out, tokens, finished)
                if self.proposer is not None:
                    self._propose(samplers)
        except BaseException as e:
            self._fail(out, finished, t, e)
            raise
        self._log(out, finished, t, num_sampled)
        return finished

    def _fail(self, out: SchedulerOutput | None, finished: list[Request], t: float, error: BaseException) -> None:
        # Without the scheduler's output its queues cannot be trusted: finish every unfinished request.
        victims = (self.requests.values() if out is None else [c.request for c in out.chunks])
        for req in [r for r in victims if not r.is_finished]:
            self.scheduler.finish(req, "error")
            finished.append(req)
        if not self.scheduler.has_unfinished() and self.block_pool.num_free != self.block_pool.num_blocks:
            self.block_pool.reset()  # blocks taken by a scheduler that raised mid-step: start clean
        self._log(out or SchedulerOutput(), finished, t, 0, error=f"{type(error).__name__}: {error}")

    def _chunks(self, out: SchedulerOutput) -> list[SeqChunk]:
        chunks = []
        for c in out.chunks:
            req = c.request
            # Drafts the budget cut short are dropped (vLLM trims spec_token_ids the same way).
            del req.spec_token_ids[max(0, c.start + c.n - req.num_tokens):]
            drafts = req.spec_token_ids
            if req.spec_draft_probs is not None:  # their q rows, as many as are left (none after a preemption)
                req.spec_draft_probs = req.spec_draft_probs[:len(drafts)] if drafts else None
            if drafts:
                c.kind = "verify"  # a decode with drafts to check (the timelines' colour)
            num_logits = c.n if _wants_prompt_rows(req, c) else (1 + len(drafts) if drafts else None)
            tokens = (req.all_token_ids + drafts if drafts else req.all_token_ids)[c.start:c.start + c.n]
            chunks.append(SeqChunk(tokens, c.start, req.block_ids,
                                   sample=c.start + c.n >= req.num_tokens, num_logits=num_logits))
        return chunks

    def _sample_rows(self, out: SchedulerOutput, chunks: list[SeqChunk], logits: torch.Tensor) -> dict:
        """Tokens from a step whose logits have more rows than samplers: prompt logprobs (recorded
        here) and drafts (verified here). Returns request_id -> (tokens, their logprobs)."""
        plain, rows, tokens, row = [], [], {}, 0
        for c, chunk in zip(out.chunks, chunks):
            req = c.request
            n = int(chunk.sample) if chunk.num_logits is None else chunk.num_logits
            if chunk.num_logits == c.n and _wants_prompt_rows(req, c):
                self._prompt_logprobs(req, c, logits[row:row + n])
            if chunk.sample and req.spec_draft_probs is not None:  # sampled drafts: checked with their q
                tokens[req.request_id] = sampling.verify_probabilistic(
                    logits[row:row + n], req.spec_token_ids, req.spec_draft_probs, req.sampling_params,
                    req.generator, req.prompt_ids, req.output_ids, sorted(self.eos_token_ids), req.bad_words_token_ids)
            elif chunk.sample and req.spec_token_ids:
                tokens[req.request_id] = sampling.verify(
                    logits[row:row + n], req.spec_token_ids, req.sampling_params, req.generator, req.prompt_ids,
                    req.output_ids, sorted(self.eos_token_ids), req.bad_words_token_ids)
            elif chunk.sample:
                plain.append(req)
                rows.append(row + n - 1)
            row += n
        if plain:
            sampled = sample(logits[rows], SamplingMetadata.from_requests(plain, self.eos_token_ids))
            tokens.update({r.request_id: ([t], [lp]) for r, t, lp in zip(plain, sampled.token_ids, sampled.logprobs)})
        return tokens

    def _propose(self, samplers: list[Request]) -> None:
        """Drafts for the next step of each request that sampled and goes on: no more than would
        take it past max_tokens with the token of its own the next step adds."""
        self.proposer.retain(self.requests)
        for req in samplers:
            if req.is_finished or req.grammar is not None:
                continue
            room = req.sampling_params.max_tokens - len(req.output_ids) - 1
            if room > 0:
                req.spec_token_ids, req.spec_draft_probs = self.proposer.propose(req, room)

    def _prompt_logprobs(self, req: Request, c, logits: torch.Tensor) -> None:
        """Record the prompt logprobs from the rows (one per token) of this chunk. The row of
        position p predicts token p + 1; each prompt token gets its logprobs once, also when a
        preempted request computes its prompt again."""
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # the first prompt token: nothing before it
        first = len(req.prompt_logprobs) - 1  # the position whose row predicts the next missing token
        assert first >= c.start, "a prompt-logprobs request computes its prompt from its start"
        last = min(c.start + c.n, req.num_prompt_tokens - 1)  # positions first..last-1 predict prompt tokens
        if first < last:
            rows = logits[first - c.start:last - c.start]
            req.prompt_logprobs.extend(sampling.prompt_logprobs(
                rows, req.prompt_ids[first + 1:last + 1], req.sampling_params.prompt_logprobs))

    def _update(self, out: SchedulerOutput, sampled: dict[str, tuple], finished: list[Request]) -> None:
        """Advance each scheduled request; `sampled` maps a request_id to (its new tokens, their
        logprobs): one token, or with drafts the accepted ones and one of the model's own."""
        now, bs = time.perf_counter(), self.config.cache_config.block_size
        for c in out.chunks:
            req = c.request
            req.num_computed = c.start + c.n
            if self.kv_connector is not None and c.start < req.num_prompt_tokens <= req.num_computed:
                self.kv_connector.save_kv(req, self.runner.kv_cache)  # the prompt is whole: for a consumer
            tokens, logprobs = sampled.get(req.request_id, ((), ()))
            drafts, req.spec_token_ids, req.spec_draft_probs = req.spec_token_ids, [], None
            if drafts and tokens:  # the refused drafts' KV is no longer the request's
                accepted = len(tokens) - 1
                req.num_computed -= len(drafts) - accepted
                self._count_drafts(len(drafts), accepted)
                self._drafts.append((req.request_id, len(drafts), accepted))
                req.num_draft_tokens += len(drafts)
                req.num_accepted_tokens += accepted
            reason = None
            for token, lp in zip(tokens, logprobs):
                if token is None:  # its constraints left no token: it alone ends (sampling.has_token)
                    reason, req.error = "error", _no_token(req)
                    break
                reason = self._append(req, token, lp, now)
                if reason is not None:  # nothing after a stop, max_tokens or the grammar's end
                    break
            # Full blocks now hold computed KV: name them so later prompts can share them.
            full = min(req.num_computed, req.num_tokens) // bs
            self.block_pool.cache_blocks(req.block_ids, self.scheduler.hashes(req, full), c.start // bs)
            if drafts and reason is None:  # blocks that held only refused drafts go back to the pool
                keep = -(-req.num_computed // bs)
                if len(req.block_ids) > keep:
                    self.block_pool.free(reversed(req.block_ids[keep:]))
                    del req.block_ids[keep:]
            if reason is not None:
                self.scheduler.finish(req, reason)
                finished.append(req)

    def _append(self, req: Request, token: int, logprobs, now: float) -> str | None:
        """Add one output token; returns the finish reason it brings ("stop", "length"), else None."""
        req.output_ids.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        req.token_times.append(now)
        sp = req.sampling_params
        hit = None
        if req.detokenizer is not None:  # stop strings: the text decides, before the token checks
            with self.tokenizer_lock:
                hit = req.detokenizer.update([token])
        if req.grammar is not None:
            req.grammar.accept(token)
        if hit is not None:
            req.stop_reason = hit
            return "stop"
        if req.grammar is not None and req.grammar.is_terminated:  # the grammar is complete
            return "stop"
        if token in self.eos_token_ids and not sp.ignore_eos:
            return "stop"
        if token in sp.stop_token_ids:
            req.stop_reason = token
            return "stop"
        if len(req.output_ids) >= sp.max_tokens:
            return "length"
        return None

    def _count_drafts(self, num_drafts: int, accepted: int) -> None:
        s = self.stats
        s.spec_num_drafts += 1
        s.spec_num_draft_tokens += num_drafts
        s.spec_num_accepted_tokens += accepted
        if len(s.spec_accepted_per_pos) < num_drafts:
            s.spec_accepted_per_pos.extend([0] * (num_drafts - len(s.spec_accepted_per_pos)))
        for pos in range(accepted):
            s.spec_accepted_per_pos[pos] += 1

    def _log(self, out: SchedulerOutput, finished: list[Request], t: float, num_sampled: int,
             error: str | None = None) -> None:
        end = time.perf_counter()
        s = self.stats
        step, s.steps = s.steps, s.steps + 1
        s.seconds += end - t
        waiting, running = len(self.scheduler.waiting), len(self.scheduler.running)
        if not (out.chunks or out.preempted or finished or self._added or self._aborted or waiting or error):
            return  # an idle step: nothing to record
        rec = StepRecord(
            step=step, start=t - self._t0, duration=end - t,
            scheduled=[(c.request.request_id, c.n, c.kind) for c in out.chunks],
            preempted=[r.request_id for r in out.preempted],
            finished=[r.request_id for r in finished],
            num_free_blocks=self.block_pool.num_free, num_waiting=waiting, num_running=running,
            num_sampled=num_sampled, added=self._added, aborted=self._aborted, error=error, drafts=self._drafts,
        )
        self._added, self._aborted, self._drafts = [], [], []
        self.step_log.append(rec)
        s.preemptions += len(rec.preempted)
        s.num_finished += len(rec.finished)
        if error is None:
            s.tokens += rec.num_tokens
            s.recomputed_tokens += sum(n for _, n, kind in rec.scheduled if kind == "recompute")
        else:
            s.num_errors += 1

    # ----- the whole loop -----
    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Request]:
        """Run prompts to completion; returns their finished requests in the same order, released.

        All or nothing: if a prompt is refused or a step raises, every request of this call is aborted
        and released before the exception leaves.
        """
        sampling_params = checks.prompt_batch(prompts, sampling_params, SamplingParams)
        ids: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
                ids.append(self._add(p, sp, None, 0, None, f"prompts[{i}]"))
            while any(not self.requests[i].is_finished for i in ids):
                tokens = self.stats.tokens
                self.step()
                if self.stats.tokens == tokens:  # cannot happen for validated requests; never hang
                    raise RuntimeError(f"step {self.stats.steps - 1} scheduled nothing with "
                                       f"{len(self.scheduler.waiting)} requests waiting")
        except BaseException:
            for rid in ids:
                self.abort(rid)
                self.release(rid)
            raise
        return [self.release(i) for i in ids]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (only possible when no request holds blocks)."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("cannot reset the prefix cache while requests are unfinished")
        self.block_pool.reset()


def _no_token(req: Request) -> str:
    """Why a request's row had every token at -inf, naming the fields that mask tokens."""
    sp = req.sampling_params
    fields = [name for name, masks in (("structured_outputs", req.grammar is not None),
                                       ("allowed_token_ids", sp.allowed_token_ids is not None),
                                       ("bad_words", bool(req.bad_words_token_ids)),
                                       ("min_tokens", len(req.output_ids) < sp.min_tokens)) if masks]
    n = len(req.output_ids)
    return (f"{' with '.join(fields) or 'the sampling parameters'} left no token to sample after {n} output "
            f"token{'' if n == 1 else 's'}: every token was forbidden")


def _wants_prompt_rows(req: Request, c) -> bool:
    """Does this chunk need logits for all its rows: its request asked for prompt logprobs, and
    the chunk holds positions whose rows predict prompt tokens not yet scored?"""
    return (req.sampling_params.prompt_logprobs is not None and c.start < req.num_prompt_tokens - 1
            and c.start + c.n > len(req.prompt_logprobs) - 1)


__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "RequestStatus", "StepRecord"]

"""LLMEngine's own contract, beyond the tokens: what each step records (rows sampled, seconds,
token times), blocks taken in a step that failed, the request API's defaults and bounds, a
swapped-in Scheduler that orders its chunks its own way, generate()'s guard against a scheduler
that schedules nothing, reset_prefix_cache() and from_pretrained(). (A failing step, abort and bad
input: test_errors.py.)"""

import time

import pytest
import torch

from nano_engine import LLMEngine, SamplingParams, Scheduler, generate
from nano_engine.mini_llm import Transformer
from nano_engine.scheduler import SchedulerOutput
from nano_engine.tiny import perturbed, tiny_model

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
# Prompts that make chunked prefill, decodes and (with 10 blocks of 4) preemption meet in one run.
PROMPTS = [list(range(1, 30)), [3, 4, 5], list(range(40, 58)), [9, 8, 7, 6, 5]]


def expected_samples(records, prompt_lens: dict[str, int]) -> tuple[list[int], dict[str, int]]:
    """Rows that sample in each record, worked out from the records alone: a chunk samples when it
    reaches the request's last token (prompt plus the tokens sampled so far); a preempted request
    starts again from 0 (prefix caching off: no hit moves the start)."""
    computed = dict.fromkeys(prompt_lens, 0)
    outputs = dict.fromkeys(prompt_lens, 0)
    per_step = []
    for rec in records:
        for rid in rec.preempted:
            computed[rid] = 0
        n_sampled = 0
        for rid, n, _ in rec.scheduled:
            computed[rid] += n
            if computed[rid] == prompt_lens[rid] + outputs[rid]:
                outputs[rid] += 1
                n_sampled += 1
        per_step.append(n_sampled)
    return per_step, outputs


# ----- what a step records -----
def test_records_stats_and_token_times_agree_with_the_engine(tiny):
    """Checked step by step, in a run where chunked prefill, decodes and preemption (recomputed
    tokens) meet: each record's queues and seconds; the rows that sampled, worked out from the records
    alone; the stats, summed over the records; each token's time, within the step that sampled it."""
    engine = LLMEngine(tiny, num_blocks=10, block_size=4, max_num_batched_tokens=12, enable_prefix_caching=False)
    created = time.perf_counter()
    reqs = [engine.requests[engine.add_request(p, GREEDY)] for p in PROMPTS]
    records = []
    while engine.has_unfinished():
        sent = [len(r.token_times) for r in reqs]
        before = time.perf_counter()
        engine.step()
        after = time.perf_counter()
        rec = engine.step_log[-1]
        records.append(rec)
        assert (rec.num_free_blocks, rec.num_waiting, rec.num_running) == (
            engine.block_pool.num_free, len(engine.scheduler.waiting), len(engine.scheduler.running))
        # start: seconds since the engine was created; duration: within the step() call
        assert before - created <= rec.start + 1e-6 and rec.start - 1e-6 <= after - created
        assert 0 < rec.duration <= after - before
        assert all(type(t) is float and before <= t <= after for r, k in zip(reqs, sent) for t in r.token_times[k:])
    assert any(len(rec.scheduled) > 1 and rec.num_prefill_tokens for rec in records), "prefill and decodes mix"
    per_step, outputs = expected_samples(records, {r.request_id: len(r.prompt_ids) for r in reqs})
    assert [rec.num_sampled for rec in records] == per_step
    assert outputs == {r.request_id: len(r.output_ids) for r in reqs} == {r.request_id: 6 for r in reqs}
    assert all(len(r.token_times) == 6 for r in reqs) and [r.step for r in records] == list(range(len(records)))
    assert all(a.start + a.duration <= b.start + 1e-6 for a, b in zip(records, records[1:]))
    s = engine.stats
    recomputed = sum(n for rec in records for _, n, kind in rec.scheduled if kind == "recompute")
    assert recomputed > 0 and s.recomputed_tokens == recomputed
    assert s.tokens == sum(rec.num_tokens for rec in records)
    assert s.steps == len(records) > 3  # every step is recorded, and the seconds are theirs
    assert s.seconds == pytest.approx(sum(rec.duration for rec in records), rel=1e-9)
    assert s.preemptions == sum(len(rec.preempted) for rec in records) > 0
    assert s.num_finished == len(PROMPTS) and s.num_errors == 0


def test_a_record_without_chunks_sampled_nothing(tiny):
    engine = LLMEngine(tiny)
    rid = engine.add_request([1, 2, 3], GREEDY)
    engine.step()
    engine.abort(rid)
    engine.step()  # schedules nothing, but is recorded: it carries the abort
    rec = engine.step_log[-1]
    assert rec.scheduled == [] and rec.aborted == [rid] and rec.num_sampled == 0


def test_requests_are_numbered_in_arrival_order(tiny):
    engine = LLMEngine(tiny)
    ids = [engine.add_request([1, 2]), engine.add_request([3], request_id="x"), engine.add_request([4, 5])]
    assert [engine.requests[i].seq for i in ids] == [0, 1, 2]
    engine.abort(ids[0])
    engine.release(ids[0])
    assert engine.requests[engine.add_request([6])].seq == 3  # never reused


def test_the_model_length_and_the_vocabulary_are_inclusive_bounds(tiny):
    engine = LLMEngine(tiny, num_blocks=1100, block_size=4)
    max_len, vocab = tiny.config.max_position_embeddings, tiny.config.vocab_size
    engine.add_request([1] * 10, SamplingParams(max_tokens=max_len - 10))  # exactly the model's length
    with pytest.raises(ValueError, match=rf"max_tokens \({max_len - 9}\).*max_position_embeddings={max_len}"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=max_len - 9))
    engine.add_request([1], SamplingParams(logprobs=vocab))  # every token's logprob
    with pytest.raises(ValueError, match=f"logprobs={vocab + 1}.*{vocab}"):
        engine.add_request([1], SamplingParams(logprobs=vocab + 1))


@pytest.mark.parametrize("eos, expected", [(5, {5}), ([5, 7], {5, 7}), ((), set()), (None, set())])
def test_the_models_end_of_sequence_ids(eos, expected):
    model = tiny_model(seed=0)
    model.config.eos_token_id = eos
    assert LLMEngine(model).eos_token_ids == expected


def test_the_sampler_is_given_each_requests_history(tiny, monkeypatch):
    # Penalties and min_tokens read the prompt and the output so far: the engine must pass both.
    import nano_engine.engine as engine_module

    seen = []
    real = engine_module.sample

    def spy(logits, meta):
        seen.append(([list(p) for p in meta.prompt_ids], [list(o) for o in meta.output_ids], meta.eos_token_ids))
        return real(logits, meta)

    monkeypatch.setattr(engine_module, "sample", spy)
    engine = LLMEngine(tiny, max_num_batched_tokens=64)
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert seen[0][0] == [[1, 2, 3], [4, 5]] and seen[0][1] == [[], []]
    assert seen[1][0] == [[1, 2, 3], [4, 5]] and all(len(o) == 1 for o in seen[1][1])
    assert all(eos == sorted(engine.eos_token_ids) for _, _, eos in seen)


# ----- a failed step and the KV pool -----
def test_blocks_taken_by_a_scheduler_that_raised_are_given_back(tiny, monkeypatch):
    engine = LLMEngine(tiny, num_blocks=16, block_size=4)
    expected = LLMEngine(tiny).generate([list(range(1, 10))], GREEDY)[0].output_ids
    real = engine.block_pool.allocate

    def allocate_then_fail(n):
        real(n)  # taken from the free queue, handed to nobody
        raise MemoryError("injected in allocate")

    monkeypatch.setattr(engine.block_pool, "allocate", allocate_then_fail)
    with pytest.raises(MemoryError):
        engine.generate([list(range(1, 10))], GREEDY)
    assert engine.step_log[-1].num_sampled == 0
    assert engine.block_pool.num_free == 16 and engine.scheduler.pool is engine.block_pool
    engine.block_pool.check()
    monkeypatch.undo()  # allocate works again: the engine serves as before
    assert engine.generate([list(range(1, 10))], GREEDY)[0].output_ids == expected


# ----- a scheduler of one's own -----
class Reversed(Scheduler):
    """Schedules what the default scheduler does, with the chunks in the opposite order, so that
    a prefill chunk that does not reach its prompt's end comes before requests that sample."""

    def schedule(self):
        out = super().schedule()
        out.chunks.reverse()
        return out


def test_the_engine_takes_a_schedulers_chunks_in_any_order(tiny):
    kw = dict(num_blocks=24, block_size=4, max_num_batched_tokens=10, enable_prefix_caching=False)
    plain, rev = LLMEngine(tiny, **kw), LLMEngine(tiny, scheduler_cls=Reversed, **kw)
    expected, got = plain.generate(PROMPTS, GREEDY), rev.generate(PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == [r.output_ids for r in expected]
    # The same steps, each with the same chunks; and the reversal did put a partial prefill first.
    assert [sorted(rec.scheduled) for rec in rev.step_log] == [sorted(rec.scheduled) for rec in plain.step_log]
    lens = {r.request_id: len(r.prompt_ids) for r in got}
    assert [rec.num_sampled for rec in rev.step_log] == expected_samples(rev.step_log, lens)[0]
    assert any(len(rec.scheduled) > 1 and rec.scheduled[0][2] == "prefill" and rec.num_sampled < len(rec.scheduled)
               for rec in rev.step_log)


class Idle(Scheduler):
    """A broken scheduler: it never schedules anything (and stops a runaway loop after 20 calls)."""

    calls = 0

    def schedule(self):
        type(self).calls += 1
        assert type(self).calls < 20, "generate() kept stepping a scheduler that schedules nothing"
        return SchedulerOutput()


class Stalled(Scheduler):
    """A scheduler that admits every waiting request and then gives none of them a token."""

    def schedule(self):
        self.running.extend(self.waiting)
        self.waiting.clear()
        return SchedulerOutput()


@pytest.mark.parametrize("scheduler_cls, waiting", [(Idle, 1), (Stalled, 0)])
def test_a_step_with_news_but_no_chunks_is_recorded(tiny, scheduler_cls, waiting):
    Idle.calls = 0
    engine = LLMEngine(tiny, scheduler_cls=scheduler_cls)
    rid = engine.add_request([1, 2, 3], GREEDY)
    engine.step()  # its only news: a request added
    engine.step()  # Idle: a request still waiting; Stalled: nothing new, and nothing recorded
    assert [(rec.added, rec.scheduled, rec.num_waiting) for rec in engine.step_log][0] == ([rid], [], waiting)
    assert len(engine.step_log) == 2 - (scheduler_cls is Stalled) and engine.stats.steps == 2


def test_generate_stops_a_scheduler_that_schedules_nothing(tiny):
    Idle.calls = 0
    engine = LLMEngine(tiny, scheduler_cls=Idle)
    with pytest.raises(RuntimeError, match="scheduled nothing"):
        engine.generate([[1, 2, 3], [4, 5]], GREEDY)
    assert Idle.calls == 1 and not engine.requests and not engine.has_unfinished()


# ----- the prefix cache reset, and loading -----
@pytest.mark.parametrize("caching", [True, False])
def test_reset_prefix_cache_empties_the_pool(tiny, caching):
    engine = LLMEngine(tiny, num_blocks=20, block_size=4, enable_prefix_caching=caching)
    shared = list(range(1, 14))
    engine.generate([shared], GREEDY)
    rid = engine.add_request([5, 6])
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.reset_prefix_cache()
    engine.abort(rid)
    assert engine.generate([shared], GREEDY)[0].num_cached_tokens == (12 if caching else 0)
    pool = engine.block_pool
    engine.reset_prefix_cache()
    assert engine.block_pool is pool and engine.scheduler.pool is pool  # emptied in place: one pool, shared
    assert pool.num_free == 20 and not pool.cached
    pool.check()
    assert engine.generate([shared], GREEDY)[0].num_cached_tokens == 0  # forgotten
    assert engine.generate([shared], GREEDY)[0].num_cached_tokens == (12 if caching else 0)


def test_from_pretrained_loads_the_model_and_its_tokenizer(tiny, monkeypatch):
    calls = []
    monkeypatch.setattr(Transformer, "from_pretrained", lambda path, dtype: calls.append((path, dtype)) or tiny)
    monkeypatch.setattr("nano_engine.models.loading.load_tokenizer", lambda path: calls.append(("tokenizer", path)) or "TOK")
    engine = LLMEngine.from_pretrained("some/folder", max_num_seqs=3)
    assert calls == [("some/folder", torch.float32), ("tokenizer", "some/folder")]
    assert engine.model is tiny and engine.tokenizer == "TOK" and engine.config.scheduler_config.max_num_seqs == 3
    calls.clear()
    LLMEngine.from_pretrained(dtype=torch.bfloat16)
    assert calls == [(None, torch.bfloat16), ("tokenizer", None)]


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 5},
                                      {"max_num_batched_tokens": 7, "num_blocks": 8, "block_size": 4}])
def test_prompt_logprobs_equal_one_forward_pass_in_any_chunks_and_after_preemption(tiny, settings):
    """prompt_logprobs=k: each prompt token's logprob (the first has none) and the top k, as one forward
    pass over the whole prompt gives them, whatever the chunks, and computed again after a preemption
    without being counted twice; such a request never reads the prefix cache."""
    import torch

    prompts = [list(range(3, 20)), list(range(5, 18))]
    engine = LLMEngine(tiny, **settings)
    engine.generate([prompts[0]], SamplingParams(max_tokens=1))  # its blocks are cached now
    out = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=3))
    if "num_blocks" in settings:
        assert engine.stats.preemptions > 0
    for req, ids in zip(out, prompts):
        with torch.inference_mode():
            # logprobs are float32, as vLLM's
            want = tiny.compute_logits(tiny(torch.tensor(ids), torch.arange(len(ids)))).float().log_softmax(-1)
        assert req.num_cached_tokens == 0 and req.prompt_logprobs[0] is None and len(req.prompt_logprobs) == len(ids)
        for p, x in enumerate(req.prompt_logprobs[1:]):
            assert x.token_id == ids[p + 1] and x.logprob == want[p, ids[p + 1]].item()
            assert x.top_ids == want[p].topk(3).indices.tolist() and x.rank == int((want[p] > want[p, ids[p + 1]]).sum()) + 1


def test_structured_output_is_refused_by_name_without_a_tokenizer_or_with_two_grammars(tiny):
    from nano_engine.structured import StructuredOutputsParams

    with pytest.raises(ValueError, match="structured_outputs needs exactly one"):
        SamplingParams(structured_outputs={"json": {"type": "object"}, "regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs choice"):
        StructuredOutputsParams(choice=("yes", ""))
    engine = LLMEngine(tiny)
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs={"regex": "[0-9]+"}))
    assert not engine.requests and engine.block_pool.num_free == engine.block_pool.num_blocks


class _NothingAfter:
    """A grammar's matcher, as the engine uses one, that allows every token for `n` tokens and then none
    (as a regex "a" does once min_tokens masks the EOS it ends with)."""
    is_terminated = False

    def __init__(self, vocab: int, n: int):
        self.vocab, self.n, self.seen = vocab, n, 0

    def allowed(self):
        return torch.full((self.vocab,), self.seen < self.n)

    def accept(self, token):
        self.seen += 1
        return True


def test_a_request_whose_constraints_leave_no_token_ends_alone_with_an_error_naming_them(tiny):
    """Greedy took token 0 from a row with every token forbidden, and sampling failed the whole step
    inside torch.multinomial. Now that request ends with "error" and why; the others in its steps get the
    tokens they get without it, and every block comes back."""
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=4, ignore_eos=True)
    engine = LLMEngine(tiny, num_blocks=12, block_size=4, max_num_batched_tokens=6)
    engine.add_request(PROMPTS[1], GREEDY, request_id="greedy")
    engine.add_request(PROMPTS[3], seeded, request_id="seeded")
    for rid, n, params in [("none-at-all", 0, GREEDY), ("two-then-none", 2, seeded), ("greedy-two", 2, GREEDY)]:
        engine.add_request(PROMPTS[0][:9], params, request_id=rid)
        engine.requests[rid].grammar = _NothingAfter(tiny.config.vocab_size, n)
    done = {}
    while engine.has_unfinished():
        done.update((r.request_id, r) for r in engine.step())
    for rid, n in [("none-at-all", 0), ("two-then-none", 2), ("greedy-two", 2)]:
        r = done[rid]
        assert r.finish_reason == "error" and len(r.output_ids) == n, rid
        assert r.error.startswith("structured_outputs") and f"after {n} output token" in r.error
    assert done["greedy"].finish_reason == "length" and done["greedy"].error is None
    assert done["greedy"].output_ids == generate(tiny, PROMPTS[1], GREEDY.max_tokens)
    assert done["seeded"].output_ids == LLMEngine(tiny).generate([PROMPTS[3]], seeded)[0].output_ids
    assert all(rec.error is None for rec in engine.step_log)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_each_request_counts_its_drafts_checked_and_kept(tiny):
    """Per request (Request.num_draft_tokens, num_accepted_tokens) and per step (StepRecord.drafts), adding up
    to the engine's spec_decode counters."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9], [3, 4, 5]]
    engine = LLMEngine(tiny, speculative_config={"num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                                 "prompt_lookup_min": 1})
    out = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    s = engine.stats
    assert sum(r.num_draft_tokens for r in out) == s.spec_num_draft_tokens > 0
    assert sum(r.num_accepted_tokens for r in out) == s.spec_num_accepted_tokens == sum(s.spec_accepted_per_pos)
    steps = [d for rec in engine.step_log for d in rec.drafts]
    assert len(steps) == s.spec_num_drafts and sum(d for _, d, _ in steps) == s.spec_num_draft_tokens
    assert all(0 <= kept <= d for _, d, kept in steps)
    for r in out:  # a request's own figures are its steps'
        assert r.num_accepted_tokens == sum(k for rid, _, k in steps if rid == r.request_id)


def test_a_draft_model_that_samples_its_drafts_keeps_a_seeded_request_reproducible_in_any_batch(tiny):
    """draft_sample_method "probabilistic": a seeded request gets the same tokens alone and among others
    under preemption and chunking (its drafts, uniforms and draws come from its own generator), a
    greedy one gets generate's, more drafts are kept than by checking the same drafter's argmax, and
    the draft model forgets each request once it is gone."""
    spec = {"model": perturbed(tiny, 0.1, seed=7), "num_speculative_tokens": 4, "draft_sample_method": "probabilistic"}
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]]
    params = [seeded, SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.7, top_k=5, seed=5, ignore_eos=True)]
    alone = LLMEngine(tiny, speculative_config=spec).generate([prompts[0]], seeded)[0].output_ids
    busy = LLMEngine(tiny, speculative_config=spec, num_blocks=10, block_size=4, max_num_batched_tokens=6)
    out = busy.generate(prompts, params)
    assert busy.stats.preemptions > 0 and busy.stats.spec_num_accepted_tokens > 0
    assert out[0].output_ids == alone
    assert out[2].output_ids == generate(tiny, prompts[2], 24)
    assert busy.proposer.caches == {} and busy.block_pool.num_free == busy.block_pool.num_blocks
    greedy_drafts = LLMEngine(tiny, speculative_config={**spec, "draft_sample_method": "greedy"})
    greedy_drafts.generate(prompts, params)
    rate = lambda s: s.spec_num_accepted_tokens / s.spec_num_draft_tokens
    assert rate(busy.stats) > rate(greedy_drafts.stats)


def test_the_target_as_its_own_draft_model_has_every_draft_kept(tiny):
    """A draft model equal to the target proposes what the target decodes: with greedy requests every
    draft is kept, in any chunking and across preemptions (the drafter's own cache follows each
    request: refused drafts cut off, new tokens fed once)."""
    spec = {"model": tiny, "num_speculative_tokens": 3}
    engine = LLMEngine(tiny, speculative_config=spec, num_blocks=7, block_size=4, max_num_batched_tokens=7)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    out = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    s = engine.stats
    assert s.preemptions > 0 and s.spec_num_draft_tokens > 20
    assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens
    assert [r.output_ids for r in out] == [generate(tiny, p, 20) for p in prompts]


def test_a_draft_model_folder_loads_in_the_targets_dtype_and_drafts(tmp_path):
    """speculative_config's model as a path (serve --speculative-config '{"model": "/path"}'): loaded
    in the served model's dtype; the same model as its own drafter keeps every greedy draft."""
    from tiny_files import save_hf_folder

    save_hf_folder(tmp_path)
    engine = LLMEngine.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                       speculative_config={"model": str(tmp_path), "num_speculative_tokens": 3})
    assert engine.proposer.model.dtype == torch.bfloat16 and engine.proposer.model is not engine.model
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.output_ids == generate(engine.model, [5, 6, 7, 8], 12)
    assert engine.stats.spec_num_draft_tokens > 0
    assert engine.stats.spec_num_accepted_tokens == engine.stats.spec_num_draft_tokens


def test_a_draft_model_is_refused_by_name_when_it_cannot_draft(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="speculative_config model: no model at"):
        LLMEngine(tiny, speculative_config={"model": str(tmp_path / "nowhere")})
    with pytest.raises(ValueError, match="vocabulary of 32"):
        LLMEngine(tiny, speculative_config={"model": tiny_model(vocab_size=32)})
    with pytest.raises(ValueError, match="needs a model"):
        LLMEngine(tiny, speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="ngram method takes none"):
        LLMEngine(tiny, speculative_config={"method": "ngram", "model": tiny})
    with pytest.raises(ValueError, match="draft_sample_method"):
        LLMEngine(tiny, speculative_config={"model": tiny, "draft_sample_method": "beam"})
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        LLMEngine(tiny, speculative_config={"model": tiny, "prompt_lookup_max": 3})

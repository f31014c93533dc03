"""experiments: the scheduler chapter's identity check, step trace and timed arrivals, on the tiny
model (the embedded model's runs are in test_embedded.py; these reach the code in-process, fast)."""

import pytest

from nano_engine import LLMEngine, SamplingParams
from nano_engine.lab.experiments import (IdentityResult, IdentityRow, format_trace,
                                     identity_check, reference_outputs, run_arrivals, trace_rows)
from nano_engine.mini_llm import generate
from nano_engine.steplog import StepRecord

PROMPTS = [list(range(1, 30)), [5, 6, 7], list(range(40, 60))]


def test_reference_is_each_prompt_alone_through_generate(tiny):
    ref = reference_outputs(tiny, PROMPTS, max_tokens=5)
    assert ref == [generate(tiny, p, 5, tiny.config.eos_token_id) for p in PROMPTS]
    assert all(1 <= len(r) <= 5 for r in ref)


def test_identity_check_runs_every_config_and_compares_with_the_reference(tiny):
    configs = {"budget 8": {"max_num_batched_tokens": 8}, "10 blocks": {"num_blocks": 10, "max_num_batched_tokens": 64}}
    result = identity_check(tiny, PROMPTS, max_tokens=6, configs=configs, block_size=4)
    assert result.reference == reference_outputs(tiny, PROMPTS, 6)
    assert [r.name for r in result.rows] == list(configs) == list(result.engines) == list(result.outputs)
    for row in result.rows:
        engine = result.engines[row.name]
        assert engine.scheduler.block_size == 4  # the common setting reached every engine
        assert (row.steps, row.preemptions) == (engine.stats.steps, engine.stats.preemptions)
        assert row.identical is (result.outputs[row.name] == result.reference) is True
        assert row.seconds > 0
    assert max(rec.num_tokens for rec in result.engines["budget 8"].step_log) == 8  # each config its own settings
    assert result.engines["10 blocks"].block_pool.num_blocks == 10 and result.rows[1].preemptions >= 1
    assert result.all_identical and result.reference_seconds > 0


def test_a_differing_config_is_not_identical_and_the_table_shows_it():
    rows = [IdentityRow("a", 12, 0, 1.5, True), IdentityRow("budget 32", 7, 3, 0.25, False)]
    result = IdentityResult([[1]], 2.125, rows, {}, {})
    assert not result.all_identical
    assert IdentityResult([[1]], 1.0, rows[:1], {}, {}).all_identical
    head, alone, *rows = (line.split() for line in result.table().splitlines())
    assert head == ["config", "steps", "preempt", "seconds", "identical"]
    assert alone[:2] == ["alone", "(generate)"] and float(alone[-2]) == pytest.approx(2.125, abs=0.01)
    assert rows == [["a", "12", "0", "1.50", "True"], ["budget", "32", "7", "3", "0.25", "False"]]


def record(step, scheduled, waiting):
    return StepRecord(step=step, start=0.0, duration=0.0, scheduled=scheduled, preempted=[], finished=[],
                      num_free_blocks=0, num_waiting=waiting, num_running=len(scheduled))


def test_trace_of_the_first_steps():
    log = [record(0, [("0", 8, "prefill")], 2), record(1, [("0", 1, "decode"), ("1", 7, "prefill")], 1),
           record(2, [("0", 1, "decode"), ("1", 1, "decode"), ("2", 3, "recompute")], 0)]
    assert trace_rows(log) == [(8, 1, 8, 2), (8, 2, 7, 1), (5, 3, 3, 0)]
    assert trace_rows(log, first=2) == trace_rows(log)[:2] and len(format_trace(log, first=1).splitlines()) == 2
    assert [line.split() for line in format_trace(log).splitlines()[1:]] == [  # each row: its figures, who got what
        ["0", "8", "1", "8", "2", "0:8p"], ["1", "8", "2", "7", "1", "0:1d", "1:7p"],
        ["2", "5", "3", "3", "0", "0:1d", "1:1d", "2:3r"]]
    assert len(format_trace(log * 3).splitlines()) == 1 + 6  # six rows by default


def test_run_arrivals_adds_each_request_just_before_its_step(tiny):
    engine = LLMEngine(tiny, max_num_batched_tokens=64)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    # Given out of order: results come back in the order given, requests are added by step.
    done = run_arrivals(engine, [(3, [1, 2, 3], sp), (0, [4, 5], sp), (3, [6], sp)])
    assert [r.prompt_ids for r in done] == [[1, 2, 3], [4, 5], [6]]
    assert all(r.is_finished and len(r.output_ids) == 2 for r in done)
    log = list(engine.step_log)
    first = {rid: next(rec.step for rec in log if rid in [x for x, _, _ in rec.scheduled]) for rid in
             (r.request_id for r in done)}
    # [4, 5] ran in the engine's steps 0 and 1 and finished there; at step 2 nothing was left, so the
    # engine was not stepped; the two arriving at step 3 were added together and ran in its next step.
    assert first == {done[1].request_id: 0, done[0].request_id: 2, done[2].request_id: 2}
    assert log[1].finished == [done[1].request_id]
    assert engine.stats.steps == 4 and [rec.step for rec in log] == [0, 1, 2, 3]


def test_the_reference_stops_at_the_models_eos():
    from nano_engine.tiny import tiny_model

    first = generate(tiny_model(), [5, 6, 7], 1, None)[0]  # the first token greedy decoding gives
    model = tiny_model(eos_token_id=first)
    assert reference_outputs(model, [[5, 6, 7]], max_tokens=4) == [[first]]  # the EOS token ends it


def test_run_arrivals_stops_after_max_steps_counting_them_exactly(tiny):
    sp = SamplingParams(max_tokens=3, ignore_eos=True)  # a prefill then two decodes: three steps
    engine = LLMEngine(tiny)
    (req,) = run_arrivals(engine, [(0, [1, 2], sp)], max_steps=3)  # exactly the steps it needs: fine
    assert len(req.output_ids) == 3 and engine.stats.steps == 3
    with pytest.raises(RuntimeError, match="2 steps"):
        run_arrivals(LLMEngine(tiny), [(0, [1, 2], sp)], max_steps=2)
    assert run_arrivals(LLMEngine(tiny), []) == []
    # An arrival waits for its step even while the engine is idle; the default bound is 100,000 steps.
    (req,) = run_arrivals(LLMEngine(tiny), [(99_997, [1, 2], sp)])
    assert req.is_finished
    with pytest.raises(RuntimeError, match="100000 steps"):
        run_arrivals(LLMEngine(tiny), [(99_998, [1, 2], sp)])

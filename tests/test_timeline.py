"""Timelines: the figure data from a step log, the colours per state, the widget's switches."""

import random

import matplotlib
import pytest

matplotlib.use("Agg")

from nano_engine import LLMEngine, SamplingParams  # noqa: E402
from nano_engine.experiments import run_arrivals  # noqa: E402
from nano_engine.steplog import queue_states  # noqa: E402
from nano_engine.timeline import (METHODS, STATE_COLORS, TimelineWidget, compare_figure,  # noqa: E402
                                  plot_timeline, state_counts, timeline)

ARRIVALS = [(0, list(range(1, 13)), SamplingParams(max_tokens=3, ignore_eos=True)),
            (0, list(range(20, 26)), SamplingParams(max_tokens=6, ignore_eos=True)),
            (0, list(range(30, 40)), SamplingParams(max_tokens=2, ignore_eos=True)),
            (2, list(range(40, 44)), SamplingParams(max_tokens=2, ignore_eos=True))]


def run(model, settings, budget=8, **kw):
    engine = LLMEngine(model, max_num_batched_tokens=budget, max_num_seqs=2, **{**settings, **kw})
    run_arrivals(engine, ARRIVALS)
    return engine.step_log


def test_states_follow_the_step_log(tiny):
    log = run(tiny, {})
    tl = timeline(log)
    assert tl.request_ids == ["0", "1", "2", "3"] and tl.num_steps == len(log)
    # Step 0: a 12-token prompt under an 8-token budget: request 0 takes it all, 1 and 2 wait,
    # 3 has not arrived yet.
    assert [row[0] for row in tl.states] == ["prefill", "waiting", "waiting", None]
    for s, rec in enumerate(log):
        for rid, n, kind in rec.scheduled:
            assert tl.states[tl.request_ids.index(rid)][s] == kind
        for rid in queue_states(log)[s].waiting:
            assert tl.states[tl.request_ids.index(rid)][s] == "waiting"
    counts = state_counts(tl)
    assert counts["decode"] == sum(n for rec in log for _, n, k in rec.scheduled if k == "decode")
    assert counts["prefill"] == sum(1 for rec in log for _, _, k in rec.scheduled if k == "prefill")


def test_preemption_and_recompute_are_marked(tiny):
    log = run(tiny, {}, budget=32, num_blocks=5, block_size=4)
    counts = state_counts(timeline(log))
    assert counts["preempted"] == sum(len(r.preempted) for r in log) >= 1
    assert counts["recompute"] >= 1


def test_plot_colours_each_state(tiny):
    log = run(tiny, {}, budget=32, num_blocks=5, block_size=4)
    ax = plot_timeline(log)
    colours = {tuple(round(c, 3) for c in coll.get_facecolor()[0][:3]) for coll in ax.collections}
    used = {k for k, v in state_counts(timeline(log)).items() if v}
    expected = {tuple(round(c, 3) for c in matplotlib.colors.to_rgb(STATE_COLORS[k])) for k in used}
    assert colours == expected
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(STATE_COLORS)
    assert ax.get_xlim() == (0, len(log))
    assert plot_timeline(log, x="seconds").get_xlabel() == "time (s)"


def test_static_waits_for_the_whole_batch(tiny):
    logs = {name: run(tiny, s, budget=64) for name, s in METHODS.items()}
    static, continuous = logs["static batching"], logs["continuous, no chunking"]
    # Static: request 2 is admitted only once both 0 and 1 have finished.
    first = {rid: min(i for i, r in enumerate(static) if rid in [x for x, _, _ in r.scheduled]) for rid in "012"}
    done = {rid: next(i for i, r in enumerate(static) if rid in r.finished) for rid in "01"}
    assert first["2"] > max(done.values())
    assert len(continuous) < len(static)
    fig = compare_figure(logs)
    assert len(fig.axes) == 3
    assert fig.axes[-1].get_xlim() == (0, max(map(len, logs.values())))  # no run is cut off


def test_widget_switches_method_and_budget(tiny):
    calls = []

    def runner(settings, budget):
        calls.append((tuple(sorted(settings.items())), budget))
        return run(tiny, settings, budget=budget)

    tw = TimelineWidget(runner, budgets=[8, 16, 64])
    assert tw.budget.value == 16 and tw.method.value == "static batching"
    first, first_png = tw.summary.value, bytes(tw.image.value)
    assert first_png.startswith(b"\x89PNG")
    tw.method.value = "continuous + chunked prefill"
    assert "continuous + chunked prefill" in tw.summary.value and tw.summary.value != first
    assert bytes(tw.image.value) != first_png
    tw.budget.value = 8
    assert "budget 8" in tw.summary.value
    tw.method.value = "static batching"  # at budget 8 a whole request does not fit one step
    assert "cannot run" in tw.summary.value and "max_num_batched_tokens=8" in tw.summary.value
    assert bytes(tw.image.value) == b""
    tw.budget.value = 16
    assert tw.summary.value == first and len(calls) == 4  # the first run came from the cache
    assert bytes(tw.image.value) == first_png  # the same run draws the same figure


@pytest.mark.parametrize("policy", ["fcfs", "priority", "conservative", "static"])
def test_queues_replayed_from_the_log_are_the_schedulers(tiny, policy):
    """The records hold events only; replaying them gives the real queues, in order, at every step:
    arrivals over time, chunked prefills, preemptions under a tight pool, aborts between steps."""
    rng = random.Random(policy)
    engine = LLMEngine(tiny, policy=policy, num_blocks=9, block_size=4, max_num_batched_tokens=32,
                       max_num_seqs=4)
    actual, ids = [], []
    for step in range(1000):
        for _ in range(rng.choice([0] * 6 + [1, 3]) if step < 100 else 0):
            prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(1, 14))]
            ids.append(engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True),
                                          priority=rng.randrange(3)))
        if ids and rng.random() < 0.1:
            engine.abort(rng.choice(ids))  # waiting, running or finished already
        if step > 100 and not engine.has_unfinished():
            break
        before = len(engine.step_log)
        engine.step()
        if len(engine.step_log) > before:
            actual.append(([r.request_id for r in engine.scheduler.waiting],
                           [r.request_id for r in engine.scheduler.running]))
    for _ in range(3):
        engine.step()  # idle steps are counted, not recorded
    log = list(engine.step_log)
    assert sum(len(r.preempted) for r in log) >= {"static": 0, "conservative": 1}.get(policy, 3)
    assert sum(len(r.aborted) for r in log) >= 3
    assert engine.stats.steps >= len(log) + 3 and len(log) == len(actual)
    replayed = [(q.waiting, q.running) for q in queue_states(log)]
    assert replayed == actual
    assert [(len(w), len(r)) for w, r in actual] == [(rec.num_waiting, rec.num_running) for rec in log]


def test_the_old_queue_copies_say_where_they_went():
    from nano_engine.steplog import StepRecord

    rec = StepRecord.__new__(StepRecord)  # __getattr__ needs no field
    for name, short in (("waiting_ids", "waiting"), ("running_ids", "running")):
        with pytest.raises(AttributeError) as e:
            getattr(rec, name)
        assert str(e.value) == (f"StepRecord.{name} is gone (it copied the whole queue every step): use "
                                f"nano_engine.steplog.queue_states(engine.step_log)[i].{short}")
    with pytest.raises(AttributeError) as e:
        rec.no_such_field
    assert str(e.value) == "no_such_field"

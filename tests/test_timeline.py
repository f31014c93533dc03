"""Timelines: the figure data from a step log, the colours per state, the widget's switches."""

import random

import matplotlib
import pytest

matplotlib.use("Agg")

from nano_engine import LLMEngine, SamplingParams  # noqa: E402
from nano_engine.lab.experiments import run_arrivals  # noqa: E402
from nano_engine.steplog import queue_states  # noqa: E402
from nano_engine.lab.timeline import (METHODS, STATE_COLORS, TimelineWidget, compare_figure,  # noqa: E402
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
        assert all(tl.states[tl.request_ids.index(rid)][s] == kind for rid, _, kind in rec.scheduled)
        assert all(tl.states[tl.request_ids.index(rid)][s] == "waiting" for rid in queue_states(log)[s].waiting)


def test_preemption_and_recompute_are_marked(tiny):
    counts = state_counts(timeline(run(tiny, {}, budget=32, num_blocks=5, block_size=4)))
    assert counts["preempted"] >= 1 and counts["recompute"] >= 1


def test_static_waits_for_the_whole_batch(tiny):
    logs = {name: run(tiny, s, budget=64) for name, s in METHODS.items()}
    static, continuous = logs["static batching"], logs["continuous, no chunking"]
    # Static: request 2 is admitted only once both 0 and 1 have finished.
    first = {rid: min(i for i, r in enumerate(static) if rid in [x for x, _, _ in r.scheduled]) for rid in "012"}
    done = {rid: next(i for i, r in enumerate(static) if rid in r.finished) for rid in "01"}
    assert first["2"] > max(done.values())
    assert len(continuous) < len(static)


def test_widget_switches_method_and_budget(tiny):
    calls = []

    def runner(settings, budget):
        calls.append(budget)
        return run(tiny, settings, budget=budget)

    tw = TimelineWidget(runner, budgets=[8, 16, 64])
    first, first_png = tw.summary.value, bytes(tw.image.value)
    tw.method.value = "continuous + chunked prefill"
    assert "continuous + chunked prefill" in tw.summary.value and bytes(tw.image.value) not in (first_png, b"")
    tw.budget.value = 8
    tw.method.value = "static batching"  # at budget 8 a whole request does not fit one step
    assert "cannot run" in tw.summary.value and "max_num_batched_tokens=8" in tw.summary.value
    assert bytes(tw.image.value) == b""
    tw.budget.value = 16
    assert (tw.summary.value, bytes(tw.image.value), len(calls)) == (first, first_png, 4)  # the first run, cached


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
    for name in ("waiting_ids", "running_ids"):
        with pytest.raises(AttributeError, match=f"{name}.*queue_states"):
            getattr(rec, name)
    with pytest.raises(AttributeError, match="no_such_field"):
        rec.no_such_field


def hand_log():
    """Three hand-made records (no engine): 'a' prefills then decodes, 'b' waits, is admitted, is
    preempted and recomputes; times start at 10 s so that the timeline's own clock starts at 0."""
    from nano_engine.steplog import StepRecord

    return [StepRecord(step=0, start=10.0, duration=0.5, scheduled=[("a", 4, "prefill")], preempted=[],
                       finished=[], num_free_blocks=3, num_waiting=1, num_running=1, added=["a", "b"]),
            StepRecord(step=1, start=10.5, duration=0.25, scheduled=[("a", 1, "decode"), ("b", 2, "prefill")],
                       preempted=[], finished=[], num_free_blocks=1, num_waiting=0, num_running=2),
            StepRecord(step=2, start=11.0, duration=1.0, scheduled=[("a", 1, "decode")], preempted=["b"],
                       finished=["a"], num_free_blocks=3, num_waiting=1, num_running=0),
            StepRecord(step=4, start=12.5, duration=0.5, scheduled=[("b", 2, "recompute")], preempted=[],
                       finished=[], num_free_blocks=2, num_waiting=0, num_running=1)]


def test_timeline_of_a_hand_made_log():
    tl = timeline(hand_log())
    assert tl.request_ids == ["a", "b"] and tl.num_steps == 4
    assert tl.states == [["prefill", "decode", "decode", None],
                         ["waiting", "prefill", "preempted", "recompute"]]
    assert tl.starts == [0.0, 0.5, 1.0, 2.5] and tl.durations == [0.5, 0.25, 1.0, 0.5]
    assert state_counts(tl) == {"prefill": 2, "decode": 2, "verify": 0, "recompute": 1, "preempted": 1, "stalled": 0,
                                "waiting": 1}
    empty = timeline([])
    assert (empty.request_ids, empty.states, empty.starts, empty.num_steps) == ([], [], [], 0)
    assert state_counts(empty) == dict.fromkeys(STATE_COLORS, 0)


def test_a_running_request_given_no_tokens_is_stalled():
    from nano_engine.steplog import StepRecord

    log = hand_log()[:2] + [StepRecord(step=2, start=11.0, duration=1.0, scheduled=[("a", 1, "decode")],
                                       preempted=[], finished=[], num_free_blocks=1, num_waiting=0,
                                       num_running=2)]
    assert timeline(log).states[1] == ["waiting", "prefill", "stalled"]


def bars(ax):
    """Every drawn cell of the axis as (x, width, y0, height, colour), rounded, in one sorted list."""
    out = []
    for coll in ax.collections:
        colour = matplotlib.colors.to_hex(coll.get_facecolor()[0])
        for path in coll.get_paths():
            (x0, y0), (x1, y1) = path.vertices.min(0), path.vertices.max(0)
            out.append((round(x0, 6), round(x1 - x0, 6), round(y0, 6), round(y1 - y0, 6), colour))
    return sorted(out)


def test_plot_draws_each_cell_where_its_step_is():
    import matplotlib.pyplot as plt

    c = STATE_COLORS
    ax = plot_timeline(hand_log())
    assert bars(ax) == sorted([
        (0, 1, -0.4, 0.8, c["prefill"]), (1, 1, -0.4, 0.8, c["decode"]), (2, 1, -0.4, 0.8, c["decode"]),
        (0, 1, 0.6, 0.8, c["waiting"]), (1, 1, 0.6, 0.8, c["prefill"]), (2, 1, 0.6, 0.8, c["preempted"]),
        (3, 1, 0.6, 0.8, c["recompute"])])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["req a", "req b"] and ax.yaxis_inverted()  # a on top
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(STATE_COLORS)  # every state, used or not
    assert (ax.get_xlabel(), ax.get_xlim(), ax.get_title()) == ("step", (0, 4), "4 steps")
    plt.close(ax.figure)

    # In seconds each cell spans its step's own time, from the first step's start.
    ax = plot_timeline(hand_log(), x="seconds", title="mine")
    assert bars(ax) == sorted([
        (0, 0.5, -0.4, 0.8, c["prefill"]), (0.5, 0.25, -0.4, 0.8, c["decode"]), (1, 1, -0.4, 0.8, c["decode"]),
        (0, 0.5, 0.6, 0.8, c["waiting"]), (0.5, 0.25, 0.6, 0.8, c["prefill"]), (1, 1, 0.6, 0.8, c["preempted"]),
        (2.5, 0.5, 0.6, 0.8, c["recompute"])])
    assert (ax.get_xlabel(), ax.get_xlim(), ax.get_title()) == ("time (s)", (0, 3.0), "mine")
    plt.close(ax.figure)

    # On an axis passed in, the timeline is drawn there.
    fig, given = plt.subplots()
    assert plot_timeline(hand_log(), ax=given) is given and len(given.collections) == 6
    plt.close(fig)
    with pytest.raises(ValueError, match="'step'.*'steps' or 'seconds'"):
        plot_timeline(hand_log(), x="step")
    # An empty log draws an empty axis from 0 to 1, on either scale (not a singular 0..0 one).
    for x in ("steps", "seconds"):
        ax = plot_timeline([], x=x)
        assert (ax.get_xlim(), ax.get_title(), len(ax.collections)) == ((0, 1), "0 steps", 0)
        plt.close(ax.figure)


def test_compare_figure_shares_the_longest_run():
    import matplotlib.pyplot as plt

    short = hand_log()[:2]
    fig = compare_figure({"long": hand_log(), "short": short, "none": []})
    assert [ax.get_title() for ax in fig.axes] == ["long: 4 steps", "short: 2 steps", "none: 0 steps"]
    assert [ax.get_xlabel() for ax in fig.axes] == ["", "", "step"]  # on the last panel only
    assert [ax.get_xlim() for ax in fig.axes] == [(0, 4)] * 3
    plt.close(fig)
    fig = compare_figure({"short": short, "long": hand_log()}, x="seconds")
    assert [ax.get_xlim() for ax in fig.axes] == [(0, 3.0)] * 2  # 12.5 + 0.5 - 10
    plt.close(fig)


def test_widget_axis_switch_options_and_its_figure(monkeypatch):
    import matplotlib.pyplot as plt

    calls, closed, real_close = [], [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (closed.append(fig), real_close(fig)))

    def runner(settings, budget):
        calls.append((settings, budget))
        return hand_log()

    tw = TimelineWidget(runner, budgets=[3, 5, 7, 9], methods={"m1": {"policy": "fcfs"}, "m2": {"policy": "priority"}})
    assert tw.budget.value == 7 and tw.method.options == ("m1", "m2") and tw.axis.value == "steps"
    assert all(part in tw.summary.value for part in ("m1", "budget 7", "4 steps", "1 preemptions"))
    assert tw.budget.continuous_update is False  # a slider drag runs the engine once, on release
    # The figure drawn is closed (the Image widget shows it; no figure piles up), titled with the method and budget.
    (fig,) = closed
    assert fig.axes[0].get_title() == "m1, budget 7"
    steps_png = bytes(tw.image.value)
    tw.axis.value = "seconds"
    assert bytes(tw.image.value) not in (steps_png, b"") and calls == [({"policy": "fcfs"}, 7)]  # redrawn, not rerun
    assert TimelineWidget(runner, budgets=[5, 7], x="seconds").axis.value == "seconds"

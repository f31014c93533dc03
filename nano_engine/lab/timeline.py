"""Timelines drawn from the engine's own step log: what every request did at every step.

Rows are requests, the horizontal axis is steps (or seconds); each cell is coloured by the
request's state in that step: a prefill chunk, a decode, a decode with drafts to verify
(speculative decoding), a recompute after preemption, running
but given no tokens, waiting, or the step in which it was preempted. `TimelineWidget` switches
between batching methods and token budgets, for the scheduler chapter; `compare_figure` draws
the same runs side by side as a static figure, for a page read without a kernel.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Callable, Sequence

from ..steplog import StepRecord, queue_states

# One colour per state; the order is the legend's.
STATE_COLORS = {
    "prefill": "#4c72b0",  # blue: a chunk of the prompt
    "decode": "#55a868",  # green: one new token
    "verify": "#8172b3",  # purple: a new token and drafts checked with it (speculative decoding)
    "recompute": "#dd8452",  # orange: redoing KV lost to a preemption
    "preempted": "#c44e52",  # red: preempted in this step
    "stalled": "#b0b0b0",  # grey: running, but no tokens left in the budget for it
    "waiting": "#f1e3b0",  # pale yellow: queued
}

# The three methods of the chapter, as engine settings.
METHODS = {
    "static batching": {"policy": "static"},
    "continuous, no chunking": {"enable_chunked_prefill": False},
    "continuous + chunked prefill": {"enable_chunked_prefill": True},
}


@dataclass
class Timeline:
    request_ids: list[str]  # rows, in order of first appearance
    states: list[list[str | None]]  # states[row][step]: a key of STATE_COLORS, or None (absent)
    starts: list[float]  # seconds since the run began, per step
    durations: list[float]

    @property
    def num_steps(self) -> int:
        return len(self.starts)


def timeline(log: Sequence[StepRecord]) -> Timeline:
    """The state of every request at every step of a step log."""
    log = list(log)
    queues = queue_states(log)  # the records hold events only; the queues are replayed from them
    ids: list[str] = []
    seen: set[str] = set()
    for rec, q in zip(log, queues):
        for rid in [r for r, _, _ in rec.scheduled] + rec.preempted + q.running + q.waiting:
            if rid not in seen:
                seen.add(rid)
                ids.append(rid)
    row = {rid: i for i, rid in enumerate(ids)}
    states: list[list[str | None]] = [[None] * len(log) for _ in ids]
    for s, (rec, q) in enumerate(zip(log, queues)):
        for rid in q.waiting:
            states[row[rid]][s] = "waiting"
        for rid in q.running:
            states[row[rid]][s] = "stalled"
        for rid, _, kind in rec.scheduled:
            states[row[rid]][s] = kind
        for rid in rec.preempted:
            states[row[rid]][s] = "preempted"
    t0 = log[0].start if log else 0.0
    return Timeline(ids, states, [r.start - t0 for r in log], [r.duration for r in log])


def state_counts(tl: Timeline) -> dict[str, int]:
    """How many (request, step) cells each state fills."""
    counts = {k: 0 for k in STATE_COLORS}
    for row in tl.states:
        for st in row:
            if st is not None:
                counts[st] += 1
    return counts


def plot_timeline(log: Sequence[StepRecord], ax=None, x: str = "steps", title: str | None = None):
    """Draw one run's timeline on a matplotlib axis; returns the axis."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if x not in ("steps", "seconds"):
        raise ValueError(f"x={x!r} must be 'steps' or 'seconds'")
    tl = timeline(log)
    ax = ax or plt.subplots(figsize=(8, 0.35 * len(tl.request_ids) + 1.2))[1]
    for r, rid in enumerate(tl.request_ids):
        for st, color in STATE_COLORS.items():
            cells = [(s if x == "steps" else tl.starts[s], 1 if x == "steps" else tl.durations[s])
                     for s, v in enumerate(tl.states[r]) if v == st]
            if cells:
                ax.broken_barh(cells, (r - 0.4, 0.8), facecolors=color)
    ax.set_yticks(range(len(tl.request_ids)), [f"req {rid}" for rid in tl.request_ids])
    ax.invert_yaxis()
    ax.set_xlabel("step" if x == "steps" else "time (s)")
    ax.set_xlim(0, (tl.num_steps if x == "steps" else tl.starts[-1] + tl.durations[-1]) if log else 1)
    ax.set_title(title or f"{tl.num_steps} steps")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in STATE_COLORS.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def compare_figure(logs: dict[str, Sequence[StepRecord]], x: str = "steps"):
    """The runs side by side (one row each), sharing the horizontal axis; returns the figure."""
    import matplotlib.pyplot as plt

    n_rows = max(len(timeline(log).request_ids) for log in logs.values())
    fig, axes = plt.subplots(len(logs), 1, sharex=True, squeeze=False,
                             figsize=(9, len(logs) * (0.3 * n_rows + 1.0)))
    for ax, (name, log) in zip(axes[:, 0], logs.items()):
        plot_timeline(log, ax=ax, x=x, title=f"{name}: {len(log)} steps")
        if ax is not axes[-1, 0]:
            ax.set_xlabel("")
    # The axes are shared and each plot_timeline set the limit to its own run: use the longest.
    ends = [len(log) if x == "steps" else log[-1].start - log[0].start + log[-1].duration
            for log in logs.values() if log]
    axes[0, 0].set_xlim(0, max(ends, default=1))
    fig.tight_layout()
    return fig


class TimelineWidget:
    """Switch between batching methods and token budgets; the figure is redrawn from the step log.

    `run(method_settings, budget)` runs the chapter's workload and returns its step log; runs are
    cached, so switching back is instant. `.widget` is what a notebook displays.
    """

    def __init__(self, run: Callable[[dict, int], Sequence[StepRecord]], budgets: Sequence[int],
                 methods: dict[str, dict] | None = None, x: str = "steps"):
        import ipywidgets as w

        self.run, self.methods, self.x = run, methods or METHODS, x
        self.cache: dict[tuple[str, int], Sequence[StepRecord]] = {}
        self.method = w.ToggleButtons(options=list(self.methods), description="method")
        self.budget = w.SelectionSlider(options=list(budgets), value=budgets[len(budgets) // 2],
                                        description="token budget", continuous_update=False)
        self.axis = w.ToggleButtons(options=["steps", "seconds"], value=x, description="x axis")
        self.summary = w.HTML()
        # The figure as PNG bytes in an Image widget: it renders without a kernel-side display
        # hook and changes visibly (a new src) on each switch.
        self.image = w.Image(format="png")
        for control in (self.method, self.budget, self.axis):
            control.observe(lambda change: self.redraw(), names="value")
        self.widget = w.VBox([self.method, self.budget, self.axis, self.summary, self.image])
        self.redraw()

    def log(self, method: str | None = None, budget: int | None = None) -> Sequence[StepRecord]:
        key = (method or self.method.value, budget or self.budget.value)
        if key not in self.cache:
            self.cache[key] = self.run(self.methods[key[0]], key[1])
        return self.cache[key]

    def redraw(self) -> None:
        import matplotlib.pyplot as plt

        try:
            log = self.log()
        except ValueError as e:  # e.g. static batching with a budget below a whole request
            self.summary.value = f"<b>{self.method.value}</b>, budget {self.budget.value}: cannot run: {e}"
            self.image.value = b""
            return
        c = state_counts(timeline(log))
        self.summary.value = (f"<b>{self.method.value}</b>, budget {self.budget.value}: {len(log)} steps, "
                              f"{sum(len(r.preempted) for r in log)} preemptions, "
                              f"{c['waiting']} request-steps waiting")
        ax = plot_timeline(log, x=self.axis.value, title=f"{self.method.value}, budget {self.budget.value}")
        png = io.BytesIO()
        ax.figure.savefig(png, format="png", dpi=80, bbox_inches="tight")
        plt.close(ax.figure)  # shown through the Image widget only
        self.image.value = png.getvalue()

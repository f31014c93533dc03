"""Timings that state their noise: interleaved repeats, medians with their spread, a step-cost model.

Why: one sequential run per configuration on a shared machine ranks configurations by when they
ran, not by what they are (the chapter once showed two identical schedules 20-37% apart). So every
time a chapter prints is measured the same way:

- `interleave` runs each configuration once per round and repeats the rounds, rotating the order so
  that no configuration always goes first; a burst of load from elsewhere hits all of them alike;
- `Spread` is the median of the repeats with their range, and two figures whose ranges overlap are
  `within_noise` of each other: the chapter says so instead of ranking them;
- `StepCost` is the simplest model of a step's time, a fixed part plus a part per token, fitted by
  least squares to the durations in the engine's own step log. Applied to a schedule, it predicts
  the times that the schedule alone implies, which the chapters show beside the measurements.

vLLM's benchmarks (`vllm/benchmarks/serve.py`) likewise report medians and percentiles, never one
run; the step-cost model is the roofline-free version of what `vllm bench latency` sweeps.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Mapping, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def interleave(runs: Mapping[K, Callable[[], T]], repeats: int, progress: str | None = None) -> dict[K, list[T]]:
    """Call every function in `runs` once per round, for `repeats` rounds; their results, by key.

    Round r starts at the r-th key (a rotation), so each key runs first, second, ... equally often.
    `progress`: a description for a tqdm.auto bar over all the calls (None: no bar).
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not runs:
        raise ValueError("runs must name at least one function to call, got an empty mapping")
    for key, fn in runs.items():
        if not callable(fn):
            raise TypeError(f"runs[{key!r}] must be callable, got {type(fn).__name__}")
    keys = list(runs)
    out: dict[K, list[T]] = {k: [] for k in keys}
    bar = None
    if progress is not None:
        from tqdm.auto import tqdm  # imported here: only the chapters' timing cells show a bar
        bar = tqdm(total=repeats * len(keys), desc=progress)
    for r in range(repeats):
        for i in range(len(keys)):
            key = keys[(r + i) % len(keys)]
            out[key].append(runs[key]())
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    return out


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """A function that calls fn and returns the seconds it took (for `interleave`)."""
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return run


@dataclass(frozen=True)
class Spread:
    """The median of repeated measurements and their range."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> "Spread":
        xs = [float(v) for v in values]
        if not xs:
            raise ValueError("Spread.of needs at least one value, got none")
        if any(math.isnan(x) for x in xs):
            raise ValueError(f"Spread.of got NaN among {xs}")
        return cls(statistics.median(xs), min(xs), max(xs), len(xs))

    @property
    def relative(self) -> float:
        """The range as a fraction of the median: (high - low) / median."""
        return (self.high - self.low) / self.median if self.median else math.inf

    def within_noise(self, other: "Spread") -> bool:
        """True when the two ranges overlap: the repeats cannot tell the two apart."""
        return self.low <= other.high and other.low <= self.high

    def fmt(self, scale: float = 1.0, digits: int = 0) -> str:
        """'median (low-high)', each value times scale: fmt(1000) turns seconds into ms."""
        return f"{self.median * scale:.{digits}f} ({self.low * scale:.{digits}f}-{self.high * scale:.{digits}f})"


@dataclass(frozen=True)
class StepCost:
    """A step's time as fixed + per_token x tokens, in seconds."""

    fixed: float
    per_token: float

    @classmethod
    def fit(cls, num_tokens: Sequence[int], seconds: Sequence[float]) -> "StepCost":
        """Least squares over (tokens, seconds) pairs, e.g. every step of a chapter's runs."""
        if len(num_tokens) != len(seconds):
            raise ValueError(f"num_tokens and seconds must pair up, got {len(num_tokens)} and {len(seconds)}")
        if len(set(num_tokens)) < 2:
            raise ValueError(f"fitting a fixed and a per-token cost needs steps of at least two sizes, "
                             f"got sizes {sorted(set(num_tokens))}")
        line = statistics.linear_regression([float(n) for n in num_tokens], [float(s) for s in seconds])
        return cls(line.intercept, line.slope)

    @classmethod
    def fit_log(cls, records: Iterable) -> "StepCost":
        """Fit to step records that have `num_tokens` and `duration` (the engine's StepRecord)."""
        pairs = [(r.num_tokens, r.duration) for r in records]
        return cls.fit([n for n, _ in pairs], [s for _, s in pairs])

    def __call__(self, num_tokens: int) -> float:
        """Predicted seconds of one step with num_tokens tokens."""
        return self.fixed + self.per_token * num_tokens

    def predict(self, step_tokens: Iterable[int]) -> float:
        """Predicted seconds of a run of steps, given the tokens of each."""
        return sum(self(n) for n in step_tokens)

    @property
    def tokens_worth(self) -> float:
        """The fixed cost in tokens: how many tokens cost as much as one more step."""
        return self.fixed / self.per_token if self.per_token else math.inf

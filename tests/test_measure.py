"""measure: interleaved repeats, medians with their range, the step-cost fit. No clock is asserted."""

import math
import time
from types import SimpleNamespace

import pytest

from nano_engine.lab.measure import Spread, StepCost, interleave, timed


def test_interleave_rotates_the_order_and_repeats_each_run():
    calls = []
    runs = {k: (lambda k=k: calls.append(k) or len(calls)) for k in "abc"}
    out = interleave(runs, repeats=3)
    # Round r starts at key r: each key is first, second and third once.
    assert calls == list("abc" "bca" "cab")
    assert {k: len(v) for k, v in out.items()} == {"a": 3, "b": 3, "c": 3}
    assert out["a"] == [1, 6, 8]  # the results come back by key, in the order they were made


def test_interleave_shows_a_progress_bar_only_when_asked(capsys):
    interleave({"a": lambda: 1}, repeats=2)
    assert capsys.readouterr().err == ""
    interleave({"a": lambda: 1, "b": lambda: 2}, repeats=3, progress="timing")
    err = capsys.readouterr().err  # tqdm.auto writes a text bar outside a notebook
    assert "timing" in err and "6/6" in err  # the bar counts every call: repeats x runs


@pytest.mark.parametrize("runs, repeats, error, named", [
    ({"a": lambda: 1}, 0, ValueError, "repeats"), ({"a": lambda: 1}, True, ValueError, "repeats"),
    ({}, 1, ValueError, "runs"), ({"a": 3}, 1, TypeError, r"runs\['a'\]"),
])
def test_interleave_refuses_bad_arguments_naming_them(runs, repeats, error, named):
    with pytest.raises(error, match=named):
        interleave(runs, repeats=repeats)


def test_timed_returns_seconds():
    before = time.perf_counter()
    seconds = timed(lambda: sum(range(1000)))()
    assert isinstance(seconds, float) and 0 <= seconds <= time.perf_counter() - before


def test_spread_is_median_and_range():
    s = Spread.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.low, s.high, s.n) == (2.5, 1.0, 10.0, 4)
    assert s.relative == pytest.approx(9 / 2.5)
    assert Spread.of([0.1234, 0.1, 0.2]).fmt(1000) == "123 (100-200)"
    assert Spread.of([1.0, 2.0]).fmt(digits=2) == "1.50 (1.00-2.00)"


def test_within_noise_means_overlapping_ranges():
    a, b, c = Spread.of([1, 2, 3]), Spread.of([3, 4, 5]), Spread.of([3.5, 4, 6])
    assert a.within_noise(b) and b.within_noise(a)  # touching at 3
    assert not a.within_noise(c) and not c.within_noise(a)
    assert b.within_noise(c)


def test_spread_refuses_empty_and_nan():
    with pytest.raises(ValueError, match="at least one value"):
        Spread.of([])
    with pytest.raises(ValueError, match="NaN"):
        Spread.of([1.0, math.nan])


def test_step_cost_recovers_a_line_and_predicts_a_schedule():
    tokens = [1, 8, 32, 64, 128, 512]
    cost = StepCost.fit(tokens, [0.05 + 0.002 * n for n in tokens])
    assert cost.fixed == pytest.approx(0.05) and cost.per_token == pytest.approx(0.002)
    assert cost.tokens_worth == pytest.approx(25)
    assert cost(100) == pytest.approx(0.25)
    assert cost.predict([100, 1, 1]) == pytest.approx(0.25 + 2 * 0.052)


def test_step_cost_fits_a_step_log():
    log = [SimpleNamespace(num_tokens=n, duration=0.01 + 0.001 * n) for n in (4, 4, 40, 100)]
    cost = StepCost.fit_log(log)
    assert cost.fixed == pytest.approx(0.01) and cost.per_token == pytest.approx(0.001)


def test_step_cost_needs_two_step_sizes_and_paired_data():
    two = StepCost.fit([2, 6, 6], [0.3, 0.7, 0.7])  # two sizes are enough
    assert two.fixed == pytest.approx(0.1) and two.per_token == pytest.approx(0.1)
    with pytest.raises(ValueError, match="two sizes"):
        StepCost.fit([8, 8, 8], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="pair up"):
        StepCost.fit([1, 2], [0.1])

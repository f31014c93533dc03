"""Mutant of exercise 132: goodput tests `goodput_slos is not None`, so an empty mapping makes every request good."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "an empty mapping of SLOs, like None, gives no goodput"

_model_calculate_metrics = calculate_metrics


def calculate_metrics(records, duration, goodput_slos=None, percentiles=(50, 90, 99)):  # noqa: F811
    out = _model_calculate_metrics(records, duration, goodput_slos, percentiles)
    if goodput_slos is not None:  # MUTANT: {} is not None, and all() over no SLO is True
        done = [r for r in records if r.success]
        out["request_goodput"] = sum(is_good(r, goodput_slos) for r in done) / duration
    return out

"""Mutant of exercise 132: the ITL pools the gaps of every request, failed ones included (a stream cut after
some chunks has gaps)."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part

_model_calculate_metrics = calculate_metrics


def calculate_metrics(records, duration, goodput_slos=None, percentiles=(50, 90, 99)):  # noqa: F811
    out = _model_calculate_metrics(records, duration, goodput_slos, percentiles)
    _summary("itl", [gap for r in records for gap in itls(r)], percentiles, out)  # MUTANT: records, not done
    return out

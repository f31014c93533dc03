"""Mutant of exercise 132: a one-token request enters the TPOT statistics as 0, as it does against a TPOT SLO."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "taken over the requests of 2 or more output tokens only"

_model_summary = _summary


def _summary(name, values, percentiles, out):  # noqa: F811
    if name == "tpot":  # MUTANT: the one-token requests (tpot None) become 0 in the statistics
        values = [tpot(r) or 0.0 for r in _DONE]
    _model_summary(name, values, percentiles, out)


_model_calculate_metrics = calculate_metrics


def calculate_metrics(records, duration, goodput_slos=None, percentiles=(50, 90, 99)):  # noqa: F811
    global _DONE
    _DONE = [r for r in records if r.success]
    return _model_calculate_metrics(records, duration, goodput_slos, percentiles)

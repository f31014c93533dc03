"""Mutant of exercise 132: percentile sorts the caller's list in place (values.sort()): the answer is
right, and the caller's list is reordered."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part

EXPECTED_HINT = "sort a copy (sorted(values)), not the caller's list"
_model_percentile = percentile


def percentile(values, p):  # noqa: F811
    values.sort()  # MUTANT: the caller's list, sorted in place
    return _model_percentile(values, p)

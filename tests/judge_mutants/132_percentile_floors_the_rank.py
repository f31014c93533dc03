"""Mutant of exercise 132: the percentile takes the value at the rank rounded down, without interpolating."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "interpolate linearly"


def percentile(values, p):  # noqa: F811
    xs = sorted(values)
    return xs[int((len(xs) - 1) * p / 100)]  # MUTANT: floor of the rank, no interpolation

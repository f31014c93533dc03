"""Mutant of exercise 132: percentiles by nearest rank instead of numpy's linear interpolation."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


def percentile(values, p):
    xs = sorted(values)
    return xs[max(math.ceil(p / 100 * len(xs)) - 1, 0)]  # MUTANT: nearest rank

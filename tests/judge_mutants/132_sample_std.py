"""Mutant of exercise 132: the std divides by n - 1 (statistics.stdev), not by n as numpy.std."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "std is the population std"


def _summary(name, values, percentiles, out):  # noqa: F811
    xs = values or [0.0]
    mean = sum(xs) / len(xs)
    out[f"mean_{name}_ms"] = mean * 1000
    out[f"median_{name}_ms"] = percentile(xs, 50) * 1000
    out[f"std_{name}_ms"] = math.sqrt(sum((x - mean) ** 2 for x in xs) / max(len(xs) - 1, 1)) * 1000  # MUTANT
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = percentile(xs, p) * 1000

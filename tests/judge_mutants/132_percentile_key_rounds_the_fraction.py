"""Mutant of exercise 132: the key is written with int(p), so 99.9 overwrites p99 and p99.9 is missing."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "p99.9_e2el_ms"


def _summary(name, values, percentiles, out):  # noqa: F811
    xs = values or [0.0]
    mean = sum(xs) / len(xs)
    out[f"mean_{name}_ms"] = mean * 1000
    out[f"median_{name}_ms"] = percentile(xs, 50) * 1000
    out[f"std_{name}_ms"] = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) * 1000
    for p in percentiles:
        out[f"p{int(p)}_{name}_ms"] = percentile(xs, p) * 1000  # MUTANT: a fractional percentile loses its key

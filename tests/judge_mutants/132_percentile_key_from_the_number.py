"""Mutant of exercise 132: the key is written f"p{p}", so a percentile given as 99.0 (as vLLM parses it) gives p99.0."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "p99_itl_ms (for p = 99 or 99.0)"


def _summary(name, values, percentiles, out):  # noqa: F811
    xs = values or [0.0]
    mean = sum(xs) / len(xs)
    out[f"mean_{name}_ms"] = mean * 1000
    out[f"median_{name}_ms"] = percentile(xs, 50) * 1000
    out[f"std_{name}_ms"] = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) * 1000
    for p in percentiles:
        out[f"p{p}_{name}_ms"] = percentile(xs, p) * 1000  # MUTANT: 99.0 is written p99.0, not p99

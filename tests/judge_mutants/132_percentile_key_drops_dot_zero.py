"""Mutant of exercise 132: the key is written f"p{p}".replace(".0", ""), which turns 99.0 into p99 but also 10.05 into p105.

It passes every hand-made percentile (99, 99.0, 99.9, 12.5, 33.3, 0.1): only a fraction with a 0 right after
the point (0.05, 10.05) shows it, and the random traces draw such fractions.
"""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "a percentile's number is str(int(p)) when p is whole, else str(p)"
EXPECTED_CASE = "random_traces"


def _summary(name, values, percentiles, out):  # noqa: F811
    xs = values or [0.0]
    mean = sum(xs) / len(xs)
    out[f"mean_{name}_ms"] = mean * 1000
    out[f"median_{name}_ms"] = percentile(xs, 50) * 1000
    out[f"std_{name}_ms"] = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) * 1000
    for p in percentiles:
        out[f"p{p}_{name}_ms".replace(".0", "")] = percentile(xs, p) * 1000  # MUTANT: 10.05 -> p105

"""Mutant of exercise 132: the std in one pass, sqrt(mean(x²) - mean²), the textbook formula that cancels.

Right in exact arithmetic and on the hand-made traces (dyadic times, or values far apart); on recorded
times that are equal or nearly equal, mean(x²) - mean² is rounding noise, so the std of equal values
comes out as a few 1e-6 ms instead of 0 (or as a complex number, ** 0.5 of a negative one).
"""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


EXPECTED_HINT = "sqrt(mean(x²) - mean²) cancels to rounding noise"
EXPECTED_CASE = "random_traces"


def _summary(name, values, percentiles, out):  # noqa: F811
    xs = values or [0.0]
    mean = sum(xs) / len(xs)
    out[f"mean_{name}_ms"] = mean * 1000
    out[f"median_{name}_ms"] = percentile(xs, 50) * 1000
    out[f"std_{name}_ms"] = (sum(x * x for x in xs) / len(xs) - mean ** 2) ** 0.5 * 1000  # MUTANT: cancels
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = percentile(xs, p) * 1000

"""Mutant of exercise 132: goodput counts a request as good only when its value is strictly below the SLO."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


def is_good(r, slos):
    value = {"ttft": ttft(r), "tpot": tpot(r) or 0.0, "e2el": e2el(r)}
    return all(value[name] < slo / 1000 for name, slo in slos.items())  # MUTANT: < instead of <=

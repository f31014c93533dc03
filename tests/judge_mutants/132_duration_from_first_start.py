"""Mutant of exercise 132: the duration is taken from the first request's start to the last end, not the one given."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


def benchmark_duration(records, duration):
    return max(r.end for r in records) - min(r.start for r in records)  # MUTANT: ignores the given duration

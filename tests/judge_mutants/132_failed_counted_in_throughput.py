"""Mutant of exercise 132: request throughput counts failed requests as if they had completed."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


def request_throughput(done, records, duration):
    return len(records) / duration  # MUTANT: failed requests counted

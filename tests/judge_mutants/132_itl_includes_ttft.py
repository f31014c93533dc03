"""Mutant of exercise 132: the first inter-token latency is measured from the start, so TTFT counts as an ITL."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


def itls(r):
    times = [r.start] + list(r.chunk_times)  # MUTANT: TTFT becomes the first gap
    return [times[i] - times[i - 1] for i in range(1, len(times))]

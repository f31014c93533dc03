"""Mutant of exercise 132: TPOT divides by output_tokens, as if the first token were one of the decoded ones."""

from pathlib import Path

_MODEL = Path(__file__).with_name("model_132.py")
exec(compile(_MODEL.read_text(), str(_MODEL), "exec"))  # the model solution; below, one mistake replaces a part


def tpot(r):
    if r.output_tokens < 2:
        return None
    return (e2el(r) - ttft(r)) / r.output_tokens  # MUTANT: not output_tokens - 1

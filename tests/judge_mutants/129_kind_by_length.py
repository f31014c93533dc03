"""Mutant of exercise 129: labels a chunk by its length (1 token = decode) instead of req.chunk_kind."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402


class Scheduler(Model):
    def schedule(self):
        out = super().schedule()
        for c in out.chunks:
            c.kind = "decode" if c.n == 1 else "prefill"  # MUTANT
        return out

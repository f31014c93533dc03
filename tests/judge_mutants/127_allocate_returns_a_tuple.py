"""Mutant of exercise 127: allocate returns the blocks it took as a tuple ("the ids never change"), not
the list the statement asks for; the scheduler extends a request's block table with it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_127 import BlockPool as Model  # noqa: E402

EXPECTED_HINT = "allocate returns the list of the blocks it took"


class BlockPool(Model):
    def allocate(self, n):
        return tuple(super().allocate(n))  # MUTANT: a tuple, not a list

"""Mutant of exercise 139: combine is the tree over the partials, as if each rank were one leaf."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_139 import rank_partial, tree_sum  # noqa: E402,F401

EXPECTED_HINT = "is not the tree over the 4 partials"


def combine(partials, nodes, num_leaves):
    return tree_sum(partials)  # MUTANT: nodes and num_leaves ignored

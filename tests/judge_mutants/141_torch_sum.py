"""Mutant of exercise 141: the library's own reduction, which adds in its own order."""

EXPECTED_HINT = "your sums are x.sum(dim=1)'s"


def row_sums(x):
    return x.sum(dim=1)  # MUTANT: torch's order (vectorized lanes), not the statement's

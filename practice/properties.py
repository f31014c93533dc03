"""Property-based cases: inputs drawn at random by hypothesis, each compared with the package's reference.

The hand-made cases of an exercise each test one rule on one input. A property case draws many
inputs from a strategy (shapes, lengths, logits far apart or tied, empty and fractional parameters)
and runs the same comparison on each. The seed is fixed, so the same inputs are drawn on every run
and a verdict can be replayed. When an input differs, hypothesis shrinks it (fewer tokens, smaller
numbers, shorter scripts) to the smallest input that still differs, and the learner sees that one:
the input, what was expected, what came, and the hint of the comparison that failed.

    Case("random_logits", lambda api: check_property(st.lists(...), lambda x: compare(api, x)))

`check` raises practice.worker.Mismatch on a wrong answer, as every case does. An exception from
the learner's code is shrunk the same way and then reported as a runtime error, with its traceback.
"""

from __future__ import annotations

from typing import Any, Callable

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st

from .worker import Mismatch

__all__ = ["check_property", "st"]


def check_property(strategy: st.SearchStrategy, check: Callable[[Any], None], *, examples: int = 100,
                   seed: int = 0) -> None:
    """Run check on `examples` inputs drawn from strategy; raise the Mismatch of the smallest one that fails."""
    @fixed_seed(seed)
    @settings(max_examples=examples, database=None, deadline=None, derandomize=False, print_blob=False,
              verbosity=Verbosity.quiet, report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
              phases=(Phase.explicit, Phase.generate, Phase.shrink))
    @given(strategy)
    def prop(value):
        check(value)

    try:
        prop()
    except Mismatch as e:
        raise Mismatch(f"{examples} random inputs (seed {seed}); the smallest one that differs:",
                       *e.lines) from None

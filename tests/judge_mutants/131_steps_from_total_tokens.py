"""Mutant of exercise 131: the steps as all the tokens to compute divided by the requests that decode per step.

A learner who thinks in throughput: num_requests * max_tokens tokens, min(max_num_seqs, budget) of them per
step. Right when the waves are full; wrong when the last wave is not, since each of its requests still gets
one token per step (it takes max_tokens steps, whatever the budget left idle).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_131 import max_decodes_per_step, prefill_tokens, check_config  # noqa: E402, F401

EXPECTED_HINT = "each wave takes max_tokens steps even when it is not full"


def steps_to_finish(num_requests, max_tokens, max_num_seqs, max_num_batched_tokens):
    per_step = min(max_num_seqs, max_num_batched_tokens)
    return -(-num_requests * max_tokens // per_step)  # MUTANT: ceil(n / per_step) * max_tokens

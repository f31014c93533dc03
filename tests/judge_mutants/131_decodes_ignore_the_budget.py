"""Mutant of exercise 131: a step decodes max_num_seqs requests, whatever the budget."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_131 import steps_to_finish, prefill_tokens, check_config  # noqa: E402, F401

EXPECTED_HINT = "a decode costs one token of the budget: 4 tokens decode at most 4 requests"


def max_decodes_per_step(max_num_seqs, max_num_batched_tokens):
    return max_num_seqs  # MUTANT: min(max_num_seqs, max_num_batched_tokens)

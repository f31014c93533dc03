"""Mutant of exercise 131: requests run in waves of max_num_seqs, as if the budget did not cap a step."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_131 import max_decodes_per_step, prefill_tokens, check_config  # noqa: E402, F401

EXPECTED_HINT = "requests run in waves of min(max_num_seqs, max_num_batched_tokens)"


def steps_to_finish(num_requests, max_tokens, max_num_seqs, max_num_batched_tokens):
    return -(-num_requests // max_num_seqs) * max_tokens  # MUTANT: waves of min(max_num_seqs, budget)

"""Mutant of exercise 131: a budget equal to max_num_seqs is warned about too."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_131 import max_decodes_per_step, steps_to_finish, prefill_tokens  # noqa: E402, F401

EXPECTED_HINT = "expected None: the engine decoded all 6 requests in one step"


def check_config(max_num_seqs, max_num_batched_tokens):
    if max_num_batched_tokens > max_num_seqs:  # MUTANT: >= is fine, the budget decodes them all
        return None
    return f"max_num_batched_tokens={max_num_batched_tokens} should exceed max_num_seqs={max_num_seqs}"

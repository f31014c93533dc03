"""Mutant of exercise 131: check_config calls warnings.warn and returns None, instead of returning the warning."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_131 import max_decodes_per_step, steps_to_finish, prefill_tokens  # noqa: E402, F401

EXPECTED_HINT = "return the warning as a str (warnings.warn returns None)"

import warnings  # noqa: E402


def check_config(max_num_seqs, max_num_batched_tokens):
    if max_num_batched_tokens < max_num_seqs:
        warnings.warn(f"max_num_batched_tokens={max_num_batched_tokens} < max_num_seqs={max_num_seqs}")
    return None  # MUTANT: the warning should be returned

"""Mutant of exercise 131: the number of steps as a float (numpy's ceil), right in value, not an int."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_131 import max_decodes_per_step, prefill_tokens, check_config  # noqa: E402, F401

EXPECTED_HINT = "steps_to_finish is a count: return an int, not a float64"

import numpy as np  # noqa: E402


def steps_to_finish(num_requests, max_tokens, max_num_seqs, max_num_batched_tokens):
    return np.ceil(num_requests / min(max_num_seqs, max_num_batched_tokens)) * max_tokens  # MUTANT: np.float64

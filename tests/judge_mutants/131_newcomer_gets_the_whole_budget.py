"""Mutant of exercise 131: a newcomer gets the whole budget, as if the decodes did not use it first."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_131 import max_decodes_per_step, steps_to_finish, check_config  # noqa: E402, F401

EXPECTED_HINT = "running requests are served first, one token per decode: the newcomer gets what is left"


def prefill_tokens(num_decoding, prompt_len, max_num_seqs, max_num_batched_tokens):
    if num_decoding >= max_num_seqs:
        return 0
    return min(prompt_len, max_num_batched_tokens)  # MUTANT: max_num_batched_tokens - num_decoding

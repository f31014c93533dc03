"""Mutant of exercise 131: a prompt that does not fit in what is left of the budget waits, instead of being chunked."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_131 import max_decodes_per_step, steps_to_finish, check_config  # noqa: E402, F401

EXPECTED_HINT = "a prompt that does not fit is chunked, not postponed"


def prefill_tokens(num_decoding, prompt_len, max_num_seqs, max_num_batched_tokens):
    if num_decoding >= max_num_seqs or prompt_len > max_num_batched_tokens - num_decoding:
        return 0  # MUTANT: chunked prefill computes min(prompt_len, budget - num_decoding)
    return prompt_len

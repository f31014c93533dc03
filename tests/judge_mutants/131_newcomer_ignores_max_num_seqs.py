"""Mutant of exercise 131: a newcomer is admitted even when max_num_seqs requests already run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_131 import max_decodes_per_step, steps_to_finish, check_config  # noqa: E402, F401

EXPECTED_HINT = "requests already run: the newcomer is not admitted this step"


def prefill_tokens(num_decoding, prompt_len, max_num_seqs, max_num_batched_tokens):
    return min(prompt_len, max_num_batched_tokens - num_decoding)  # MUTANT: 0 when num_decoding >= max_num_seqs

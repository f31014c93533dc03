"""Mutant of exercise 131: the prefill counted as a step of its own before max_tokens decode steps."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_131 import max_decodes_per_step, prefill_tokens, check_config  # noqa: E402, F401

EXPECTED_HINT = "not max_tokens + 1"


def steps_to_finish(num_requests, max_tokens, max_num_seqs, max_num_batched_tokens):
    waves = -(-num_requests // min(max_num_seqs, max_num_batched_tokens))
    return waves * (1 + max_tokens)  # MUTANT: the prefill already samples the first token: waves * max_tokens

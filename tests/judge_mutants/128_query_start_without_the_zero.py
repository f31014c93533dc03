"""Mutant of exercise 128: query_start holds each chunk's end, [n0, n0 + n1, ...], without the leading 0."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import model_128  # noqa: E402
from model_128 import slot_mapping  # noqa: E402, F401

EXPECTED_HINT = "query_start starts with 0"


def build_batch(chunks, block_size):
    out = model_128.build_batch(chunks, block_size)
    return out._replace(query_start=out.query_start[1:])  # MUTANT: B entries, not B + 1

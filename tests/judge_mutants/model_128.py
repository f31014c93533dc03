"""A learner-style solution of exercise 128, written from the statement alone: it passes every case.

The mutants next to it reuse one function and break the other.
"""

from typing import NamedTuple

import torch


class BatchInputs(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start: list
    logits_indices: torch.Tensor


def slot_mapping(block_ids, start, end, block_size):
    return torch.tensor([block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)],
                        dtype=torch.long)


def build_batch(chunks, block_size):
    ids, positions, slots, query_start, logits = [], [], [], [0], []
    for c in chunks:
        n = len(c.token_ids)
        ids += list(c.token_ids)
        positions += range(c.num_cached, c.num_cached + n)
        slots.append(slot_mapping(c.block_ids, c.num_cached, c.num_cached + n, block_size))
        query_start.append(query_start[-1] + n)
        if c.sample:
            logits.append(query_start[-1] - 1)
    return BatchInputs(torch.tensor(ids), torch.tensor(positions), torch.cat(slots), query_start,
                       torch.tensor(logits, dtype=torch.long))

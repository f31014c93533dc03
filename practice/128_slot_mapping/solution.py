"""Exercise 128: slot mapping, and the inputs of one forward pass over a ragged batch. Edit this
file, then run

    python practice/judge.py 128

Implement the two functions below; the statement is in README.md. The judge compares them with
nano_engine.runner's, then runs nano_engine's ModelRunner on the batches you build.

A step's work for one sequence is a nano_engine.runner.SeqChunk(token_ids, num_cached, block_ids,
sample): `token_ids`, the new tokens of this step, sit at positions num_cached .. num_cached + n - 1
(n = len(token_ids)); `block_ids` is the sequence's block table (block i holds positions
i * block_size .. (i + 1) * block_size - 1); `sample` says whether this step reaches the sequence's
last token, so that the model must produce logits for it.
"""

from typing import NamedTuple, Sequence

import torch

from nano_engine.runner import SeqChunk


class BatchInputs(NamedTuple):
    input_ids: torch.Tensor  # (T,) long: the new tokens of every chunk, back to back
    positions: torch.Tensor  # (T,) long: each token's position in its own sequence
    slot_mapping: torch.Tensor  # (T,) long: the KV cache slot where each token's K and V go
    query_start: list[int]  # (B + 1,): chunk s owns rows query_start[s] .. query_start[s + 1] - 1
    logits_indices: torch.Tensor  # (S,) long: the rows whose logits are needed, in chunk order


def slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """The cache slots of positions start .. end - 1 of a sequence with this block table, (end - start,) long.

    Position p lives in block block_ids[p // block_size], at offset p % block_size in it; block b
    owns slots b * block_size .. (b + 1) * block_size - 1.
    """
    raise NotImplementedError


def build_batch(chunks: Sequence[SeqChunk], block_size: int) -> BatchInputs:
    """Flatten the chunks of one step into the inputs of one forward pass.

    The rows are the chunks' new tokens, chunk after chunk. Only a chunk with sample=True gets a
    logits row: its last new token, the one whose output predicts the next token.
    """
    raise NotImplementedError

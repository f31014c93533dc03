"""One ragged batch gives every sequence the logits it would get alone."""

import pytest
import torch

from nano_engine.paged import BlockPool
from nano_engine.runner import ModelRunner, SeqChunk, build_batch


def test_build_batch_shapes_and_logits_rows():
    chunks = [SeqChunk([5, 6, 7], 0, [2, 0], True), SeqChunk([9], 4, [1, 3, 4], True),
              SeqChunk([1, 2], 2, [5, 6], False)]
    b = build_batch(chunks, block_size=2)
    assert b.positions.tolist() == [0, 1, 2, 4, 2, 3]
    assert b.slot_mapping.tolist() == [4, 5, 0, 8, 12, 13]
    assert b.logits_indices.tolist() == [2, 3]  # the third chunk is mid-prompt: no logits


def test_ragged_batch_equals_each_sequence_alone(tiny):
    """A prefill, a chunk on top of a cached prefix and a decode, in one pass."""
    bs, pool = 4, BlockPool(32)
    runner = ModelRunner(tiny, 32, bs)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (9, 13, 6)]
    tables = [pool.allocate(4) for _ in seqs]
    # Put the first 10 tokens of seq 1 and 5 of seq 2 in the cache with a first pass.
    runner.forward(build_batch([SeqChunk(seqs[1][:10], 0, tables[1], False),
                                SeqChunk(seqs[2][:5], 0, tables[2], False)], bs))
    logits = runner.forward(build_batch([
        SeqChunk(seqs[0], 0, tables[0], True),          # prefill
        SeqChunk(seqs[1][10:], 10, tables[1], True),    # last chunk of a prefill
        SeqChunk(seqs[2][5:], 5, tables[2], True),      # a decode
    ], bs))
    for row, s in zip(logits, seqs):
        alone = tiny.compute_logits(tiny(torch.tensor(s), torch.arange(len(s))))[-1]
        assert torch.allclose(row, alone, atol=1e-12)


def test_build_batch_refuses_by_what_is_wrong_and_types_even_an_empty_batch():
    with pytest.raises(ValueError, match="at least one new token"):
        build_batch([SeqChunk([], 0, [0], True)], block_size=4)
    with pytest.raises(ValueError, match="1 blocks cannot hold 6 tokens"):
        build_batch([SeqChunk([1, 2], 4, [0], True)], block_size=4)
    empty = build_batch([], block_size=4)
    assert [t.dtype for t in (empty.input_ids, empty.positions, empty.slot_mapping, empty.logits_indices)] == \
        [torch.long] * 4 and empty.num_tokens == 0

"""Cases of exercise 128: the learner's slot mapping and batch inputs against nano_engine.runner's.

Hand-made and random chunks first (a prefill, a chunk on top of a cached prefix, decodes, a chunk
in the middle of a prompt that samples nothing), comparing input_ids, positions, slot_mapping,
query_start and logits_indices one by one; a difference is reported with the chunks, what was
expected, what came and a hint that names the usual mistake (slots taken from positions instead of
the block table, an off-by-one start, the first token's logits row instead of the last). The
tensors are checked as they come, before any value is read: 1-D and torch.long, as the engine
indexes with them (a list, int32, or the float32 of an empty torch.tensor([]) fails there). Then
nano_engine's ModelRunner runs three steps on the learner's own batches over a tiny model: every
sampled row's logits must equal those of its sequence run alone. Last, property cases draw slot
ranges and batches at random (practice/properties.py) and run the same comparisons; the smallest
input that differs is the one shown.
"""

import dataclasses
import operator
import random
from types import SimpleNamespace

import torch

import nano_engine.runner as ref
from nano_engine.runner import SeqChunk
from nano_engine.tiny import tiny_model
from practice.properties import check_property, st
from practice.worker import Case, Mismatch, require_functions

REFERENCE_FILE = ref.__file__
FIELDS = ("input_ids", "positions", "slot_mapping", "query_start", "logits_indices")


def _slots(block_ids, start, end, block_size):
    if hasattr(ref, "slots_of"):
        return ref.slots_of(block_ids, start, end, block_size)
    return ref.build_batch([SeqChunk([0] * (end - start), start, block_ids, False)], block_size).slot_mapping


def learner(module):
    return require_functions(module, ("slot_mapping", "build_batch"))


def reference():
    return SimpleNamespace(slot_mapping=_slots, build_batch=ref.build_batch)


def _ints(x, what: str) -> list[int]:
    try:
        return [operator.index(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)]
    except (TypeError, ValueError):
        raise Mismatch(f"{what} is {type(x).__name__} {x!r:.60}", "  expected a 1-D tensor or list of integers",
                       "hint: return torch.tensor(values, dtype=torch.long)") from None


def _kind(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}, {x.dtype}"
    return f"a {type(x).__name__}" + (f" of {len(x)} items" if hasattr(x, "__len__") else "")


# What the engine does with each tensor: why it must be torch.long.
_USE = {
    "input_ids": "the model looks input_ids up in its embedding table",
    "positions": "the model takes each token's rotary angle from positions",
    "slot_mapping": "the KV cache is written with index_copy_(0, slot_mapping, k), which takes only a torch.long index",
    "logits_indices": "the runner picks the sampling rows with hidden[logits_indices]",
    "query_start": "the attention splits the rows at query_start (a list of ints will do)",
}


def _check_tensor(x, name: str, n: int, context: list[str]):
    """x must be what the engine indexes with: a 1-D torch.long tensor (n, the expected length, is shown)."""
    if isinstance(x, torch.Tensor) and x.dim() == 1 and x.dtype == torch.long:
        return
    pad = " " * len(name)
    lines = [*context, f"  {name}  expected a tensor of shape ({n},), torch.int64", f"  {pad}  got      {_kind(x)}"]
    if not isinstance(x, torch.Tensor):
        hint = (f"{name} goes to the engine as a tensor, not a {type(x).__name__}: "
                "torch.tensor(values, dtype=torch.long)")
    elif x.dim() != 1:
        hint = f"{name} is one flat row, one entry per {'sampling chunk' if name == 'logits_indices' else 'new token'}"
    elif x.numel() == 0 and x.dtype == torch.float32:
        need = "" if "torch.long" in _USE[name] else ", which needs an integer index"
        hint = f"torch.tensor([]) of an empty list is float32, and {_USE[name]}{need}: give dtype=torch.long"
    else:
        hint = f"tensors are torch.long: {_USE[name]}; build it with dtype=torch.long"
    raise Mismatch(*lines, "hint: " + hint)


def _positions(block_ids, positions, block_size):
    return [block_ids[p // block_size] * block_size + p % block_size for p in positions]


def _span(a: int, b: int) -> str:
    return f"position {a}" if b == a + 1 else f"positions {a} .. {b - 1}"


def _slot_hint(got, block_ids, start, end, block_size) -> str:
    """One sentence for a wrong slot list of positions start..end-1 of one sequence."""
    n = end - start
    if got == list(range(start, end)):
        return ("a token's slot comes from the block table, block_ids[p // block_size] * block_size + "
                "p % block_size, not its position p: blocks are anywhere in the cache")
    if got == [block_ids[p // block_size] + p % block_size for p in range(start, end)]:
        return "a block owns block_size slots: slot = block_id * block_size + offset, not block_id + offset"
    if block_size & (block_size - 1):  # not a power of two: shifts and masks give other blocks and offsets
        bits, low = block_size.bit_length() - 1, block_size - 1
        if got == [block_ids[p // block_size] * block_size + (p & low) for p in range(start, end)]:
            return (f"block_size {block_size} is not a power of two: p & {low} is not p % {block_size}; "
                    "use %, which holds for any block size")
        if got == [block_ids[p >> bits] << bits | p & low for p in range(start, end)]:
            return (f"block_size {block_size} is not a power of two: p >> {bits} and p & {low} are not "
                    f"p // {block_size} and p % {block_size}; use // and %, which hold for any block size")
    for shift in (1, -1):
        if 0 <= start + shift and end + shift <= len(block_ids) * block_size and \
                got == _positions(block_ids, range(start + shift, end + shift), block_size):
            return (f"off by one: these are the slots of {_span(start + shift, end + shift)}; the new "
                    f"tokens sit at {_span(start, end)}")
    if start and got == _positions(block_ids, range(n), block_size):
        return f"the new tokens come after {start} cached ones: they sit at {_span(start, end)}, not {_span(0, n)}"
    return "slot of position p = block_ids[p // block_size] * block_size + p % block_size"


def _check_slots(api, block_ids, start, end, bs):
    call = f"slot_mapping(block_ids={block_ids}, start={start}, end={end}, block_size={bs})"
    want = _ints(_slots(block_ids, start, end, bs), "the reference")
    out = api.slot_mapping(list(block_ids), start, end, bs)
    _check_tensor(out, "slot_mapping", end - start, [call])
    got = _ints(out, call)
    if got != want:
        raise Mismatch(call, f"  expected {want}", f"  got      {got}",
                       "hint: " + _slot_hint(got, block_ids, start, end, bs))


def _describe(chunks, bs) -> list[str]:
    rows = [f"chunks (block_size {bs}):"]
    for s, c in enumerate(chunks):
        n = len(c.token_ids)
        rows.append(f"  {s}: {n} new token{'s' * (n != 1)} {list(c.token_ids)} on {c.num_cached} cached, "
                    f"blocks {list(c.block_ids)}" + (", samples" if c.sample else ", samples nothing"))
    return rows


def _field_hint(name, got, chunks, bs) -> str:
    lens = [len(c.token_ids) for c in chunks]
    starts = [sum(lens[:s]) for s in range(len(chunks) + 1)]
    if name in ("input_ids", "positions", "slot_mapping") and len(got) != starts[-1]:
        return f"{name} has one entry per new token: {starts[-1]} here, chunk after chunk"
    if name == "input_ids":
        return "input_ids are every chunk's new tokens (c.token_ids), back to back in chunk order"
    if name == "positions":
        if got == [p for n in lens for p in range(n)]:
            return "positions continue from num_cached: a chunk's new tokens sit at num_cached .. num_cached + n - 1"
        return "positions: num_cached .. num_cached + n - 1 for each chunk, back to back"
    if name == "slot_mapping":
        for s, c in enumerate(chunks):
            part, end = got[starts[s]:starts[s + 1]], c.num_cached + lens[s]
            if part != _positions(c.block_ids, range(c.num_cached, end), bs):
                return f"chunk {s}: " + _slot_hint(part, list(c.block_ids), c.num_cached, end, bs)
        return "one slot per new token, chunk after chunk"
    if name == "query_start":
        if got == starts[1:]:
            return "query_start starts with 0: [0, n0, n0 + n1, ...], B + 1 entries"
        if got == lens:
            return "query_start is cumulative: [0, n0, n0 + n1, ...], B + 1 entries"
        return "query_start starts at 0 and adds each chunk's number of new tokens: B + 1 entries"
    sampling = [s for s, c in enumerate(chunks) if c.sample]
    if got == [starts[s] for s in sampling]:
        return ("the row that samples is a chunk's LAST new token, query_start[s + 1] - 1: its output predicts "
                "the next token")
    if len(got) > len(sampling):
        return ("only a chunk with sample=True gets a logits row: a chunk in the middle of a prompt predicts "
                "nothing anyone needs")
    return "one row per chunk with sample=True, its last new token, query_start[s + 1] - 1, in chunk order"


def _compare(api, chunks, bs, context=None):
    """(the learner's BatchInputs, its fields as lists, the first wrong field's report lines or None).
    A field of the wrong type (not a 1-D torch.long tensor) is a Mismatch at once, under context."""
    want = ref.build_batch(chunks, bs)
    out = api.build_batch(list(chunks), bs)
    got = {}
    for name in FIELDS:
        if not hasattr(out, name):
            raise Mismatch(f"build_batch returned {type(out).__name__}, without the field {name!r}",
                           f"  expected a BatchInputs with the fields {', '.join(FIELDS)}",
                           "hint: return BatchInputs(input_ids, positions, slot_mapping, query_start, logits_indices)")
    for name in FIELDS:
        value = getattr(out, name)
        if name == "query_start":  # a list of ints (as nano_engine's), or a 1-D torch.long tensor
            if isinstance(value, torch.Tensor):
                _check_tensor(value, name, len(chunks) + 1, context or _describe(chunks, bs))
        else:
            _check_tensor(value, name, len(getattr(want, name)), context or _describe(chunks, bs))
        got[name] = _ints(value, f"build_batch(...).{name}")
    for name in FIELDS:
        w = _ints(getattr(want, name), name)
        if got[name] != w:
            return out, got, [f"  {name}  expected {w}", f"  {' ' * len(name)}  got      {got[name]}",
                              "hint: " + _field_hint(name, got[name], chunks, bs)]
    return out, got, None


def _check_batch(api, chunks, bs):
    _, _, wrong = _compare(api, chunks, bs)
    if wrong:
        raise Mismatch(*_describe(chunks, bs), *wrong)


def _random_chunks(seed, bs=4, num_blocks=32):
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    chunks = []
    for _ in range(rng.randint(2, 5)):
        cached, n = rng.choice([0, rng.randint(1, 12)]), rng.choice([1, rng.randint(1, 9)])
        table = [free.pop() for _ in range(-(-(cached + n) // bs))]
        chunks.append(SeqChunk([rng.randrange(64) for _ in range(n)], cached, table, rng.random() < 0.7))
    return chunks


def _check_random(api, seeds):
    for seed in seeds:
        _check_batch(api, _random_chunks(seed), 4)


# ----- random inputs (property cases) -----

@st.composite
def _slot_ranges(draw):
    """(block_ids, start, end, block_size): any block size (1 too), a table of distinct blocks in any
    order, a range that may be empty, one token, start or end on a block boundary, or the whole table."""
    bs = draw(st.integers(1, 16))
    table = draw(st.lists(st.integers(0, 63), min_size=1, max_size=8, unique=True))
    capacity = len(table) * bs
    start = draw(st.one_of(st.integers(0, capacity), st.sampled_from(range(0, capacity + 1, bs))))
    end = draw(st.one_of(st.integers(start, capacity), st.just(min(start + 1, capacity)), st.just(capacity),
                         st.sampled_from(range(-(-start // bs) * bs, capacity + 1, bs))))
    return table, start, end, bs


@st.composite
def _batches(draw):
    """(chunks, block_size): 1 to 12 sequences, each a prompt, a chunk on a cached prefix (often one
    ending on a block boundary) or a single decode token, sampling or not; block size 1 to 16; block
    tables of distinct blocks scattered over a cache twice their size, some with a spare block after
    the last used one. Chunk s's tokens are 100 (s + 1), 100 (s + 1) + 1, ...: rows are easy to trace."""
    bs = draw(st.integers(1, 16))
    shapes = draw(st.lists(st.tuples(
        st.one_of(st.just(0), st.integers(1, 4).map(lambda b: b * bs), st.integers(1, 40)),  # num_cached
        st.one_of(st.just(1), st.integers(1, 20)),  # new tokens
        st.booleans(),  # sample
        st.integers(0, 1)), min_size=1, max_size=12))  # spare blocks
    sizes = [-(-(c + n) // bs) + spare for c, n, _, spare in shapes]
    blocks = random.Random(draw(st.integers(0, 2 ** 16))).sample(range(2 * sum(sizes)), sum(sizes))
    chunks = []
    for s, ((c, n, sample, _), size) in enumerate(zip(shapes, sizes)):
        chunks.append(SeqChunk([100 * (s + 1) + i for i in range(n)], c, blocks[:size], sample))
        blocks = blocks[size:]
    return chunks, bs


# ----- end to end -----

def _check_forward(api, seed=0, bs=4, num_blocks=16):
    model = tiny_model(seed)
    runner = ref.ModelRunner(model, num_blocks, bs)
    gen = random.Random(seed)
    tokens = {s: [gen.randrange(1, 64) for _ in range(n)] for s, n in zip("ABCD", (11, 5, 1, 9))}
    for s in tokens:  # the decode tokens, fixed in advance: logits must match whatever the tokens are
        tokens[s] += [gen.randrange(1, 64) for _ in range(2)]
    blocks = list(range(num_blocks))
    gen.shuffle(blocks)
    table = {s: [blocks.pop() for _ in range(-(-len(t) // bs))] for s, t in tokens.items()}
    steps = [  # (sequence, num_cached, n, sample): a prompt in two chunks, prefills, decodes, all ragged
        [("A", 0, 6, False), ("B", 0, 5, True), ("C", 0, 1, True)],
        [("A", 6, 5, True), ("B", 5, 1, True), ("D", 0, 9, True), ("C", 1, 1, True)],
        [("D", 9, 1, True), ("A", 11, 1, True), ("C", 2, 1, True), ("B", 6, 1, True)],
    ]
    for i, step in enumerate(steps):
        chunks = [SeqChunk(tokens[s][c:c + n], c, table[s], smp) for s, c, n, smp in step]
        context = [f"step {i + 1} of 3 of nano_engine's ModelRunner on your batches, tiny model, "
                   f"{num_blocks} blocks of {bs}", *_describe(chunks, bs)]
        out, got, wrong = _compare(api, chunks, bs, context)
        rows = [(s, c + n) for s, c, n, smp in step if smp]
        broken = _malformed(got, len(chunks), len(rows), num_blocks * bs)
        if broken:  # it would not even run: say what is wrong with it instead
            raise Mismatch(*context, f"your batch cannot run: {broken}", *(wrong or []))
        # The learner's own tensors and query_start, as they came: nano_engine converts nothing.
        batch = dataclasses.replace(ref.build_batch(chunks, bs), **{k: getattr(out, k) for k in FIELDS})
        logits = runner.forward(batch)
        for (s, end), row in zip(rows, logits):
            alone = model.compute_logits(model(torch.tensor(tokens[s][:end]), torch.arange(end)))[-1]
            if not torch.allclose(row, alone, rtol=1e-7, atol=1e-9):
                raise Mismatch(*context, f"sequence {s}'s logits after its first {end} tokens differ from running "
                               f"it alone: expected {_short(alone)}, got {_short(row)}",
                               *(["your batch differs from nano_engine's:", *wrong] if wrong else
                                 ["hint: the batch matched nano_engine's: look for state kept between calls"]))
        if wrong:
            raise Mismatch(*context, "the logits were right, but your batch differs from nano_engine's:", *wrong)


def _short(t) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in t[:4].tolist()) + ", ...]"


def _malformed(got, num_chunks, num_sampling, num_slots) -> str | None:
    T, qs = len(got["input_ids"]), got["query_start"]
    if len(got["positions"]) != T or len(got["slot_mapping"]) != T:
        return f"{T} input_ids but {len(got['positions'])} positions and {len(got['slot_mapping'])} slots"
    if len(qs) != num_chunks + 1 or qs[0] != 0 or qs[-1] != T or any(a >= b for a, b in zip(qs, qs[1:])):
        return f"query_start {qs} does not split {T} rows into {num_chunks} chunks"
    if any(not 0 <= x < num_slots for x in got["slot_mapping"]):
        return f"a slot outside the cache's {num_slots} slots"
    if len(got["logits_indices"]) != num_sampling or any(not 0 <= x < T for x in got["logits_indices"]):
        return f"logits_indices {got['logits_indices']} should name {num_sampling} of the {T} rows"
    return None


CASES = [
    Case("slot_mapping_within_one_block", lambda api: _check_slots(api, [3], 0, 3, 4)),
    Case("slot_mapping_across_scattered_blocks", lambda api: _check_slots(api, [5, 2, 7], 0, 10, 4)),
    Case("slot_mapping_from_the_middle_of_a_block", lambda api: _check_slots(api, [5, 2, 7], 6, 11, 4)),
    Case("slot_mapping_of_one_decode_token", lambda api: _check_slots(api, [1, 0], 5, 6, 4)),
    Case("batch_one_prefill", lambda api: _check_batch(api, [SeqChunk([9, 8, 7, 6, 5], 0, [2, 0], True)], 4)),
    Case("batch_chunk_on_a_cached_prefix",
         lambda api: _check_batch(api, [SeqChunk([4, 4, 1, 2, 3], 6, [1, 6, 3], True)], 4)),
    Case("batch_decodes", lambda api: _check_batch(api, [SeqChunk([7], 4, [3, 2], True), SeqChunk([8], 0, [6], True),
                                                         SeqChunk([9], 9, [4, 5, 1], True)], 4)),
    Case("batch_mid_prompt_chunk_samples_nothing",
         lambda api: _check_batch(api, [SeqChunk([1, 2, 3], 0, [5, 6], False), SeqChunk([4], 7, [0, 2], True),
                                        SeqChunk([5, 6], 3, [1, 3], False), SeqChunk([7, 8, 9], 2, [4, 7], True)], 4)),
    Case("batch_where_no_chunk_samples",
         lambda api: _check_batch(api, [SeqChunk([1, 2, 3, 4, 5], 0, [3, 1], False),
                                        SeqChunk([6, 7], 4, [0, 2], False)], 4)),
    Case("batch_random", lambda api: _check_random(api, range(128, 148))),
    Case("end_to_end_ragged_forward_equals_each_sequence_alone", _check_forward),
    Case("slot_mapping_random_ranges",
         lambda api: check_property(_slot_ranges(), lambda a: _check_slots(api, *a), examples=100)),
    Case("batch_random_chunks_block_sizes_and_prefixes",
         lambda api: check_property(_batches(), lambda a: _check_batch(api, *a), examples=100)),
]

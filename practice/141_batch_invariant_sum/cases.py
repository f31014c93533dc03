"""Cases of exercise 141: the learner's row_sums against the fixed order of the statement (the reference
below), bit for bit, then its batch invariance: a row's sum alone, in a batch, and at one or two threads.

Hand-made cases first, one rule each (one chunk, two, three, four, five; one column, one row, a
non-contiguous x, cancellation), then random ones (practice.properties): random shapes and magnitudes
over many binades, so that any other order of the additions almost surely rounds otherwise; the
smallest that differs is shown. A wrong answer is compared with the usual wrong orders (torch.sum,
float64, other chunk sizes, the chunk sums left to right, ...) so that the hint can name the mistake.
"""

from types import SimpleNamespace

import torch

from practice.properties import check_property, st
from practice.worker import Case, Mismatch, require_functions

REFERENCE_FILE = __file__  # there is no engine function for this one: the reference is below
CHUNK = 64


def _tree(sums, lo, hi, up=True):
    """Exercise 139's tree over sums[lo:hi]: first half rounded up (or down, for a wrong variant), then the rest."""
    if hi - lo == 1:
        return sums[lo]
    mid = lo + (hi - lo + up) // 2
    return _tree(sums, lo, mid, up) + _tree(sums, mid, hi, up)


def ordered(x, chunk=CHUNK, dtype=torch.float32, combine="tree", from_end=False):
    """x's row sums in the statement's order (the defaults), or in a wrong variant of it: chunks cut from
    the end of the row (the first one shorter), sums in float64, the chunk sums left to right ("chain")
    or in the tree rounded down ("down")."""
    m, k = x.shape
    if from_end:
        bounds = ([0] if k % chunk else []) + list(range(k % chunk, k + 1, chunk))
    else:
        bounds = list(range(0, k, chunk)) + [k]
    sums = []
    for a, b in zip(bounds, bounds[1:]):
        s = torch.zeros(m, dtype=dtype)
        for j in range(a, b):
            s = s + x[:, j].to(dtype)  # one float addition per row, in column order
        sums.append(s)
    if combine == "chain":
        total = sums[0]
        for s in sums[1:]:
            total = total + s
    else:
        total = _tree(sums, 0, len(sums), up=combine == "tree")
    return total.to(torch.float32)


def ref_row_sums(x):
    return ordered(x)


def learner(module):
    return require_functions(module, ("row_sums",))


def reference():
    return SimpleNamespace(row_sums=ref_row_sums)


RULES = ("cut each row into chunks of CHUNK = 64 columns from column 0 (the last may be shorter), add each chunk's "
         "values left to right in float32 (s = s + x[:, j]), then add the chunk sums in exercise 139's tree (first "
         "half rounded up, then the rest)")
BATCH = ("batch invariance: a row's sum must not depend on how many rows are in the batch; choose the chunks and "
         "the order from K only, never from M (the number of rows)")
THREADS = "a row's sum must not depend on the number of threads: the order of the additions comes from K alone"


def _pieces(k):
    ends = [(a, min(a + CHUNK, k) - 1) for a in range(0, k, CHUNK)]
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in ends)


def _diagnose(api, x, got, hint):
    """The hint for a wrong answer: the mistake whose order gives exactly these bits, else the case's hint."""
    m, k = x.shape
    expected = ref_row_sums(x)
    bad = int((got != expected).nonzero()[0])
    if m > 1:
        alone = api.row_sums(x[bad:bad + 1].clone())
        if isinstance(alone, torch.Tensor) and alone.shape == (1,) and torch.equal(alone, expected[bad:bad + 1]):
            return (f"row {bad} alone (row_sums(x[{bad}:{bad + 1}])) is right, but in the batch of {m} rows it "
                    f"differs: " + BATCH)
    nchunks = -(-k // CHUNK)
    # The structural mistakes first: float64 and torch.sum are close to the exact sum, which other orders
    # often round to as well.
    variants = [(ordered(x, chunk=c), f"chunks of {c} columns: CHUNK = 64, whatever M and K")
                for c in (16, 32, 128, 256)]
    variants += [
        (ordered(x, from_end=True), f"the chunks start at column 0 ({_pieces(k)} here): only the LAST one may be "
                                    "shorter; yours were cut from the end of the row"),
        (ordered(x, combine="chain"), "the chunk sums were added left to right: add them in the tree, the first half "
                                      "ROUNDED UP, then the rest, each half summed the same way (4 chunks: "
                                      "(c0 + c1) + (c2 + c3))"),
        (ordered(x, combine="down"), "the tree splits a list of chunk sums into its first half ROUNDED UP and the "
                                     "rest (3 chunks: (c0 + c1) + c2, not c0 + (c1 + c2)), as in exercise 139"),
        (ordered(x, chunk=max(k, 1)), "one chain over the whole row: cut it into chunks of CHUNK = 64 columns, sum "
                                      "each, then add the chunk sums in the tree"),
        (x.sum(dim=1), "your sums are x.sum(dim=1)'s: torch.sum, x.sum and matmul add in their own order (vectorized "
                       "lanes, another order for another memory layout); add the columns yourself, s = s + x[:, j], "
                       "in the chunks and the tree of the statement"),
        (_tree([x[:, a:a + CHUNK].sum(dim=1) for a in range(0, k, CHUNK)], 0, nchunks),
         "each chunk's sum is torch.sum's: add a chunk's columns one by one, left to right, s = s + x[:, j]"),
        (ordered(x, dtype=torch.float64), "your sums were added in float64 (Python floats are float64) and rounded at "
                                          "the end: every addition must be in float32, a float32 tensor plus a float32 "
                                          "tensor, so that it rounds where the statement's order rounds"),
    ]
    for sums, why in variants:
        if not torch.equal(sums, expected) and torch.equal(got, sums):
            return why
    return hint


def _show(x):
    m, k = x.shape
    return f"row_sums(x of shape ({m}, {k}){'' if x.is_contiguous() else ', not contiguous'})"


def _check_result(call, got, m):
    if not isinstance(got, torch.Tensor):
        raise Mismatch(call, f"  expected a float32 tensor of shape ({m},)", f"  got {got!r}",
                       "hint: return a tensor, one sum per row")
    if got.dtype != torch.float32 or tuple(got.shape) != (m,):
        raise Mismatch(call, f"  expected a float32 tensor of shape ({m},)",
                       f"  got      {got.dtype} of shape {tuple(got.shape)}",
                       "hint: one float32 sum per row: shape (M,), dtype torch.float32 (float32 additions all the way)")


def _call(api, x):
    """The learner's row_sums on a copy of x (of x's layout), refusing a changed input or a malformed result."""
    given = x.clone()  # of x's own layout (clone preserves the strides of a transpose)
    got = api.row_sums(given)
    if not torch.equal(given, x):
        raise Mismatch(_show(x), "  expected x unchanged", "  got it changed",
                       "hint: read x, do not add into it (x[:, 0] += ...): make new tensors")
    _check_result(_show(x), got, x.shape[0])
    return got


def _row(x, i):
    k = x.shape[1]
    return f"  row {i}: {x[i].tolist()}" if k <= 8 else f"  row {i} starts {x[i, :6].tolist()} ..."


def check(api, x, hint=RULES):
    """row_sums(x) equal to the reference, bit for bit."""
    got = _call(api, x)
    expected = ref_row_sums(x)
    if not torch.equal(got, expected):
        bad = int((got != expected).nonzero()[0])
        raise Mismatch(_show(x), _row(x, bad), f"  expected row {bad}'s sum {expected[bad].item()!r} (bit for bit)",
                       f"  got              {got[bad].item()!r}", "hint: " + _diagnose(api, x, got, hint))


def check_batch(api, x, prefixes=None):
    """Each row alone, and the first m rows, against the same rows in the whole batch: the learner against itself."""
    m = x.shape[0]
    whole = _call(api, x)
    rows = range(m) if m <= 12 else sorted({0, 1, m // 2, m - 2, m - 1})
    for i in rows:
        alone = _call(api, x[i:i + 1])
        if not torch.equal(alone, whole[i:i + 1]):
            raise Mismatch(f"{_show(x)}[{i}] against row_sums(x[{i}:{i + 1}]) (batch invariance)",
                           f"  expected row {i} alone to be its sum in the batch of {m}: {whole[i].item()!r}",
                           f"  got {alone[0].item()!r}", "hint: " + BATCH)
    for n in prefixes or sorted({1, max(m // 2, 1), max(m - 1, 1)}):
        part = _call(api, x[:n])
        if not torch.equal(part, whole[:n]):
            i = int((part != whole[:n]).nonzero()[0])
            raise Mismatch(f"{_show(x)}[:{n}] against row_sums(x[:{n}]) (batch invariance)",
                           f"  expected row {i} of the first {n} rows to be its sum in the batch of {m}: "
                           f"{whole[i].item()!r}", f"  got {part[i].item()!r}", "hint: " + BATCH)
    check(api, x)


def check_threads(api, x):
    """The same bits under torch.set_num_threads(1) and (2); the thread count restored after."""
    before = torch.get_num_threads()
    expected = ref_row_sums(x)
    got = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got[n] = _call(api, x)
    finally:
        torch.set_num_threads(before)
    for n in (1, 2):
        if not torch.equal(got[n], expected):
            bad = int((got[n] != expected).nonzero()[0])
            other = torch.equal(got[3 - n], expected)  # right at the other thread count
            raise Mismatch(f"{_show(x)} with torch.set_num_threads({n})", _row(x, bad),
                           f"  expected row {bad}'s sum {expected[bad].item()!r} (bit for bit)",
                           f"  got              {got[n][bad].item()!r}"
                           + (f" (and the right one with torch.set_num_threads({3 - n}))" if other else ""),
                           "hint: " + (THREADS if other else _diagnose(api, x, got[n], RULES)))


def spread(m, k, seed, binades=24):
    """(m, k) float32 values of both signs whose magnitudes span `binades` binades: every order rounds otherwise."""
    gen = torch.Generator().manual_seed(seed)
    e = torch.randint(-(binades // 2), binades - binades // 2 + 1, (m, k), generator=gen).float()
    return ((torch.rand(m, k, generator=gen) + 1.0) * torch.exp2(e)
            * (torch.randint(0, 2, (m, k), generator=gen) * 2 - 1)).float()


def cancelling(m, k):
    """Rows of 1e8, 1, -1e8, 1, ...: in float32, 1e8 + 1 is 1e8, so each order keeps other ones."""
    row = torch.tensor([1e8, 1.0, -1e8, 1.0] * (-(-k // 4)))[:k]
    return torch.stack([row.roll(i) * (i + 1) for i in range(m)]).float()


def case(name, fn, *args, **kwargs):
    return Case(name, lambda api: fn(api, *args, **kwargs))


def check_x(api, make, hint=RULES):
    check(api, make(), hint)


@st.composite
def _inputs(draw, max_rows=12, max_k=300):
    m, k = draw(st.integers(1, max_rows)), draw(st.integers(1, max_k))
    x = spread(m, k, draw(st.integers(0, 10_000)), binades=draw(st.sampled_from([1, 8, 24, 60])))
    return x if draw(st.booleans()) else x.t().contiguous().t()  # sometimes not contiguous


def random_cases(examples: int) -> list[Case]:
    return [
        Case("random_rows_bit_for_bit", lambda api: check_property(_inputs(), lambda x: check(api, x),
                                                                    examples=examples)),
        Case("random_batch_invariance", lambda api: check_property(_inputs(max_rows=40, max_k=200),
                                                                    lambda x: check_batch(api, x),
                                                                    examples=examples // 2)),
        Case("random_one_and_two_threads", lambda api: check_property(_inputs(), lambda x: check_threads(api, x),
                                                                       examples=examples // 2)),
    ]


CASES = [
    case("fewer_than_64_columns_one_chunk_left_to_right", check_x, lambda: spread(6, 40, 1),
         hint="40 columns are one chunk: add them left to right in float32, s = s + x[:, j] for j = 0 .. 39"),
    case("exactly_64_columns_one_chunk", check_x, lambda: spread(6, 64, 2),
         hint="64 columns are exactly one chunk (CHUNK = 64): one chain, left to right"),
    case("65_columns_two_chunks", check_x, lambda: spread(6, 65, 3),
         hint="65 columns are two chunks, 0-63 and 64 alone: c0 + c1"),
    case("three_chunks_first_half_rounded_up", check_x, lambda: spread(6, 150, 4),
         hint="150 columns are chunks 0-63, 64-127, 128-149: (c0 + c1) + c2"),
    case("four_chunks_in_pairs", check_x, lambda: spread(6, 200, 5),
         hint="200 columns are four chunks: (c0 + c1) + (c2 + c3)"),
    case("five_chunks", check_x, lambda: spread(6, 320, 6), hint="five chunks: ((c0 + c1) + c2) + (c3 + c4)"),
    case("one_column", check_x, lambda: spread(5, 1, 7), hint="one column: each row's sum is its value"),
    case("one_row", check_x, lambda: spread(1, 130, 8)),
    case("a_non_contiguous_x", check_x, lambda: spread(100, 6, 9).t(),
         hint="x may be a view that is not contiguous (here a transpose): index it, x[:, j], and sum in the "
              "statement's order whatever its memory layout"),
    case("cancellation_1e8_1_minus_1e8_1", check_x, lambda: cancelling(4, 256)),
    case("values_over_many_binades", check_x, lambda: spread(6, 257, 10, binades=60)),
    case("a_row_alone_and_in_a_batch_of_16", lambda api: check_batch(api, spread(16, 200, 11), [1, 7, 8, 15])),
    case("one_thread_and_two_threads", lambda api: check_threads(api, spread(8, 300, 12))),
    *random_cases(80),
]

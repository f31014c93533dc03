"""Cases of exercise 140: the learner's transfer_plan against nano_engine.kv_transfer.transfer_plan,
then the plan applied: every token's KV must land in its destination slot.

Hand-made cases first, one rule each, then random ones (practice.properties): random block sizes,
block tables (distinct ids, sometimes consecutive) and token ranges; the smallest that differs shown.
"""

from types import SimpleNamespace

import torch

import nano_engine.kv_transfer as ref
from practice.properties import check_property, st
from practice.worker import Case, Mismatch, require_functions

REFERENCE_FILE = ref.__file__


def learner(module):
    return require_functions(module, ("transfer_plan",))


def reference():
    return SimpleNamespace(transfer_plan=ref.transfer_plan)


RULES = ("token p is in slot table[p // block_size] * block_size + p % block_size on each side; walk the tokens "
         "start .. end - 1 in order and extend the current run while BOTH the source and the destination slot "
         "are the previous ones + 1; otherwise start a new run")


def apply(plan, src_blocks, sbs, dst_blocks, dbs, start, end):
    """Run the plan on a source cache whose slot s holds the number s; what each token's destination holds."""
    size = (max(dst_blocks, default=0) + 1) * dbs
    src = torch.arange((max(src_blocks, default=0) + 1) * sbs)
    dst = torch.full((size,), -1, dtype=torch.long)
    for s, d, n in plan:
        dst[d:d + n] = src[s:s + n]
    slot = lambda table, bs, p: table[p // bs] * bs + p % bs  # noqa: E731
    return [(p, int(dst[slot(dst_blocks, dbs, p)]), slot(src_blocks, sbs, p)) for p in range(start, end)]


def check(api, src_blocks, sbs, dst_blocks, dbs, start, end, hint=RULES):
    call = (f"transfer_plan(src_blocks={list(src_blocks)}, src_block_size={sbs}, dst_blocks={list(dst_blocks)}, "
            f"dst_block_size={dbs}, start={start}, end={end})")
    given_src, given_dst = list(src_blocks), list(dst_blocks)
    got = api.transfer_plan(given_src, sbs, given_dst, dbs, start, end)
    expected = ref.transfer_plan(list(src_blocks), sbs, list(dst_blocks), dbs, start, end)
    if given_src != list(src_blocks) or given_dst != list(dst_blocks):
        raise Mismatch(call, "  expected the block tables unchanged", "  got them changed",
                       "hint: read the tables, do not write into them")
    if not isinstance(got, (list, tuple)) or not all(
            isinstance(r, (list, tuple)) and len(r) == 3 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                 for v in r) for r in got):
        raise Mismatch(call, f"  expected a list of (src_slot, dst_slot, length) tuples of ints, like {expected}",
                       f"  got {got!r}", "hint: return a list of 3-tuples of ints")
    got = [tuple(r) for r in got]
    moved = apply(got, list(src_blocks), sbs, list(dst_blocks), dbs, start, end) if all(r[2] > 0 for r in got) else None
    wrong = None if moved is None else next(((p, have, want) for p, have, want in moved if have != want), None)
    if wrong is not None:
        p, have, want = wrong
        raise Mismatch(call, f"  expected token {p}'s KV (source slot {want}) in its destination slot",
                       f"  got {'nothing' if have < 0 else f'source slot {have}'} there after your plan {got}",
                       "hint: " + hint)
    moved_slots = sum(r[2] for r in got)
    if got != expected and moved_slots != end - start:
        raise Mismatch(call, f"  expected {end - start} slots moved in all: {expected}",
                       f"  got {moved_slots}: {got}",
                       "hint: only tokens start .. end - 1 move, each once (a run's length counts its tokens)")
    if got != expected:
        raise Mismatch(call, f"  expected {expected}", f"  got      {got}",
                       "hint: " + ("the KV lands right, but the runs are not the longest ones: " if moved else "")
                       + hint)


def case(name, src_blocks, sbs, dst_blocks, dbs, start, end, hint=RULES):
    return Case(name, lambda api: check(api, src_blocks, sbs, dst_blocks, dbs, start, end, hint))


@st.composite
def _cases(draw):
    sbs, dbs = draw(st.sampled_from([1, 2, 3, 4, 8, 16])), draw(st.sampled_from([1, 2, 4, 5, 16]))
    end = draw(st.integers(0, 40))
    start = draw(st.integers(0, end))

    def table(bs):
        n = -(-end // bs) + draw(st.integers(0, 2))
        first = draw(st.integers(0, 20))
        if draw(st.booleans()):  # consecutive ids: runs may cross block boundaries
            return list(range(first, first + n))
        return draw(st.lists(st.integers(0, 60), min_size=n, max_size=n, unique=True))
    return table(sbs), sbs, table(dbs), dbs, start, end


def random_cases(examples: int) -> Case:
    return Case("random_plans", lambda api: check_property(_cases(), lambda c: check(api, *c), examples=examples))


CASES = [
    case("one_block_to_one_block", [5], 4, [2], 4, 0, 4,
         hint="4 tokens from block 5 (slots 20-23) to block 2 (slots 8-11): one run (20, 8, 4)"),
    case("consecutive_blocks_make_one_run", [3, 4], 4, [7, 8], 4, 0, 8,
         hint="blocks 3 and 4 are slots 12-19 without a gap, and 7 and 8 are 28-35: one run of 8"),
    case("a_gap_on_one_side_cuts_the_run", [3, 4], 4, [7, 9], 4, 0, 8,
         hint="the source is consecutive, the destination is not (block 9 does not follow block 7): two runs"),
    case("bigger_source_blocks", [2], 8, [1, 6], 4, 0, 8,
         hint="one source block of 8 (slots 16-23) into two destination blocks of 4 (4-7, then 24-27): two runs"),
    case("bigger_destination_blocks", [0, 9, 4], 2, [1], 8, 0, 6,
         hint="source blocks of 2 in slots 0-1, 18-19, 8-9; one destination block of 8: three runs"),
    case("from_the_middle_of_a_block", [1, 2], 4, [5, 6], 4, 2, 7,
         hint="tokens 2 .. 6: token 2 is slot 1 * 4 + 2 = 6 on the source, 5 * 4 + 2 = 22 on the destination"),
    case("the_whole_prompt_but_its_last_block", [4, 1, 7], 16, [9, 3, 2, 8, 5, 0], 8, 0, 40,
         hint="source blocks of 16, destination blocks of 8: a run ends wherever either side jumps"),
    case("nothing_to_move", [1], 4, [2], 4, 3, 3, hint="start == end: no tokens, the plan is []"),
    case("a_longer_table_than_needed", [0, 1, 2, 3], 4, [4, 5, 6, 7], 4, 0, 5,
         hint="only tokens 0 .. 4 move: one run of 5, not the whole tables"),
    case("slots_use_each_sides_own_block_size", [2], 16, [9, 2], 4, 4, 8,
         hint="token 4 is in source slot 2 * 16 + 4 = 36 (blocks of 16) and in destination slot "
              "table[4 // 4] * 4 + 0 = 2 * 4 = 8 (blocks of 4): one run (36, 8, 4)"),
    random_cases(300),
]

"""Cases of exercise 127: the learner's BlockPool against nano_engine's, operation by operation.

A script is a list of operations (`a = allocate(3)`, `touch(a[:1])`, `free(reversed(a))`, ...)
played on both pools; after each one the results, the errors, the reference counts, num_free, the
free queue's order and the prefix cache must agree, and the first difference is reported with a
hint. Then the engine runs on the tiny model with the learner's pool, under a tight pool that
forces preemption and with prompts that share a prefix: outputs must equal single-request
generation, and the engine must make the same decisions as with nano_engine's pool. Last, random
scripts drawn by hypothesis are played the same way, and the smallest one that differs is shown.
"""


import nano_engine.paged as ref
from practice.poolcheck import HASH_BLOCK, check_engine, play, play_random, pool_scripts
from practice.properties import check_property
from practice.worker import Case, Mismatch

REFERENCE_FILE = ref.__file__


def learner(module):
    cls = getattr(module, "BlockPool", None)
    if not (isinstance(cls, type) and issubclass(cls, ref.BlockPool)):
        raise Mismatch("your file must define class BlockPool, a subclass of nano_engine.paged.BlockPool")
    return cls


def reference():
    return ref.BlockPool


def scripted(name, num_blocks, ops):
    return Case(name, lambda cls: play(cls, num_blocks, ops))


def _reuse_forgets_the_name(cls):
    """After allocate reuses blocks that held a prefix, their block_hash must be None (not only cached)."""
    pool = cls(2)
    a = pool.allocate(2)
    pool.cache_blocks(a, ref.block_hashes([1, 2, 3, 4], HASH_BLOCK))
    pool.free(reversed(a))
    b = pool.allocate(2)
    got = ["None" if pool.block_hash[x] is None else "a prefix name" for x in b]
    if got != ["None", "None"]:
        raise Mismatch("a pool of 2 blocks, after:", "  a = allocate(2)", "  cache(a, [1, 2, 3, 4])",
                       "  free(reversed(a))", "step 4: b = allocate(2)",
                       f"  block_hash of blocks {b}  expected ['None', 'None']",
                       f"  {' ' * len(f'block_hash of blocks {b}')}  got      {got}",
                       "hint: a reused block must lose its name in block_hash too (self.block_hash[b] = None), not "
                       "only in self.cached: with a stale name cache_blocks never names it again, free puts it at "
                       "the END, and its next reuse deletes a name that is no longer cached (KeyError)")


# (prompt length, max_tokens, the step it arrives at); prompts of a shared-prefix case share the first 12 tokens
TIGHT = [(5, 10, 0), (17, 12, 0), (14, 10, 0), (9, 12, 0), (3, 11, 0), (12, 9, 0)]
SHARED = [(14, 10, 0), (16, 12, 2), (13, 10, 2), (20, 9, 3), (15, 10, 4), (18, 8, 5)]

CASES = [
    scripted("allocate_from_a_fresh_pool", 8, ["a = allocate(3)", "b = allocate(2)", "allocate(3)"]),
    scripted("allocate_more_than_free_raises_and_takes_nothing", 4,
             ["a = allocate(3)", "allocate(2)", "b = allocate(1)", "allocate(1)"]),
    scripted("freed_blocks_without_a_prefix_go_to_the_front", 6,
             ["a = allocate(3)", "b = allocate(2)", "free(reversed(a))", "c = allocate(2)", "free(b)",
              "d = allocate(3)"]),
    scripted("freed_blocks_with_a_prefix_join_the_end", 7,
             ["a = allocate(3)", "cache(a, [1, 2, 3, 4, 5, 6])", "b = allocate(2)", "cache(b, [7, 8, 9, 10])",
              "free(reversed(a))", "free(reversed(b))", "c = allocate(2)", "lookup(hashes([7, 8, 9, 10]))",
              "d = allocate(2)", "lookup(hashes([1, 2, 3, 4, 5, 6]))"]),
    scripted("a_request_with_a_partial_tail_block", 6,
             ["a = allocate(3)", "cache(a[:2], [1, 2, 3, 4])", "b = allocate(1)", "free(reversed(a))",
              "c = allocate(2)", "lookup(hashes([1, 2, 3, 4]))", "free(b)", "d = allocate(1)"]),
    scripted("a_shared_block_is_free_only_when_nobody_holds_it", 4,
             ["a = allocate(2)", "touch(a[:1])", "free(reversed(a))", "b = allocate(2)", "allocate(1)",
              "free(a[:1])", "c = allocate(1)"]),
    scripted("double_free_raises", 3, ["a = allocate(2)", "free(a)", "free(a[1:])"]),
    scripted("double_free_inside_one_call_raises_and_changes_nothing", 4,
             ["a = allocate(2)", "b = allocate(1)", "free(a + a[1:])", "free(b + a + b)", "c = allocate(1)",
              "allocate(1)", "free(reversed(a))", "free(a[:1] + b)", "d = allocate(2)"]),
    scripted("touch_takes_a_free_block_out_of_the_queue", 4,
             ["a = allocate(2)", "cache(a, [1, 2, 3, 4])", "free(reversed(a))", "hit = lookup(hashes([1, 2, 3, 4]))",
              "touch(hit)", "b = allocate(2)", "allocate(1)", "free(reversed(hit))", "c = allocate(1)"]),
    scripted("a_reused_block_forgets_its_prefix", 4,
             ["a = allocate(2)", "cache(a, [1, 2, 3, 4])", "free(reversed(a))", "lookup(hashes([1, 2, 3, 4]))",
              "b = allocate(3)", "lookup(hashes([1, 2, 3, 4]))", "c = allocate(1)", "lookup(hashes([1, 2]))"]),
    scripted("touch_takes_a_free_block_without_a_prefix_out_of_the_queue", 3,
             ["a = allocate(2)", "free(reversed(a))", "touch(a[:1])", "b = allocate(2)", "allocate(1)",
              "free(a[:1])", "c = allocate(1)"]),
    Case("a_reused_block_loses_its_block_hash", _reuse_forgets_the_name),
    Case("end_to_end_tight_pool_preempts",
         lambda cls: check_engine(cls, ref.BlockPool, dict(max_num_batched_tokens=16, num_blocks=12, block_size=4,
                                                            enable_prefix_caching=False), TIGHT, seed=2)),
    Case("end_to_end_shared_prefix",
         lambda cls: check_engine(cls, ref.BlockPool, dict(max_num_batched_tokens=16, num_blocks=12, block_size=4),
                                  SHARED, seed=3, shared_prefix=12)),
    # Random scripts drawn by hypothesis (allocations too large by one, frees in either order, prefixes
    # named twice, hits, shared heads, double frees), replayed on both pools; the smallest that differs is shown.
    Case("random_operation_scripts",
         lambda cls: check_property(pool_scripts(), lambda value: play_random(cls, value), examples=100)),
]

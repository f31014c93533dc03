"""Cases of exercise 133: the hash chain and the longest cached prefix, against nano_engine's.

`hash_chain` must equal `nano_engine.paged.block_hashes` (full blocks only, chained, the salt in
the first block only); `longest_cached_prefix` must find what the scheduler's admission finds
(`BlockPool.lookup` over the first `(len - 1) // block_size` hashes). Hand-made boundaries first
(exactly k blocks, k blocks + 1 token, a miss in the middle, salts, an empty cache, block size 1),
then seeded random inputs, then the scheduler without a model and the engine on a tiny model
with the learner's two functions in place: every lookup is checked as it happens, and every
step's chunk starts, block tables and hits must equal the reference run's. Last, hypothesis draws
random inputs for both functions, and the smallest one that differs is shown.
"""

import random
from types import SimpleNamespace

import nano_engine.paged as ref
from practice.hashcheck import (Req, chain_inputs, check_chain, check_engine, check_play, check_prefix,
                                check_random_lookup, lookup_inputs, make_cache, random_workload, reference_lookup)
from practice.properties import check_property
from practice.worker import Case, require_functions

REFERENCE_FILE = ref.__file__
NAMES = ("hash_chain", "longest_cached_prefix")


def learner(module):
    return require_functions(module, NAMES)


def reference():
    return SimpleNamespace(hash_chain=lambda t, bs, cache_salt=None: ref.block_hashes(t, bs, cache_salt=cache_salt),
                           longest_cached_prefix=reference_lookup)


def _t(n, start=1):
    return [start + (7 * i) % 50 for i in range(n)]


def chains(name, inputs):
    """inputs: (token_ids, block_size, cache_salt)."""
    def run(api):
        for tokens, bs, salt in inputs:
            check_chain(api, tokens, bs, salt)
    return Case(name, run)


def _random_chains(seed, count):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        bs = rng.choice([1, 2, 3, 4, 8, 16])
        n = rng.randint(0, 5 * bs + bs - 1)
        out.append(([rng.randrange(0, 100) for _ in range(n)], bs, rng.choice([None, None, "a", "tenant-7"])))
    return out


def lookups(name, cached_prompts, queries, block_size, drop=(), seed=0):
    """Cache the full blocks of cached_prompts [(tokens, salt)], less `drop`; then look up each query."""
    def run(api):
        cached, names = make_cache(cached_prompts, block_size, random.Random(seed), drop)
        for tokens, salt in queries:
            check_prefix(api, tokens, block_size, cached, salt, names)
    return Case(name, run)


def _random_lookups(seed, count):
    """Prompts sharing prefixes of every length, some blocks evicted, salts: then queries on them."""
    def run(api):
        rng = random.Random(seed)
        for _ in range(count):
            bs = rng.choice([1, 2, 4, 5])
            base = [rng.randrange(1, 30) for _ in range(6 * bs)]
            prompts = [(base[:rng.randint(1, 6 * bs)] + [rng.randrange(30, 60) for _ in range(rng.randint(0, 2 * bs))],
                        rng.choice([None, None, "a"])) for _ in range(4)]
            drop = {(rng.randrange(4), rng.randrange(6)) for _ in range(rng.randint(0, 3))}
            cached, names = make_cache(prompts, bs, rng, drop)
            for _ in range(6):
                tokens, salt = rng.choice(prompts)
                cut = rng.randint(1, len(tokens) + bs)
                query = (tokens + [rng.randrange(30, 60) for _ in range(bs)])[:cut]
                check_prefix(api, query, bs, cached, rng.choice([salt, salt, salt, None, "b"]), names)
    return Case(f"random_lookups_seed_{seed}", run)


A = _t(12)  # three blocks of 4
SALTED = [(A, "alice")]
CASES = [
    chains("hash_chain_of_full_blocks_only",
           [(_t(8), 4, None), (_t(10), 4, None), (_t(3), 4, None), (_t(15), 4, None), ([], 4, None)]),
    chains("hash_chain_is_chained_equal_blocks_after_different_prefixes_differ",
           [([5, 6, 5, 6, 5, 6], 2, None), ([1, 2, 3, 9, 9, 9, 9, 9, 9], 3, None)]),
    chains("hash_chain_salt_is_a_key_of_the_first_block_only",
           [(_t(12), 4, "alice"), (_t(9), 3, "bob"), (_t(4), 4, "alice"), (_t(3), 4, "alice")]),
    chains("hash_chain_block_size_1", [(_t(5), 1, None), (_t(4), 1, "x")]),
    chains("hash_chain_random_inputs", _random_chains(133, 60)),
    lookups("empty_cache_hits_nothing", [], [(A, None), (A + [1], None)], 4),
    lookups("prompt_of_exactly_k_blocks_leaves_its_last_block", [(A, None)], [(A, None), (A[:8], None)], 4),
    lookups("prompt_of_k_blocks_and_one_token_hits_all_k", [(A, None)], [(A + [99], None), (A[:8] + [99], None)], 4),
    lookups("prompt_of_k_blocks_and_more_tokens", [(A, None)], [(A + [98, 99], None), (A + [97, 98, 99], None)], 4),
    lookups("a_miss_in_the_middle_stops_the_run", [(A + [1, 2, 3, 4, 5], None)],
            [(A + [1, 2, 3, 4, 5], None), (A + [1, 2, 3, 4], None)], 4, drop={(0, 1)}),
    lookups("a_miss_at_the_first_block_hits_nothing", [(A + [1, 2, 3, 4, 5], None)],
            [(A + [1, 2, 3, 4, 5], None)], 4, drop={(0, 0)}),
    lookups("a_different_first_block_misses_everything", [(A + [1], None)], [([99] + A[1:] + [1], None)], 4),
    lookups("shorter_than_a_block_or_one_token_hits_nothing", [(A, None)], [(A[:3], None), (A[:1], None)], 4),
    lookups("the_same_salt_hits", SALTED, [(A + [1], "alice"), (A, "alice")], 4),
    lookups("a_different_salt_misses", SALTED, [(A + [1], "bob"), (A + [1], "alice ")], 4),
    lookups("no_salt_misses_a_salted_prefix", SALTED, [(A + [1], None)], 4),
    lookups("a_salt_misses_an_unsalted_prefix", [(A, None)], [(A + [1], "alice")], 4),
    lookups("block_size_1_leaves_the_last_token", [(A[:6], None)], [(A[:6], None), (A[:7], None), (A[:1], None)], 1),
    lookups("two_prompts_sharing_a_prefix", [(A + [1, 2, 3, 4], None), (A[:8] + [7, 7, 7, 7, 7], None)],
            [(A[:8] + [7, 7, 7, 7, 7], None), (A[:8] + [7, 7, 7, 7], None), (A + [1, 2, 3], None)], 4),
    *[_random_lookups(seed, 40) for seed in (1, 2)],
    Case("scheduler_shared_system_prompt_and_salts",
         lambda api: check_play(api, [
             Req("r0", A + [40, 41, 42], 3, outputs=[5, 6, 7], note="S (12) + 3"),
             Req("r1", A + [43, 44], 3, step=1, outputs=[8, 9, 10], note="S (12) + 2"),
             Req("r2", A + [45], 2, step=2, salt="alice", outputs=[11, 12], note="S (12) + 1"),
             Req("r3", A + [45], 2, step=6, salt="alice", outputs=[13, 14], note="r2's prompt again"),
             Req("r4", A + [45], 2, step=6, salt="bob", outputs=[15, 16], note="r2's prompt again"),
             Req("r5", list(A), 2, step=9, outputs=[17, 18], note="S alone: a full hit but for its last block"),
             Req("r6", A + [40, 41, 42, 5, 6, 7, 30], 2, step=10, outputs=[19, 20],
                 note="r0's prompt + its outputs + 1: its second turn"),
             Req("r7", A[4:] + [40, 41], 2, step=11, outputs=[21, 22], note="S less its first block + 2")], 4, 40, 16)),
    Case("scheduler_tight_pool_preempts_and_rehits",
         lambda api: check_play(api, [
             Req("r0", A[:9], 7, outputs=list(range(20, 27)), note="S (9)"),
             Req("r1", A[:9] + [50, 51], 7, outputs=list(range(30, 37)), note="S (9) + 2"),
             Req("r2", A[:9] + [52], 6, step=1, outputs=list(range(40, 46)), note="S (9) + 1")], 2, 14, 8)),
    *[Case(f"scheduler_random_requests_seed_{seed}_block_size_{bs}",
           lambda api, seed=seed, bs=bs, nb=nb: check_play(api, random_workload(seed, bs), bs, nb, 4 * bs,
                                                           label=f"random requests (seed {seed})"))
      for seed, bs, nb in ((1, 4, 40), (2, 2, 30), (3, 1, 60), (4, 4, 14))],
    Case("engine_on_a_tiny_model", lambda api: check_engine(api, seed=5)),
    # Random inputs drawn by hypothesis; the smallest that differs is shown.
    Case("random_hash_chains",
         lambda api: check_property(chain_inputs(), lambda v: check_chain(api, *v), examples=100)),
    Case("random_cached_prefixes",
         lambda api: check_property(lookup_inputs(), lambda v: check_random_lookup(api, v), examples=100)),
]

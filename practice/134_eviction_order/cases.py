"""Cases of exercise 134: admit and release of whole requests on nano_engine's BlockPool.

Scripts of requests (admit, decode, finish, preempt) are played with the learner's functions and
with the scheduler's own rules side by side; after every event the block table returned, the
reference counts, the free queue's order and the cached prefixes must agree (practice/evictcheck.py).
Hand-made scripts show one consequence each (a request's tail is evicted first, a shared block
stays held, the least recently used system prompt goes first, a hit renews a prefix, a preempted
request hits its own head, a failed admission changes nothing, the room counts free hit blocks,
the hit is touched before allocating, a duplicate block and the partial tail released together go to
the front tail first); seeded random scripts mix them on small pools; the engine then runs on a tiny
model with the learner's release. Last, hypothesis draws random scripts, and the smallest one that
differs is shown.
"""

from types import SimpleNamespace

from practice import evictcheck as ec
from practice.evictcheck import check_engine, play_random, play_script, random_script, request_scripts, script
from practice.properties import check_property
from practice.worker import Case, require_functions

REFERENCE_FILE = ec.__file__
NAMES = ("admit", "release")


def learner(module):
    return require_functions(module, NAMES)


def reference():
    return SimpleNamespace(admit=ec.admit, release=ec.release)


def scripted(name, num_blocks, block_size, steps):
    events = script(*steps)
    return Case(name, lambda api: play_script(api, reference(), num_blocks, block_size, events))


def randomized(seed, num_blocks, block_size, length):
    events = random_script(seed, num_blocks, block_size, length)
    title = f"random script (seed {seed}, {length} events)"
    return Case(f"random_script_seed_{seed}_{num_blocks}_blocks_of_{block_size}",
                lambda api: play_script(api, reference(), num_blocks, block_size, events, title))


def own(n, start):
    return list(range(start, start + n))


SA, SB = own(8, 100), own(8, 200)  # two system prompts, two blocks of 4 tokens each

CASES = [
    scripted("a_finished_request_frees_its_tail_first", 8, 4, [
        ("admit", "r1", SA + own(5, 300)), ("finish", "r1"),
        ("admit", "r2", own(21, 400)), ("finish", "r2"),
        ("admit", "r3", SA + own(5, 300))]),
    scripted("a_shared_block_freed_by_one_holder_stays_held", 8, 4, [
        ("admit", "r1", SA + own(3, 300)), ("admit", "r2", SA + own(2, 310)), ("finish", "r1"),
        ("admit", "r3", SA + own(1, 320)), ("finish", "r2"), ("finish", "r3")]),
    scripted("the_least_recently_used_system_prompt_is_evicted_first", 8, 4, [
        ("admit", "r1", SA + own(1, 300)), ("admit", "r2", SB + own(1, 310)),
        ("finish", "r2"), ("finish", "r1"),
        ("admit", "r3", own(20, 400)),
        ("admit", "r4", SA + own(1, 320)), ("admit", "r5", SB + own(1, 330)),
        ("finish", "r3"), ("admit", "r5", SB + own(1, 330))]),
    scripted("a_hit_renews_a_cached_prefix", 9, 4, [
        ("admit", "r1", SA + own(1, 300)), ("admit", "r2", SB + own(1, 310)),
        ("finish", "r1"), ("finish", "r2"),
        ("admit", "r3", SA + own(1, 320)), ("finish", "r3"),
        ("admit", "r4", own(24, 400)),
        ("admit", "r5", SA + own(2, 330)), ("admit", "r6", SB + own(2, 340))]),
    scripted("a_preempted_request_loses_its_tail_first_and_hits_its_head", 8, 4, [
        ("admit", "r1", SA + own(2, 300)), ("admit", "r2", own(15, 400)),
        ("grow", "r2", own(2, 500)), ("preempt", "r2"), ("grow", "r1", own(3, 510)),
        ("grow", "r1", own(4, 520)), ("finish", "r1"),
        ("admit", "r2", own(15, 400) + own(2, 500))]),
    scripted("a_failed_admit_changes_nothing", 6, 4, [
        ("admit", "r1", SA + own(1, 300)), ("admit", "r2", own(9, 400)),
        ("finish", "r1"), ("finish", "r2"),
        ("admit", "r3", SA + own(17, 500)), ("admit", "r4", own(2, 600))]),
    scripted("free_hit_blocks_count_against_the_room", 6, 4, [
        ("admit", "r1", SA + own(1, 300)), ("admit", "r2", own(9, 400)),
        ("finish", "r1"), ("finish", "r2"),
        ("admit", "r3", SA + own(13, 500)), ("finish", "r3"),
        ("admit", "r4", SA + own(1, 300)), ("admit", "r5", own(11, 600)), ("admit", "r6", own(9, 700)),
        ("admit", "r7", own(8, 800))]),
    scripted("touch_the_hit_before_allocating", 4, 4, [
        ("admit", "r1", SA), ("admit", "r2", own(8, 400)), ("finish", "r1"), ("finish", "r2"),
        ("admit", "r3", SA + [7])]),
    scripted("a_duplicate_block_and_the_partial_tail_go_to_the_front_tail_first", 8, 4, [
        ("admit", "r1", SA), ("admit", "r2", SA), ("grow", "r2", own(10, 300)), ("finish", "r2"),
        ("finish", "r1"), ("admit", "r3", own(9, 400)), ("admit", "r4", SA + own(1, 310)),
        ("finish", "r3"), ("admit", "r5", SA + own(10, 300))]),
    scripted("block_size_1", 5, 1, [
        ("admit", "r1", [1, 2, 3]), ("admit", "r2", [1, 2, 4]), ("finish", "r1"), ("finish", "r2"),
        ("admit", "r3", [1, 2, 3, 5]), ("admit", "r4", [9])]),
    randomized(1, 6, 2, 60),
    randomized(2, 10, 4, 80),
    randomized(3, 16, 4, 120),
    randomized(4, 5, 1, 60),
    randomized(5, 8, 3, 100),
    Case("end_to_end_engine_with_your_release", lambda api: check_engine(api, seed=4)),
    # Random whole requests drawn by hypothesis (equal prompts, blocks computed twice, partial tails,
    # decodes, preemptions, several finishing in a row); the smallest script that differs is shown.
    Case("random_requests",
         lambda api: check_property(request_scripts(), lambda value: play_random(api, value), examples=100)),
]

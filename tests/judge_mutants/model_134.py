"""A learner-style solution of exercise 134, written from the statement alone: it passes every case.

The mutants next to it (134_*.py) change one thing each.
"""


def admit(pool, hashes, num_blocks):
    hit = pool.lookup(hashes)
    new = num_blocks - len(hit)
    free_hits = len([b for b in hit if pool.ref_count[b] == 0])
    if new + free_hits > pool.num_free:
        return None
    pool.touch(hit)
    table = list(hit)
    table.extend(pool.allocate(new))
    return table


def release(pool, block_ids):
    pool.free(block_ids[::-1])

"""Mutant of exercise 140: runs stop at every source block boundary."""

EXPECTED_HINT = "the runs are not the longest ones"


def transfer_plan(src_blocks, src_block_size, dst_blocks, dst_block_size, start, end):
    plan = []
    for p in range(start, end):
        s = src_blocks[p // src_block_size] * src_block_size + p % src_block_size
        d = dst_blocks[p // dst_block_size] * dst_block_size + p % dst_block_size
        if plan and p % src_block_size and plan[-1][0] + plan[-1][2] == s and plan[-1][1] + plan[-1][2] == d:  # MUTANT
            plan[-1] = (plan[-1][0], plan[-1][1], plan[-1][2] + 1)
        else:
            plan.append((s, d, 1))
    return plan

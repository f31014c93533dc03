"""Mutant of exercise 140: the destination's slots use the source's block size."""

EXPECTED_HINT = "destination slot"


def transfer_plan(src_blocks, src_block_size, dst_blocks, dst_block_size, start, end):
    plan = []
    for p in range(start, end):
        s = src_blocks[p // src_block_size] * src_block_size + p % src_block_size
        d = dst_blocks[p // src_block_size] * src_block_size + p % src_block_size  # MUTANT
        if plan and plan[-1][0] + plan[-1][2] == s and plan[-1][1] + plan[-1][2] == d:
            plan[-1] = (plan[-1][0], plan[-1][1], plan[-1][2] + 1)
        else:
            plan.append((s, d, 1))
    return plan

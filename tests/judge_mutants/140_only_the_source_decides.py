"""Mutant of exercise 140: a run goes on while the source alone stays consecutive."""

EXPECTED_HINT = "destination slot"


def transfer_plan(src_blocks, src_block_size, dst_blocks, dst_block_size, start, end):
    plan = []
    for p in range(start, end):
        s = src_blocks[p // src_block_size] * src_block_size + p % src_block_size
        d = dst_blocks[p // dst_block_size] * dst_block_size + p % dst_block_size
        if plan and plan[-1][0] + plan[-1][2] == s:  # MUTANT: the destination is not checked
            plan[-1] = (plan[-1][0], plan[-1][1], plan[-1][2] + 1)
        else:
            plan.append((s, d, 1))
    return plan

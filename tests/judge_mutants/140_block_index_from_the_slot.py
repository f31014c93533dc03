"""Mutant of exercise 140: a token's block is found by its position in the whole cache."""

EXPECTED_HINT = "destination slot"


def transfer_plan(src_blocks, src_block_size, dst_blocks, dst_block_size, start, end):
    plan = []
    for p in range(start, end):
        s = src_blocks[0] * src_block_size + p  # MUTANT: assumes consecutive source blocks
        d = dst_blocks[p // dst_block_size] * dst_block_size + p % dst_block_size
        if plan and plan[-1][0] + plan[-1][2] == s and plan[-1][1] + plan[-1][2] == d:
            plan[-1] = (plan[-1][0], plan[-1][1], plan[-1][2] + 1)
        else:
            plan.append((s, d, 1))
    return plan

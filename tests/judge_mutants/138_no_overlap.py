"""Mutant of exercise 138: an occurrence may not overlap the tail."""

EXPECTED_HINT = "it counts"


def propose_ngram(tokens, k, min_n, max_n):
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = list(tokens[total - n:])
        for i in range(0, total - 2 * n + 1):  # MUTANT: must end before the tail starts
            if list(tokens[i:i + n]) == tail:
                return list(tokens[i + n:i + n + k])
    return []

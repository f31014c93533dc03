"""Mutant of exercise 138: the shortest n is tried first."""

EXPECTED_HINT = "n = 2 is tried first"


def propose_ngram(tokens, k, min_n, max_n):
    total = len(tokens)
    for n in range(min_n, min(max_n, total - 1) + 1):  # MUTANT: shortest first
        tail = list(tokens[total - n:])
        for i in range(0, total - n):
            if list(tokens[i:i + n]) == tail:
                return list(tokens[i + n:i + n + k])
    return []

"""Mutant of exercise 138: a match shorter than min_n is taken."""

EXPECTED_HINT = "min_n = 2 a match of length 1"


def propose_ngram(tokens, k, min_n, max_n):
    total = len(tokens)
    for n in range(min(max_n, total - 1), 0, -1):  # MUTANT: down to 1
        tail = list(tokens[total - n:])
        for i in range(0, total - n):
            if list(tokens[i:i + n]) == tail:
                return list(tokens[i + n:i + n + k])
    return []

"""Mutant of exercise 138: the latest earlier occurrence is taken instead of the first."""

EXPECTED_HINT = "take the FIRST"


def propose_ngram(tokens, k, min_n, max_n):
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = list(tokens[total - n:])
        for i in range(total - n - 1, -1, -1):  # MUTANT: from the end
            if list(tokens[i:i + n]) == tail:
                return list(tokens[i + n:i + n + k])
    return []

"""Mutant of exercise 138: every token after the occurrence is proposed."""

EXPECTED_HINT = "the drafts are [9, 1]"


def propose_ngram(tokens, k, min_n, max_n):
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = list(tokens[total - n:])
        for i in range(0, total - n):
            if list(tokens[i:i + n]) == tail:
                return list(tokens[i + n:])  # MUTANT: no cap at k
    return []

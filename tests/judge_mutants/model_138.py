"""A learner-style solution of exercise 138, written from the statement alone: it passes every case.

Two loops, n from the longest down and i from the start, nothing taken from nano_engine.spec_decode.
The mutants next to it (138_*.py) change one thing each.
"""


def propose_ngram(tokens, k, min_n, max_n):
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = list(tokens[total - n:])
        for i in range(0, total - n):
            if list(tokens[i:i + n]) == tail:
                return list(tokens[i + n:i + n + k])
    return []

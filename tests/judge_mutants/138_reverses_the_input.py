"""Mutant of exercise 138: the list given is flipped in place (vLLM flips the tokens to search them, on a copy)."""

EXPECTED_HINT = "stay unchanged"


def propose_ngram(tokens, k, min_n, max_n):
    tokens.reverse()  # MUTANT: flips the caller's list
    original = tokens[::-1]
    total = len(original)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        tail = original[total - n:]
        for i in range(0, total - n):
            if original[i:i + n] == tail:
                return original[i + n:i + n + k]
    return []

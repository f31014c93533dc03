"""Exercise 138: the n-gram proposer of speculative decoding. Edit this file, then run

    python practice/judge.py 138

The statement is in README.md. `tokens` is the request's token ids so far (prompt and output, a
list of ints); `k` the most drafts to propose; `min_n` <= `max_n` the shortest and longest n-grams
to look up. Return a list of at most k token ids (empty when nothing matches). Leave `tokens`
unchanged.
"""

from typing import Sequence


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The drafts: up to k tokens that followed an earlier occurrence of the n-gram that ends `tokens`."""
    raise NotImplementedError

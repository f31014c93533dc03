"""Cases of exercise 138: the learner's propose_ngram against nano_engine.spec_decode.propose_ngram.

Each case calls both with the same tokens, k, min_n and max_n and compares the drafts; the list
given must come back unchanged. Hand-made cases first, one rule each, then random ones
(practice.properties), the smallest that differs shown.
"""

from types import SimpleNamespace

import nano_engine.spec_decode as ref
from practice.properties import check_property, st
from practice.worker import Case, Mismatch, require_functions

REFERENCE_FILE = ref.__file__


def learner(module):
    return require_functions(module, ("propose_ngram",))


def reference():
    return SimpleNamespace(propose_ngram=ref.propose_ngram)


def check(api, tokens, k, min_n, max_n, hint=""):
    given = list(tokens)
    call = f"propose_ngram(tokens={list(tokens)}, k={k}, min_n={min_n}, max_n={max_n})"
    got = api.propose_ngram(given, k, min_n, max_n)
    expected = ref.propose_ngram(list(tokens), k, min_n, max_n)
    if given != list(tokens):
        raise Mismatch(call, "  expected tokens to stay unchanged", f"  got them changed to {given}",
                       "hint: do not write into the list you are given (no append, pop or sort on it)")
    if not isinstance(got, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in got):
        raise Mismatch(call, f"  expected a list of token ids (ints), like {expected}", f"  got {got!r}",
                       "hint: return a list of ints: the tokens after the match, or [] when nothing matched")
    if list(got) != expected:
        raise Mismatch(call, f"  expected {expected}", f"  got      {list(got)}", "hint: " + (
            hint or "try n from min(max_n, len(tokens) - 1) down to min_n; for the first n whose last n tokens "
                    "occurred earlier (ending before the end), return up to k tokens after the FIRST occurrence"))


def case(name, tokens, k, min_n, max_n, hint=""):
    return Case(name, lambda api: check(api, tokens, k, min_n, max_n, hint))


@st.composite
def _cases(draw):
    vocab = draw(st.integers(1, 4))  # small: n-grams repeat
    tokens = draw(st.lists(st.integers(0, vocab), min_size=1, max_size=14))
    max_n = draw(st.integers(1, 5))
    return tokens, draw(st.integers(1, 6)), draw(st.integers(1, max_n)), max_n


def random_cases(examples: int) -> Case:
    return Case("random_cases", lambda api: check_property(_cases(), lambda c: check(api, *c), examples=examples))


CASES = [
    case("the_example_of_the_statement", [1, 2, 3, 9, 1, 2, 3], 2, 1, 3,
         hint="the tail [1, 2, 3] occurred at i = 0, followed by 9 and 1: the drafts are [9, 1]"),
    case("the_longest_n_first_even_when_a_shorter_one_matches_earlier", [4, 2, 6, 1, 2, 5, 1, 2], 2, 1, 2,
         hint="the tail [1, 2] occurred at i = 3 (followed by 5, 1); [2] alone occurred earlier, at i = 1 "
              "(followed by 6, 1), but n = 2 is tried first and matches"),
    case("the_first_occurrence_not_the_latest", [3, 4, 1, 3, 4, 2, 3, 4], 1, 2, 2,
         hint="the tail [3, 4] occurred at i = 0 (then 1) and at i = 3 (then 2): take the FIRST, i = 0"),
    case("an_occurrence_may_overlap_the_tail", [7, 7, 7], 2, 2, 2,
         hint="the tail is [7, 7] at i = 1; [7, 7] at i = 0 ends at 1, before the tail ends: it counts, and "
              "the token after it is tokens[2] = 7"),
    case("the_tail_itself_never_counts", [1, 2, 3, 4], 3, 1, 3,
         hint="no n-gram that ends tokens occurred before (the tail at its own place is not an earlier "
              "occurrence): return []"),
    case("fewer_than_k_after_the_occurrence", [1, 2, 1], 4, 1, 1,
         hint="the tail [1] occurred at i = 0; after it come tokens[1:3] = [2, 1] only: propose those two"),
    case("min_n_is_respected", [8, 1, 2, 3, 5, 3], 2, 2, 3,
         hint="with min_n = 2 a match of length 1 ([3] at i = 3) is not enough: no n in 3..2 matches, return []"),
    case("n_is_capped_by_the_length", [6, 6], 2, 1, 5,
         hint="with 2 tokens, only n = 1 can have occurred earlier (n <= len(tokens) - 1): [6] at i = 0, then 6"),
    case("a_single_token_has_nothing_before_it", [3], 2, 1, 1,
         hint="one token: no n >= 1 leaves a token before the tail, return []"),
    case("k_of_one", [2, 9, 9, 2, 9], 1, 1, 3,
         hint="the tail [2, 9] occurred at i = 0; with k = 1 propose only tokens[2] = 9"),
    random_cases(300),
]

"""Cases of exercise 135: the learner's filter_logits and distribution against nano_engine.sampling.

Hand-made boundaries first, one rule per case (top-k and its ties, top-p and the token that crosses,
min-p relative to the top probability, their order, temperature and greedy), each with the hint of
its rule; then two property cases (practice.properties): logits and parameters drawn by hypothesis,
and the smallest input that differs shown, with the rules its parameters switch on as the hint. The
set of kept tokens must be exactly the reference's, the kept logits unchanged and the probabilities
equal to 1e-6; the input must come back untouched. The tokens a distribution can draw must be exactly
the reference's too, however small their probability. Random inputs that float rounding alone could
decide are skipped (_fragile): a cumulative probability or min-p ratio within 1e-5 of its threshold, a
probability that logits / T in float32 moves by more than 1e-7, one near the drawable limit.
"""

import math
import operator
from functools import partial
from types import SimpleNamespace

import torch
from hypothesis import assume

import nano_engine.sampling as ref
from nano_engine.request import SAMPLING_EPS
from practice.properties import check_property, st
from practice.worker import Case, Mismatch, require_functions

REFERENCE_FILE = ref.__file__
NAMES = ("filter_logits", "distribution")
ATOL = 1e-6
# A probability at or above this is drawable, below it only float underflow (the reference's float32 softmax
# rounds e^-104 to 0, a float64 one does not): tiny probabilities count, so no tolerance hides a token.
DRAWABLE = 1e-37


def learner(module):
    return require_functions(module, NAMES)


def reference():
    return SimpleNamespace(filter_logits=ref.filter_logits, distribution=ref.distribution)


def _fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join("-inf" if math.isinf(x) and x < 0 else f"{x:.4g}" for x in t.tolist()) + "]"


def _kept(t: torch.Tensor) -> list[int]:
    return [i for i, x in enumerate(t.tolist()) if not (math.isinf(x) and x < 0)]


def _logits(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def _call(api, fn: str, logits: torch.Tensor, *args):
    """Run api.fn on a copy of logits; refuse a changed input or something that is not a (V,) tensor."""
    given = logits.clone()
    got = getattr(api, fn)(given, *args)
    call = f"{fn}({_fmt(logits)}, {', '.join(map(repr, args))})"
    if not torch.equal(given, logits):
        raise Mismatch(call, f"  expected the input to stay {_fmt(logits)}", f"  got it changed to {_fmt(given)}",
                       "hint: do not change the logits you are given: return a new tensor "
                       "(masked_fill, not masked_fill_; clone before writing into it)")
    if not isinstance(got, torch.Tensor) or got.shape != logits.shape:
        what = f"shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        raise Mismatch(call, f"  expected a tensor of shape {tuple(logits.shape)}", f"  got {what}",
                       "hint: return one value per token, a tensor shaped like the logits")
    return call, got.detach().double()


def check_filter(api, logits, top_k, top_p, min_p, hint):
    call, got = _call(api, "filter_logits", logits, top_k, top_p, min_p)
    want = ref.filter_logits(logits.clone(), top_k, top_p, min_p).double()
    keep = _kept(want)
    if _kept(got) != keep:
        raise Mismatch(call, f"  the probabilities, softmax(logits): {_fmt(logits.double().softmax(-1))}",
                       f"  expected {_fmt(want)}   (tokens kept: {keep})",
                       f"  got      {_fmt(got)}   (tokens kept: {_kept(got)})", "hint: " + hint)
    if not torch.allclose(got[keep], want[keep], rtol=0, atol=ATOL):
        raise Mismatch(call, f"  expected {_fmt(want)}", f"  got      {_fmt(got)}",
                       "hint: the tokens that stay keep their logits unchanged; only the others become -inf")


def check_distribution(api, logits, temperature, top_k, top_p, min_p, hint):
    call, got = _call(api, "distribution", logits, temperature, top_k, top_p, min_p)
    want = ref.distribution(logits.clone(), temperature, top_k, top_p, min_p).double()
    support = [i for i, p in enumerate(want.tolist()) if p >= DRAWABLE]
    got_support = [i for i, p in enumerate(got.nan_to_num(-1).tolist()) if p >= DRAWABLE]
    # The tokens that can be drawn first, exactly: a token of probability 1e-9 kept or dropped is within any
    # tolerance of the probabilities, but it is another distribution.
    if got_support != support or torch.isnan(got).any() or not torch.allclose(got, want, rtol=0, atol=ATOL):
        raise Mismatch(call, f"  expected {_fmt(want)}   (tokens that can be drawn: {support})",
                       f"  got      {_fmt(got)}   (tokens that can be drawn: {got_support})", "hint: " + hint)


def filters(name, calls, hint):
    """calls: (probs or logits, top_k, top_p, min_p); a list of floats in (0, 1] summing to 1 are probs."""
    def run(api):
        for values, top_k, top_p, min_p in calls:
            logits = _logits(values) if _is_probs(values) else torch.tensor(values)
            check_filter(api, logits, top_k, top_p, min_p, hint)
    return Case(name, run)


def distributions(name, calls, hint):
    """calls: (probs or logits, temperature, top_k, top_p, min_p)."""
    def run(api):
        for values, temperature, top_k, top_p, min_p in calls:
            logits = _logits(values) if _is_probs(values) else torch.tensor(values)
            check_distribution(api, logits, temperature, top_k, top_p, min_p, hint)
    return Case(name, run)


def _is_probs(values) -> bool:
    return all(0 < v <= 1 for v in values) and abs(sum(values) - 1) < 1e-9


MARGIN = 1e-5  # how close to a threshold float rounding could decide (float32 sums of up to 104 terms: < 7e-6)


def _fragile(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> bool:
    """Whether float rounding alone could decide this input, computed in float64 apart from any solution:
    logits / T rounded to float32 moving a probability by more than 1e-7, two different logits within
    rounding of each other, a min-p ratio or a cumulative probability within MARGIN of its threshold, a
    final probability near DRAWABLE."""
    if temperature < SAMPLING_EPS:
        return False
    x = logits.double() / temperature
    error = (logits.float() / temperature).double() - x  # what dividing in float32 moves each logit by
    ratio = (x - x.max()).exp()  # each probability / the largest one (before any filter)
    relevant = error[ratio > 1e-9]
    if relevant.max() - relevant.min() > 1e-7:
        return True
    distinct = x.unique()
    if (distinct.diff() < 1e-6 * distinct[1:].abs().clamp(min=1.0)).any():
        return True
    keep = torch.ones_like(x, dtype=torch.bool)
    if min_p > 0:
        if ((ratio - min_p).abs() < MARGIN)[x != x.max()].any():
            return True
        keep &= ratio >= min_p
    if 0 < top_k < len(x):
        values = x[keep].sort(descending=True).values
        keep &= x >= (values[top_k - 1] if top_k <= len(values) else -math.inf)
    probs = torch.where(keep, ratio, 0.0)
    probs = probs / probs.sum()
    if top_p < 1:
        ordered, order = probs.sort(descending=True, stable=True)
        before = ordered.cumsum(0) - ordered
        if ((before - top_p).abs() < MARGIN)[1:].any():
            return True
        drop = before >= top_p
        drop[0] = False
        probs = torch.where(torch.zeros_like(drop).scatter(0, order, drop), 0.0, probs)
        probs = probs / probs.sum()
    return bool(((probs > DRAWABLE / 100) & (probs < DRAWABLE * 100)).any())


def _nth(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 < 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def _rules(v: int, temperature: float | None, top_k: int, top_p: float, min_p: float) -> str:
    """The rules that decide this call, in their order: the hint of a random input."""
    if temperature is not None and temperature < SAMPLING_EPS:
        return (f"temperature {temperature:g} is below 1e-5: greedy, all the probability on the largest logit (the "
                f"first one if several tie), whatever top_k, top_p and min_p say")
    steps = [f"divide the logits by the temperature {temperature:g}"] if temperature is not None else []
    if min_p > 0:
        steps.append(f"min-p {min_p:g}: drop the tokens whose probability is strictly below {min_p:g} x the largest "
                     f"probability")
    if 0 < top_k < v:
        steps.append(f"top-k {top_k}: keep every logit >= the {_nth(top_k)} largest, counting equal logits one by "
                     f"one (ties at the {_nth(top_k)} all stay)")
    if top_p < 1:
        steps.append(f"top-p {top_p:g}: over the probabilities left, renormalized, most likely first (equal ones: the "
                     f"smaller id first), drop a token once the ones before it reach {top_p:g}")
    off = [name for name, on in ((f"top_k {top_k}" + (" (at least the vocabulary size)" if top_k else ""),
                                  not 0 < top_k < v), ("top_p 1", top_p >= 1), ("min_p 0", min_p <= 0)) if on]
    if temperature is not None:
        steps.append("softmax")
    if not steps:
        return (f"every filter is off ({', '.join(off)}): every token keeps its logit, however small its "
                f"probability")
    return "in this order: " + "; then ".join(steps) + (
        f" ({', '.join(off)}: off, {'they drop' if len(off) > 1 else 'it drops'} no token, however small its "
        f"probability)" if off else "")


TIES = (0.0, 1.0, -1.0, 2.0, 0.5, -3.0)
TEMPERATURES = (1.0, 0.0, 1e-6, 1e-5, 0.5, 2.0, 0.1, 10.0, 1000.0)


@st.composite
def _calls(draw, with_temperature: bool):
    """(logits, temperature or None, top_k, top_p, min_p). 1 to 8 runs of equal logits, each of 1 to 13 tokens
    (up to 104 in all), from a few values (ties) or a grid of 41 spread over 2 to 100 (probabilities down to
    1e-44); each parameter at its corners and between."""
    if draw(st.booleans()):
        value = st.integers(-20, 20).map(partial(operator.mul, draw(st.sampled_from((0.05, 0.25, 1.25, 2.5)))))
    else:
        value = st.sampled_from(TIES)
    runs = draw(st.lists(st.tuples(value, st.sampled_from((1, 1, 1, 2, 5, 13))), min_size=1, max_size=8))
    values = [x for x, n in runs for _ in range(n)]
    v = len(values)
    t = draw(st.sampled_from(TEMPERATURES)) if with_temperature else None
    # Each filter off about a third of the time (its first value, where shrinking goes), so that one filter at
    # a time decides too.
    k = draw(st.sampled_from((0, 1, 2, 3, 0, 2, 3, v, v + 1)))
    p = draw(st.sampled_from((1.0, 0.5, 1.0, 0.9, 0.2, 1.0, 1e-9, 0.75, 0.99)))
    m = draw(st.sampled_from((0.0, 0.1, 0.0, 1.0, 0.3, 0.0, 0.05, 0.8)))
    return torch.tensor(values), t, k, p, m


def random_filters(examples: int) -> Case:
    def check(api, call):
        logits, _, k, p, m = call
        assume(not _fragile(logits, 1.0, k, p, m))
        check_filter(api, logits, k, p, m, _rules(len(logits), None, k, p, m))
    return Case("random_logits_filter_logits",
                lambda api: check_property(_calls(False), lambda call: check(api, call), examples=examples))


def random_distributions(examples: int) -> Case:
    def check(api, call):
        logits, t, k, p, m = call
        assume(not _fragile(logits, t, k, p, m))
        check_distribution(api, logits, t, k, p, m, _rules(len(logits), t, k, p, m))
    return Case("random_logits_distribution",
                lambda api: check_property(_calls(True), lambda call: check(api, call), examples=examples))


L = [2.0, 1.0, 0.0, -1.0, -2.0]
Q = [0.4, 0.3, 0.2, 0.1]
M = [0.5, 0.3, 0.1, 0.06, 0.04]
CASES = [
    filters("top_k_keeps_the_k_largest",
            [([1.0, 3.0, -0.5, 2.0, 0.0], k, 1.0, 0.0) for k in (1, 2, 3, 4)],
            "top-k keeps the k largest logits and sets every other one to -inf (float('-inf'))"),
    filters("top_k_0_or_at_least_the_vocabulary_keeps_everything",
            [([1.0, 3.0, -0.5, 2.0, 0.0], k, 1.0, 0.0) for k in (0, 5, 9)],
            "top_k=0 means no limit, and a k at least the vocabulary size keeps every token"),
    filters("top_k_ties_at_the_kth_logit_all_stay",
            [([3.0, 2.0, 2.0, 2.0, 1.0], 2, 1.0, 0.0), ([2.0, 1.0, 2.0, 0.5], 1, 1.0, 0.0),
             ([1.0, 1.0, 1.0], 2, 1.0, 0.0)],
            "ties at the k-th largest logit all stay: keep every logit >= the k-th largest (as vLLM does), so "
            "top-k may keep more than k tokens"),
    distributions("top_k_1_is_greedy",
                  [([0.1, 0.2, 0.15, 0.3], 1.0, 1, 1.0, 0.0), ([0.1, 0.2, 0.15, 0.3], 50.0, 1, 1.0, 0.0)],
                  "top_k=1 keeps only the largest logit: all the probability on it, whatever the temperature"),
    filters("top_p_keeps_the_token_that_crosses",
            [(Q, 0, 0.65, 0.0), (Q, 0, 0.35, 0.0), (Q, 0, 0.85, 0.0), ([0.2, 0.4, 0.1, 0.3], 0, 0.65, 0.0)],
            "top-p keeps the smallest set of most likely tokens whose probabilities reach top_p, the token that "
            "crosses top_p included: p = 0.6 over 0.4, 0.3, 0.2, 0.1 keeps 0.4 and 0.3 (drop a token only when "
            "the tokens before it already reach top_p)"),
    filters("top_p_exactly_reached_drops_the_next_token",
            [([0.0] * 4, 0, 0.5, 0.0), ([0.0] * 4, 0, 0.75, 0.0), ([0.0] * 8, 0, 0.375, 0.0),
             ([0.0] * 4, 0, 0.25, 0.0)],
            "drop a token as soon as the tokens before it reach top_p, also when they reach it exactly (>=, not "
            ">): four equal tokens of 0.25 with top_p = 0.5 keep two (the smaller ids first among equals)"),
    filters("top_p_1_keeps_everything_a_tiny_top_p_keeps_the_top",
            [(Q, 0, 1.0, 0.0), (Q, 0, 1e-9, 0.0), ([0.1, 0.6, 0.3], 0, 1e-9, 0.0)],
            "top_p=1 keeps every token; however small top_p is, the most likely token always stays"),
    filters("top_p_1_keeps_tokens_far_below_the_top",
            [([0.0, -20.0, -40.0, -60.0], 0, 1.0, 0.0), ([3.0, -50.0, 2.0, -25.0], 0, 1.0, 0.0),
             ([0.0, -20.0, -40.0, -60.0], 2, 1.0, 0.0)],
            "top_p = 1 turns top-p off: every token stays, even one whose probability is 1e-17; a sum of "
            "probabilities can round to 1.0 before the last token, so skip top-p when top_p >= 1"),
    distributions("top_p_1_draws_tokens_of_tiny_probability",
                  [(L, 0.1, 0, 1.0, 0.0), ([1.0, -3.0, 0.5, -2.0], 0.2, 0, 1.0, 0.0)],
                  "top_p = 1 turns top-p off: every token keeps its probability, 2e-9 or 4e-18 too (not 0); "
                  "a sum of probabilities can round to 1.0 before the last token, so skip top-p when top_p >= 1"),
    filters("top_p_after_top_k_over_the_renormalized_probabilities",
            [(Q, 3, 0.75, 0.0), (Q, 2, 0.55, 0.0)],
            "top-p comes after top-k and is taken over the probabilities of the tokens top-k kept, renormalized "
            "(the softmax of the filtered logits)"),
    filters("min_p_is_relative_to_the_largest_probability",
            [(M, 0, 1.0, 0.19), (M, 0, 1.0, 0.21), ([0.25, 0.2, 0.2, 0.15, 0.1, 0.1], 0, 1.0, 0.5)],
            "min_p drops the tokens whose probability is below min_p x the LARGEST probability (not below "
            "min_p itself): min_p = 0.2 over 0.5, 0.3, 0.1, ... keeps the tokens of 0.1 and above"),
    filters("min_p_0_keeps_everything_min_p_1_keeps_the_top_ones",
            [(M, 0, 1.0, 0.0), (M, 0, 1.0, 1.0), ([1.0, 3.0, 3.0, 2.0], 0, 1.0, 1.0)],
            "a token whose probability equals min_p x the largest stays: drop only those strictly below (with "
            "min_p = 1 every token tied for the top stays); min_p=0 keeps every token"),
    filters("min_p_comes_before_top_p",
            [(M, 0, 0.85, 0.19), (M, 2, 0.85, 0.19)],
            "the order is min-p, then top-k, then top-p: top-p is taken over what min-p left, renormalized"),
    distributions("the_probabilities_are_the_softmax_of_logits_over_temperature",
                  [(L, t, 0, 1.0, 0.0) for t in (0.5, 1.0, 2.0, 4.0)],
                  "the probabilities are softmax(logits / temperature) over the tokens the filters keep"),
    distributions("the_temperature_comes_before_the_filters",
                  [(L, 0.5, 0, 0.8, 0.0), (L, 2.0, 0, 0.8, 0.0), (L, 2.0, 3, 0.5, 0.0), (M, 2.0, 0, 1.0, 0.19),
                   (M, 0.5, 0, 1.0, 0.1)],
                  "divide by the temperature first, then filter: min-p, top-k and top-p look at the tempered "
                  "probabilities (softmax(logits / T)), then the softmax of what is left"),
    distributions("temperature_0_is_greedy",
                  [(L, 0.0, 0, 1.0, 0.0), ([1.0, 3.0, 3.0, 2.0], 0.0, 0, 1.0, 0.0), ([0.5, -1.0], 0.0, 0, 0.3, 0.5)],
                  "temperature 0 is greedy: all the probability on the largest logit, the first one if several "
                  "tie (torch.argmax), whatever top_k, top_p and min_p say"),
    distributions("a_temperature_below_1e-5_is_greedy",
                  [([1.0, 1.0, 0.0], 1e-6, 0, 1.0, 0.0), ([1.0, 1.0, 0.0], 1e-5, 0, 1.0, 0.0),
                   ([1.0, 1.0 + 1e-6, 0.0], 1e-9, 0, 1.0, 0.0)],
                  "temperatures below 1e-5 (SAMPLING_EPS) are greedy too, since dividing by them overflows; 1e-5 "
                  "itself is not greedy"),
    random_filters(150),
    random_distributions(150),
]

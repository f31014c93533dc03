"""Cases of exercise 137: the learner's rejection_sample against nano_engine.sampling.rejection_sample.

Each case calls both with the same probabilities, drafts and uniforms, and with a `sample` of the
judge's own that records every distribution it is given and answers deterministically (the first
token whose cumulative probability passes `point`). What is compared, in this order: the tensors
given are untouched; every distribution passed to `sample` (how many, which, normalised) equals the
reference's to 1e-6; the tokens returned are the reference's. Hand-made cases first, one rule each,
then random ones (practice.properties), the smallest that differs shown.
"""

from types import SimpleNamespace

import torch

import nano_engine.sampling as ref
from practice.properties import check_property, st
from practice.worker import Case, Mismatch, require_functions

REFERENCE_FILE = ref.__file__
TOL = 1e-6


def learner(module):
    return require_functions(module, ("rejection_sample",))


def reference():
    return SimpleNamespace(rejection_sample=ref.rejection_sample)


class Sampler:
    """The judge's `sample`: records what it is given, returns the first token whose cumulative
    probability passes `point` (the last token if rounding leaves none)."""

    def __init__(self, point: float):
        self.point, self.calls = point, []

    def __call__(self, probs):
        if not isinstance(probs, torch.Tensor) or probs.dim() != 1:
            raise Mismatch(f"sample() was given {type(probs).__name__}"
                           + (f" of shape {tuple(probs.shape)}" if isinstance(probs, torch.Tensor) else ""),
                           "hint: call sample(probs) with one distribution, a 1-D tensor over the vocabulary")
        probs = probs.detach().double().clone()
        self.calls.append(probs)
        above = (probs.cumsum(0) > self.point).nonzero()
        return int(above[0]) if len(above) else len(probs) - 1


def _fmt(t) -> str:
    return "[" + ", ".join(f"{x:.4g}" for x in t.tolist()) + "]"


def check(api, p, drafts, uniforms, q=None, point=0.5, hint=""):
    p = torch.tensor(p, dtype=torch.float64) if not isinstance(p, torch.Tensor) else p
    q = None if q is None else (torch.tensor(q, dtype=torch.float64) if not isinstance(q, torch.Tensor) else q)
    given_p, given_q = p.clone(), None if q is None else q.clone()
    call = [f"rejection_sample(target_probs={[_fmt(r) for r in p]}, draft_ids={list(drafts)}, "
            f"uniforms={list(uniforms)},", f"                 draft_probs={None if q is None else [_fmt(r) for r in q]})"]
    mine, want = Sampler(point), Sampler(point)
    got = api.rejection_sample(given_p, list(drafts), list(uniforms), mine, given_q)
    expected = ref.rejection_sample(p.clone(), list(drafts), list(uniforms), want, None if q is None else q.clone())
    if not torch.equal(given_p, p) or (q is not None and not torch.equal(given_q, q)):
        raise Mismatch(*call, "  expected target_probs and draft_probs to stay unchanged", "  got them changed",
                       "hint: do not write into the tensors you are given (p[x] = 0 changes the caller's p): work on "
                       "a copy, or compute the residual as a new tensor with (p - q).clamp(min=0)")
    if not isinstance(got, (list, tuple)) or not all(isinstance(t, int) for t in got):
        raise Mismatch(*call, f"  expected a list of token ids (ints), like {expected}", f"  got {got!r}",
                       "hint: return a list of ints: the kept drafts, then the one token sample() gave")
    for k, (a, b) in enumerate(zip(mine.calls, want.calls)):
        if a.shape != b.shape or not torch.allclose(a, b, atol=TOL, rtol=0):
            what = ("the bonus: the last row of target_probs" if k == len(want.calls) - 1 and len(expected) ==
                    len(drafts) + 1 else f"the residual of draft {len(expected) - 1}: max(0, p - q) normalised")
            total = a.sum().item()
            raise Mismatch(*call, f"  call {k + 1} of sample(): expected {_fmt(b)} ({what})", f"  got {_fmt(a)}",
                           f"  the distribution you passed sums to {total:.4g}, not 1: normalise it"
                           if abs(total - 1) > TOL else "",
                           "hint: " + (hint or "a refused draft is replaced from max(0, p_j - q_j) divided by its sum; "
                                       "the bonus comes from target_probs[d]"))
    if len(mine.calls) != len(want.calls):
        raise Mismatch(*call, f"  expected sample() to be called {len(want.calls)} time(s)",
                       f"  got {len(mine.calls)} call(s); your result {got}, expected {expected}",
                       "hint: " + (hint or "exactly one token comes from sample(): the correction of the first refused "
                                   "draft, or the bonus when every draft is kept; stop at the first refusal"))
    if list(got) != expected:
        raise Mismatch(*call, f"  expected {expected}", f"  got      {list(got)}", "hint: " + (
            hint or "keep draft j when uniforms[j] < p_j(x_j) / q_j(x_j) (q one-hot when draft_probs is None); "
                    "return the kept drafts, then the token sample() gave"))


def case(name, p, drafts, uniforms, q=None, point=0.5, hint=""):
    return Case(name, lambda api: check(api, p, drafts, uniforms, q, point, hint))


P = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5]]
Q = [[0.2, 0.5, 0.3], [0.7, 0.2, 0.1]]


@st.composite
def _cases(draw):
    v = draw(st.integers(2, 6))
    d = draw(st.integers(0, 4))

    def dist():
        w = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), min_size=v, max_size=v))
        w[draw(st.integers(0, v - 1))] += 1.0  # never all zero
        t = torch.tensor(w, dtype=torch.float64)
        return t / t.sum()

    p = torch.stack([dist() for _ in range(d + 1)])
    one_hot = draw(st.booleans())
    q = None if one_hot or d == 0 else torch.stack([dist() for _ in range(d)])
    drafts = []
    for j in range(d):
        if q is None:
            drafts.append(draw(st.integers(0, v - 1)))
        else:
            # mostly a token the proposer could give; now and then one it gives probability 0
            likely = [t for t in range(v) if q[j, t] > 0]
            pick = st.sampled_from(likely) if draw(st.integers(0, 4)) else st.integers(0, v - 1)
            drafts.append(draw(pick))
    uniforms = [draw(st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.7, 0.95])) for _ in range(d)]
    return p, drafts, uniforms, q, draw(st.sampled_from([0.1, 0.5, 0.9]))


def random_cases(examples: int) -> Case:
    return Case("random_cases", lambda api: check_property(
        _cases(), lambda c: check(api, *c), examples=examples))


CASES = [
    case("every_draft_kept_then_the_bonus_from_the_last_row", P, [0, 1], [0.3, 0.2],
         hint="with every draft kept, the one more token comes from the LAST row, target_probs[d]"),
    case("no_drafts_only_the_bonus", [[0.2, 0.5, 0.3]], [], [],
         hint="with no drafts, the result is one token, drawn from target_probs[0]"),
    case("a_refused_draft_is_replaced_from_the_residual", P, [0, 1], [0.6, 0.0],
         hint="draft 0 (p = 0.5, q one-hot) with u = 0.6 is refused: draw from p without it, renormalised "
              "([0, 0.6, 0.4]), and stop: draft 1 is not looked at"),
    case("nothing_after_the_first_refusal", P, [2, 1], [0.9, 0.0],
         hint="after the first refused draft the step ends: no more tests, no bonus"),
    case("a_real_q_keeps_with_probability_p_over_q", P, [1, 0], [0.55, 0.1], Q,
         hint="keep draft j when u_j < p_j(x) / q_j(x) with q the proposer's: 0.3 / 0.5 = 0.6 > 0.55 keeps draft 0, "
              "0.1 / 0.7 = 0.14 > 0.1 keeps draft 1 (u < p alone would refuse it)"),
    case("the_residual_is_p_minus_q_clamped_and_normalised", P, [1], [0.9], Q,
         hint="the residual is max(0, p - q) (negative entries to 0), divided by its sum: "
              "[0.5, 0.3, 0.2] - [0.2, 0.5, 0.3] -> [0.3, 0, 0] -> [1, 0, 0]"),
    case("a_ratio_above_one_is_always_kept", P, [0], [0.95], Q,
         hint="p(x) / q(x) = 0.5 / 0.2 = 2.5: above 1, the draft is kept whatever u is"),
    case("a_draft_of_probability_zero_is_never_kept", [[0.0, 0.4, 0.6], [0.5, 0.5, 0.0]], [0], [0.0],
         hint="keep only when u < p / q, strictly: with p(x) = 0 the ratio is 0 and u = 0 is not below it"),
    case("a_draft_the_proposer_gave_probability_zero_is_never_kept", [[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], [0],
         [0.3], [[0.0, 0.4, 0.6]],
         hint="with q_j(x) = 0 there is no ratio p / q to test (u * q < p would keep it): refuse the draft, as when "
              "p(x) = 0, and draw from the residual max(0, p - q)"),
    case("greedy_keeps_exactly_the_argmax", [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], [1, 0], [0.99, 0.0],
         hint="a greedy p is one-hot on the argmax: the argmax draft is kept (ratio 1 > any u < 1), any other "
              "draft refused and replaced by the argmax"),
    case("one_hot_q_when_draft_probs_is_none", [[0.25, 0.25, 0.5], [0.9, 0.05, 0.05]], [2], [0.49], point=0.1,
         hint="draft_probs=None means q is one-hot on the draft: keep it when u < p(x) (here 0.49 < 0.5)"),
    random_cases(150),
]

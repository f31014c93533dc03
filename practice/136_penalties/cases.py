"""Cases of exercise 136: the learner's apply_penalties against nano_engine.sampling.apply_penalties.

Hand-made batches first, one rule per case (repetition by the sign of the logit, over prompt and
output, once per token; frequency by the count in the output; presence once; their order; each row
with its own parameters and history), each with the hint of its rule; then a property case
(practice.properties): batches drawn by hypothesis, the smallest one that differs shown.
The result must be a new tensor of the logits' shape and dtype, agree with the reference to 1e-6
(1e-12 for float64 logits), and the logits and the token lists given must come back untouched. A failure
names the first token that differs: its logit, whether it is in the prompt, how often in the output.
"""

import math
from types import SimpleNamespace

import torch

import nano_engine.sampling as ref
from practice.properties import check_property, st
from practice.worker import Case, Mismatch, require_functions

REFERENCE_FILE = ref.__file__
TOL = 1e-6
TOL64 = 1e-12  # float64 logits (a float64 model) must stay exact to float64


def learner(module):
    return require_functions(module, ("apply_penalties",))


def reference():
    return SimpleNamespace(apply_penalties=ref.apply_penalties)


def _fmt(values) -> str:
    return "[" + ", ".join("-inf" if math.isinf(x) and x < 0 else f"{x:.4g}" for x in values) + "]"


def check(api, logits, prompt_ids, output_ids, rep, freq, pres, hint):
    """One call of apply_penalties on a copy of logits (B, V), compared with the reference."""
    given = logits.clone()
    args = ([list(p) for p in prompt_ids], [list(o) for o in output_ids], list(rep), list(freq), list(pres))
    kept = ([list(p) for p in args[0]], [list(o) for o in args[1]])
    got = api.apply_penalties(given, *args)
    call = [f"apply_penalties(logits {tuple(logits.shape)} {logits.dtype}, prompt_ids={kept[0]}, "
            f"output_ids={kept[1]},",
            f"                repetition_penalty={args[2]}, frequency_penalty={args[3]}, presence_penalty={args[4]})"]
    if not torch.equal(given, logits):
        raise Mismatch(*call, "  expected the input logits to stay unchanged", "  got them changed",
                       "hint: do not change the logits you are given: return a new tensor (clone first)")
    if (args[0], args[1]) != kept:
        raise Mismatch(*call, f"  expected prompt_ids={kept[0]}, output_ids={kept[1]} to stay unchanged",
                       f"  got prompt_ids={args[0]}, output_ids={args[1]} after the call",
                       "hint: do not change prompt_ids or output_ids: they are the request's own token lists "
                       "(seen = prompt + output makes a new list; seen += output extends the prompt)")
    if not isinstance(got, torch.Tensor) or got.shape != logits.shape:
        what = f"shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        raise Mismatch(*call, f"  expected a tensor of shape {tuple(logits.shape)}", f"  got {what}",
                       "hint: return the penalized logits, one row per request, shaped like the input")
    if got.dtype != logits.dtype:
        raise Mismatch(*call, f"  expected a tensor of dtype {logits.dtype}", f"  got dtype {got.dtype}",
                       "hint: keep the logits' dtype: build the result from the logits (clone) and compute in "
                       "their dtype, not in a new torch.zeros / torch.tensor (float32) or float64 counts")
    if got.untyped_storage().data_ptr() == given.untyped_storage().data_ptr():
        raise Mismatch(*call, "  expected a new tensor", "  got the logits given (the same storage)",
                       "hint: return a new tensor also when no penalty is on: the caller may change the result, "
                       "and the logits given must stay as they are (return logits.clone())")
    tol = TOL if logits.dtype != torch.float64 else TOL64
    want = ref.apply_penalties(logits.clone(), *args).double()
    got = got.detach().double()
    bad = ~(torch.isclose(got, want, rtol=tol, atol=tol) | ((got == want) & torch.isinf(want)))
    if bad.any():
        row, token = (int(i) for i in bad.nonzero()[0])
        where = (f"token {token}: logit {logits[row, token].item():.4g}, in the prompt: "
                 f"{'yes' if token in args[0][row] else 'no'}, times in the output: {args[1][row].count(token)}")
        off = abs(got[row, token] - want[row, token]).item()
        raise Mismatch(*call, f"  row {row}, the logits {_fmt(logits[row].tolist())}",
                       f"  expected {_fmt(want[row].tolist())}", f"  got      {_fmt(got[row].tolist())}",
                       f"  first difference at {where}, off by {off:.3g} (tolerance {tol:g}; row {row}: repetition "
                       f"{args[2][row]}, frequency {args[3][row]}, presence {args[4][row]})", "hint: " + hint)


def one_row(name, logits, calls, hint):
    """calls: (prompt_ids, output_ids, repetition, frequency, presence) on the single row `logits`."""
    def run(api):
        x = torch.tensor([logits])
        for prompt, output, r, f, p in calls:
            check(api, x, [prompt], [output], [r], [f], [p], hint)
    return Case(name, run)


def batch(name, logits, prompts, outputs, rep, freq, pres, hint, dtype=torch.float32):
    return Case(name, lambda api: check(api, torch.tensor(logits, dtype=dtype), prompts, outputs, rep, freq, pres,
                                        hint))


def _rules(rep, freq, pres) -> str:
    """The penalties on in this batch, in their order: the hint of a random batch."""
    steps = []
    if any(r != 1.0 for r in rep):
        steps.append("repetition r over the tokens of the prompt AND the output, once per token however often: a "
                     "positive logit / r, a negative one x r")
    if any(f != 0.0 for f in freq):
        steps.append("subtract frequency x (how many times the token is in the output; the prompt does not count)")
    if any(p != 0.0 for p in pres):
        steps.append("subtract presence once from each token in the output (the prompt does not count)")
    if not steps:
        return "every penalty is off (repetition 1, frequency 0, presence 0): a new tensor of the same values"
    return "each row with its own penalties and history, in this order: " + "; then ".join(steps)


LOGITS = (0.0, 1.0, -1.0, 2.5, -0.5, -3.0, 0.75, 1.37, -2.21, 3.9, float("-inf"))
REPETITION = (1.0, 2.0, 1.0, 0.5, 1.25, 0.8)
FREQUENCY = (0.0, 0.5, 0.0, 1.0, -0.5, 2.0, -2.0)
PRESENCE = (0.0, 1.0, 0.0, 0.5, -1.0, 2.0, -2.0)


@st.composite
def _batches(draw):
    """(logits, prompts, outputs, repetition, frequency, presence): 1 to 3 rows of 1 to 8 tokens (positive,
    0, negative and -inf logits), prompts of up to 6 tokens and outputs of up to 8 (empty ones, tokens
    repeated, in both), each penalty per row at its off value (about a third of the time), positive and
    negative; float32 or float64. The first row's logits set the vocabulary size V (the other rows are cut
    or padded with 0 to it, token ids taken modulo V), so that shrinking can drop a token or a row."""
    row = st.tuples(st.lists(st.sampled_from(LOGITS), min_size=1, max_size=8), st.lists(st.integers(0, 7), max_size=6),
                    st.lists(st.integers(0, 7), max_size=8), *map(st.sampled_from, (REPETITION, FREQUENCY, PRESENCE)))
    logits, prompts, outputs, rep, freq, pres = map(list, zip(*draw(st.lists(row, min_size=1, max_size=3))))
    v = len(logits[0])
    logits = [(x + [0.0] * v)[:v] for x in logits]
    prompts, outputs = ([[t % v for t in ids] for ids in rows] for rows in (prompts, outputs))
    dtype = draw(st.sampled_from((torch.float32, torch.float64)))
    return torch.tensor(logits, dtype=dtype), prompts, outputs, rep, freq, pres


def random_batches(examples: int) -> Case:
    def run(api):
        check_property(_batches(), lambda batch: check(api, *batch, _rules(*batch[3:])), examples=examples)
    return Case("random_batches", run)


ROW = [2.0, -1.0, 0.5, -2.0, 0.0, 1.5]
CASES = [
    batch("penalties_off_or_no_history_change_nothing", [ROW, ROW, ROW],
          [[0, 1, 2], [], [3]], [[1, 1, 5], [], [3, 3]], [1.0, 1.5, 1.0], [0.0, 0.5, 0.0], [0.0, 1.0, 0.0],
          "with repetition_penalty 1 and frequency and presence 0, or with no tokens seen, the logits come back "
          "unchanged"),
    one_row("repetition_divides_a_positive_logit", ROW, [([], [0], 2.0, 0.0, 0.0), ([], [0, 2, 5], 1.25, 0.0, 0.0)],
            "repetition_penalty r divides the logit of each token already seen when that logit is positive"),
    one_row("repetition_multiplies_a_negative_logit", ROW,
            [([], [1], 2.0, 0.0, 0.0), ([], [1, 3, 4], 1.5, 0.0, 0.0), ([], [0, 1, 2, 3], 3.0, 0.0, 0.0)],
            "a negative logit is multiplied by r (dividing it would bring it closer to 0, making the token MORE "
            "likely); 0 stays 0"),
    one_row("repetition_covers_the_prompt_too", ROW,
            [([0, 1], [], 2.0, 0.0, 0.0), ([5, 3], [2], 1.5, 0.0, 0.0)],
            "repetition covers every token of the prompt and of the output (vLLM's prompt mask | output mask); "
            "frequency and presence look at the output only"),
    one_row("repetition_applies_once_however_often", ROW,
            [([0, 0, 1], [0, 0, 1, 1, 1], 2.0, 0.0, 0.0), ([5], [5, 5, 5], 1.5, 0.0, 0.0)],
            "repetition applies once per token, however often it appears: divide (or multiply) by r, not by "
            "r ** count"),
    one_row("a_repetition_penalty_below_1_encourages", ROW,
            [([0, 1], [2, 3], 0.5, 0.0, 0.0)],
            "the same rule with r < 1: a positive logit divided by 0.5 doubles, a negative one multiplied by 0.5 "
            "halves, so the seen tokens become more likely"),
    one_row("frequency_subtracts_per_occurrence_in_the_output", ROW,
            [([], [0, 0, 0, 1], 1.0, 0.5, 0.0), ([3, 3, 5], [5], 1.0, 1.0, 0.0), ([0], [], 1.0, 2.0, 0.0)],
            "frequency subtracts frequency_penalty x (how many times the token is in the OUTPUT); a token only in "
            "the prompt is not touched"),
    one_row("presence_subtracts_once_per_token_in_the_output", ROW,
            [([], [0, 0, 0, 1], 1.0, 0.0, 1.5), ([2, 3], [2, 4, 4], 1.0, 0.0, 0.5)],
            "presence subtracts presence_penalty once for each token in the output, however often it is there; "
            "the prompt does not count"),
    one_row("negative_frequency_and_presence_encourage", ROW,
            [([], [0, 0, 3], 1.0, -0.5, 0.0), ([], [0, 0, 3], 1.0, 0.0, -2.0), ([], [1, 1, 1], 1.0, -1.0, -1.0)],
            "negative frequency and presence penalties are subtracted the same way: they raise the logits"),
    one_row("a_token_in_the_prompt_and_the_output", [1.0, -1.0, 0.5, 3.0],
            [([0, 1], [0, 0, 0, 1], 2.0, 0.5, 1.0), ([3], [3, 2, 2], 1.5, 1.0, 0.25)],
            "repetition first, on the model's logit (divide if positive, multiply if negative), then subtract "
            "frequency x count and presence: 1.0 seen 3 times with r=2, f=0.5, p=1 gives 1.0 / 2 - 1.5 - 1 = -2.0"),
    batch("each_row_has_its_own_parameters_and_history", [ROW, ROW, ROW, ROW],
          [[0], [1, 2], [], [0]], [[2, 2], [], [0, 5, 5], [2, 2]], [2.0, 1.5, 1.0, 1.0], [0.0, 0.5, 1.0, 0.5],
          [1.0, 0.0, 0.5, 0.0],
          "each row is one request: row i uses prompt_ids[i], output_ids[i] and the i-th of each penalty, nothing "
          "from the other rows"),
    batch("a_masked_token_stays_minus_infinity", [[float("-inf"), 1.0, -1.0], [2.0, float("-inf"), 0.5]],
          [[0], [1]], [[0, 0], [1, 2]], [2.0, 0.5], [1.0, -1.0], [0.5, -0.5],
          "a logit of -inf (a token masked by logit bias or min_tokens) stays -inf: -inf x r and -inf - x are -inf"),
    batch("penalties_off_in_every_row_still_return_a_new_tensor", [ROW, ROW], [[0, 1], []], [[2, 2, 5], []],
          [1.0, 1.0], [0.0, 0.0], [0.0, 0.0],
          "with every penalty off the values stay as they are, in a new tensor"),
    batch("float64_logits_stay_float64_and_exact", [[0.1, -0.3, 2.7, -1.9, 0.0, 1.3], [0.7, -0.1, 0.2, 3.1, -2.2, 0.9]],
          [[0, 1], [3]], [[2, 2, 2, 3, 0], [0, 0, 1, 4, 4, 4, 4]], [1.2, 1.3], [0.3, 0.7], [0.1, -0.6],
          "keep the logits' dtype and compute in it: the engine passes float64 logits for a float64 model and "
          "expects them exact, so float32 counts (bincount(...).float()) or float32 penalties lose digits",
          dtype=torch.float64),
    random_batches(100),
]

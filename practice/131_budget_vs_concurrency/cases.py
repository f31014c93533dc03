"""Cases of exercise 131: the learner's formulas against what the real engine does.

Every expected answer is measured at grading time from what the engine's scheduler did at each
step (a tiny model, so each run takes milliseconds), never taken from a formula of the judge's. `reference()` holds
the model answers that `--reference` grades (the package has no such functions: see README.md).
The counts must come back as ints (12.0 is not a number of steps), a warning as a str, and a
fine configuration as None; the grids hold the boundaries: a budget equal to max_num_seqs, one
token per request (max_tokens=1), no request decoding (num_decoding=0), a prompt that fits whole.
The last case draws settings at random (hypothesis, seeded): every function on each draw, each
answer again against a run of the engine, the smallest setting that differs shown.
"""

import functools
import math
from types import SimpleNamespace

from nano_engine import LLMEngine, SamplingParams, Scheduler
from nano_engine.tiny import tiny_model
from practice.endtoend import recording
from practice.properties import check_property, st
from practice.worker import Case, Mismatch, require_functions

MODEL = tiny_model(0)
NAMES = ("max_decodes_per_step", "steps_to_finish", "prefill_tokens", "check_config")
REFERENCE_FILE = __file__


def learner(module):
    return require_functions(module, NAMES)


def reference():
    return SimpleNamespace(
        max_decodes_per_step=lambda seqs, budget: min(seqs, budget),
        steps_to_finish=lambda n, m, seqs, budget: math.ceil(n / min(seqs, budget)) * m,
        prefill_tokens=lambda d, p, seqs, budget: 0 if d >= seqs else min(p, budget - d),
        check_config=lambda seqs, budget: None if budget >= seqs else (
            f"max_num_batched_tokens={budget} < max_num_seqs={seqs}: at most {budget} requests decode per "
            f"step, and prompts get no budget while they do; raise the budget well above {seqs}"))


def _engine(seqs, budget, num_requests, max_tokens):
    """The workload: 1-token prompts, max_tokens new tokens each, all queued before the first step."""
    engine = LLMEngine(MODEL, max_num_seqs=seqs, max_num_batched_tokens=budget, enable_prefix_caching=False,
                       scheduler_cls=recording(Scheduler))
    for _ in range(num_requests):
        engine.add_request([5], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return engine


def _run(engine):
    """Step to the end; returns each step's chunks."""
    steps = []
    while engine.has_unfinished():
        engine.step()
        steps.append(engine.scheduler.last.chunks)
    return steps


@functools.lru_cache(maxsize=None)
def measured_decodes(seqs, budget):
    steps = _run(_engine(seqs, budget, seqs + 2, 3))  # more requests than can ever run at once
    return max(sum(c.kind == "decode" for c in chunks) for chunks in steps)


@functools.lru_cache(maxsize=None)
def measured_steps(n, max_tokens, seqs, budget):
    engine = _engine(seqs, budget, n, max_tokens)
    _run(engine)
    return engine.stats.steps


@functools.lru_cache(maxsize=None)
def measured_prefill(decoding, prompt_len, seqs, budget):
    engine = _engine(seqs, budget, decoding, 8)
    engine.step()  # admits the decoding requests (their 1-token prefill)
    rid = engine.add_request([7] * prompt_len, SamplingParams(max_tokens=2))
    engine.step()
    return sum(c.n for c in engine.scheduler.last.chunks if c.request.request_id == rid)


PARAMS = {
    "max_decodes_per_step": ("max_num_seqs", "max_num_batched_tokens"),
    "steps_to_finish": ("num_requests", "max_tokens", "max_num_seqs", "max_num_batched_tokens"),
    "prefill_tokens": ("num_decoding", "prompt_len", "max_num_seqs", "max_num_batched_tokens"),
}


def _compare(api, fn_name, args, measure, hint):
    """The learner's count for args against what the engine measured; hint(args, want, got) for a wrong one."""
    want, got = measure(*args), getattr(api, fn_name)(*args)
    right_type = isinstance(got, int) and not isinstance(got, bool)
    if got != want or not right_type:
        call = f"{fn_name}({', '.join(f'{k}={v}' for k, v in zip(PARAMS[fn_name], args))})"
        raise Mismatch(call, f"  expected {want!r}  (what the engine measured)", f"  got      {got!r}",
                       "hint: " + (hint(*args, want, got) if got != want else
                                   f"{fn_name} is a count: return an int, not a {type(got).__name__}"))


def _check(fn_name, grid, measure, hint):
    """hint(args, want, got): one sentence for a wrong count."""
    def run(api):
        for args in grid:
            _compare(api, fn_name, args, measure, hint)
    return run


def _decodes_hint(seqs, budget, want, got):
    if got == seqs:
        return (f"a decode costs one token of the budget: {budget} tokens decode at most {budget} requests, "
                f"whatever max_num_seqs allows")
    if got == budget:
        return f"at most max_num_seqs={seqs} requests run at once, however large the budget"
    return "a decode costs one token of the budget, and at most max_num_seqs requests run: both cap a step"


def _steps_hint(n, max_tokens, seqs, budget, want, got):
    waves = -(-n // min(seqs, budget))
    if got == -(-n // seqs) * max_tokens:
        return (f"a budget of {budget} tokens decodes only {budget} requests per step: requests run in waves of "
                "min(max_num_seqs, max_num_batched_tokens)")
    if got == waves * (max_tokens + 1):
        return ("the 1-token prefill already samples the first token: a wave takes max_tokens steps, "
                "not max_tokens + 1")
    if got == -(-n * max_tokens // min(seqs, budget)):
        return (f"a request gets one token per step, so each wave takes max_tokens steps even when it is not full: "
                f"{n * max_tokens} tokens at {min(seqs, budget)} per step counts the idle slots of the last wave "
                "as if they worked")
    return ("requests run in waves of min(max_num_seqs, budget); a wave takes max_tokens steps (the 1-token "
            "prefill already gives the first token), and the next wave starts when it finishes")


def _prefill_hint(decoding, prompt_len, seqs, budget, want, got):
    if decoding >= seqs and got:
        return (f"max_num_seqs={seqs} requests already run: the newcomer is not admitted this step, "
                "so it computes nothing")
    if got == min(prompt_len, budget):
        return ("running requests are served first, one token per decode: the newcomer gets what is left, "
                "max_num_batched_tokens - num_decoding")
    if got == 0 and want:
        return ("a prompt that does not fit is chunked, not postponed: it computes what is left of the budget, "
                "min(prompt_len, max_num_batched_tokens - num_decoding)")
    if got > prompt_len:
        return f"a {prompt_len}-token prompt computes at most its {prompt_len} tokens, however much budget is left"
    return ("running requests are served first, one token per decode; a newcomer gets what is left of the "
            "budget (chunked), and nothing while max_num_seqs requests run")


def _compare_config(api, seqs, budget):
    decodes = measured_decodes(seqs, budget)
    wasteful = decodes < seqs
    got = api.check_config(seqs, budget)
    call = f"check_config(max_num_seqs={seqs}, max_num_batched_tokens={budget})"
    if wasteful and not isinstance(got, str):
        raise Mismatch(call, f"  expected a warning, a str naming {seqs} and {budget}: the engine decoded at most "
                       f"{decodes} of {seqs} requests per step", f"  got      {got!r}",
                       "hint: when max_num_batched_tokens < max_num_seqs, not every running request can "
                       "decode in one step: return the warning as a str (warnings.warn returns None)")
    if wasteful and not (str(seqs) in got and str(budget) in got):
        raise Mismatch(call, f"  expected a warning naming both {seqs} and {budget}", f"  got      {got!r}",
                       "hint: name both numbers, so the user knows what to change")
    if not wasteful and got is not None:
        raise Mismatch(call, f"  expected None: the engine decoded all {seqs} requests in one step",
                       f"  got      {got!r}", "hint: this configuration is fine: return None")


def _check_config(api):
    for seqs, budget in [(8, 4), (4, 8), (6, 6), (16, 15), (256, 128), (256, 8192)]:
        _compare_config(api, seqs, budget)


EXAMPLES = 60  # settings drawn by random_settings: about 1 s of engine runs for the reference


@st.composite
def _settings(draw):
    """(max_num_seqs, budget, num_requests, max_tokens, num_decoding, prompt_len), boundaries drawn often:
    a budget equal to max_num_seqs or one off it, max_tokens=1, no request or a full step decoding, a
    prompt that fills what is left of the budget exactly, or one token more or less."""
    seqs = draw(st.integers(1, 10))
    budget = draw(st.one_of(st.just(seqs), st.integers(max(1, seqs - 1), seqs + 1), st.integers(1, 16)))
    n, max_tokens = draw(st.integers(1, 12)), draw(st.integers(1, 4))
    wave = min(seqs, budget)
    decoding = draw(st.one_of(st.just(0), st.just(wave), st.integers(0, wave)))
    left = budget - decoding
    edges = sorted({max(1, left - 1), max(1, left), left + 1})
    prompt_len = draw(st.one_of(st.integers(1, 24), st.sampled_from(edges)))
    return seqs, budget, n, max_tokens, decoding, prompt_len


def _random_settings(api):
    def check(setting):
        seqs, budget, n, max_tokens, decoding, prompt_len = setting
        _compare(api, "max_decodes_per_step", (seqs, budget), measured_decodes, _decodes_hint)
        _compare(api, "steps_to_finish", (n, max_tokens, seqs, budget), measured_steps, _steps_hint)
        _compare(api, "prefill_tokens", (decoding, prompt_len, seqs, budget), measured_prefill, _prefill_hint)
        _compare_config(api, seqs, budget)
    check_property(_settings(), check, examples=EXAMPLES)


CASES = [
    Case("max_decodes_per_step", _check(
        "max_decodes_per_step", [(8, 4), (4, 8), (6, 6), (16, 3), (256, 128)], measured_decodes, _decodes_hint)),
    Case("steps_to_finish", _check(
        "steps_to_finish", [(8, 3, 8, 8), (8, 3, 8, 4), (5, 4, 2, 16), (7, 2, 8, 3), (256, 4, 256, 256),
                            (256, 4, 256, 128), (6, 1, 4, 4)], measured_steps, _steps_hint)),
    Case("prefill_tokens", _check(
        "prefill_tokens", [(4, 10, 8, 8), (4, 10, 8, 4), (2, 20, 4, 16), (4, 10, 4, 16), (5, 3, 8, 6),
                           (3, 2, 8, 16), (0, 10, 8, 6), (0, 5, 8, 16)], measured_prefill, _prefill_hint)),
    Case("check_config", _check_config),
    Case("random_settings", _random_settings),
]

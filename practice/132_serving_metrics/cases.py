"""Cases of exercise 132: the learner's serving metrics against nano_engine.benchmarks.metrics.

The reference is `nano_engine.benchmarks.metrics` (vLLM's `calculate_metrics` from
`vllm/benchmarks/serve.py`, to the letter) and, for a single percentile, `numpy.percentile`, which
vLLM calls. Hand-made traces put values exactly on the boundaries (an SLO met with equality, a
one-token request, a failed one); recorded traces come from a seeded generator that plays what a
load generator sees: Poisson arrivals, a queueing and prefill delay, decode gaps with jitter,
chunks that carry two tokens, one-token answers and a failed request. Everything is deterministic.
"""

import math
import random
from types import SimpleNamespace

import numpy as np

import nano_engine.benchmarks.metrics as ref
from nano_engine.benchmarks.metrics import RequestRecord as R
from practice.worker import Case, Mismatch, require_functions

REFERENCE_FILE = ref.__file__
NAMES = ("ttft", "itls", "tpot", "e2el", "percentile", "calculate_metrics")


def learner(module):
    return require_functions(module, NAMES)


def reference():
    return SimpleNamespace(
        ttft=ref.ttft, itls=ref.itls, tpot=ref.tpot, e2el=ref.e2el,
        percentile=lambda values, p: float(np.percentile(values, p)),
        calculate_metrics=lambda records, duration, goodput_slos=None, percentiles=(50, 90, 99):
            ref.calculate_metrics(records, duration, goodput_slos, percentiles).to_dict())


# ----- traces -----

def hand() -> list[R]:
    """A: 4 tokens, one a chunk; B: 1 token, stream closed 0.25 s after it; C: 5 tokens in 2 chunks."""
    return [R(start=0.0, chunk_times=[0.5, 0.75, 1.0, 1.5], end=1.5, prompt_tokens=10, output_tokens=4),
            R(start=1.0, chunk_times=[1.25], end=1.5, prompt_tokens=6, output_tokens=1),
            R(start=2.0, chunk_times=[3.0, 3.5], end=3.5, prompt_tokens=4, output_tokens=5)]


def hand_with_failure() -> list[R]:
    return hand() + [R(start=2.5, chunk_times=[], end=2.625, prompt_tokens=100, output_tokens=0,
                       success=False, error="HTTP 500")]


def all_failed() -> list[R]:
    return [R(start=0.0, chunk_times=[], end=0.5, prompt_tokens=9, output_tokens=0, success=False, error="HTTP 503"),
            R(start=0.25, chunk_times=[], end=0.375, prompt_tokens=4, output_tokens=0, success=False,
              error="Connection reset")]


def one_token_only() -> list[R]:
    return [R(start=0.0, chunk_times=[0.25], end=0.25, prompt_tokens=3, output_tokens=1),
            R(start=0.5, chunk_times=[1.0], end=1.0, prompt_tokens=7, output_tokens=1)]


def recorded(seed: int, n: int = 40, rate: float = 4.0) -> tuple[list[R], float]:
    """A benchmark run as a load generator records it, and its wall time (s).

    Requests arrive as a Poisson process of `rate` per second; the first chunk comes after a queueing
    delay (0-300 ms) plus a prefill time per prompt token; decode chunks come every 20-40 ms, now and
    then carrying two tokens; some answers are one token; one request fails.
    """
    rng = random.Random(seed)
    t, out = 0.0, []
    failed = rng.randrange(n)
    for i in range(n):
        t += rng.expovariate(rate)
        prompt, tokens = rng.randint(8, 400), 1 if rng.random() < 0.15 else rng.randint(2, 64)
        if i == failed:
            out.append(R(start=round(t, 6), chunk_times=[], end=round(t + rng.uniform(0.01, 0.2), 6),
                         prompt_tokens=prompt, output_tokens=0, success=False, error="Connection reset"))
            continue
        chunk, left, chunks = t + rng.uniform(0.0, 0.3) + prompt * 2e-4, tokens - 1, []
        chunks.append(chunk)
        while left > 0:
            chunk += rng.uniform(0.02, 0.04)
            left -= 2 if left >= 2 and rng.random() < 0.15 else 1
            chunks.append(chunk)
        end = chunks[-1] + rng.choice([0.0, 0.0, rng.uniform(0.0, 0.005)])  # [DONE] may trail the last chunk
        out.append(R(start=round(t, 6), chunk_times=[round(c, 6) for c in chunks], end=round(end, 6),
                     prompt_tokens=prompt, output_tokens=tokens))
    duration = max(r.end for r in out) + 0.05  # the wall clock ran from before the first send to after the last
    return out, round(duration, 6)


# ----- comparing -----

def _close(want, got) -> bool:
    """got, as the learner returned it, against want: None only for None, a number for a number."""
    if want is None or got is None:
        return want is None and got is None
    if isinstance(want, list):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(map(_close, want, got))
    if isinstance(got, (str, bytes, bool)):  # float("0.9") would pass for a string: a figure is a number
        return False
    try:
        return math.isclose(float(got), float(want), rel_tol=1e-9, abs_tol=1e-9)
    except (TypeError, ValueError):
        return False


def _show(r: R) -> str:
    if not r.success:
        return f"start {r.start:g}, end {r.end:g}, prompt {r.prompt_tokens}, FAILED ({r.error})"
    chunks = ", ".join(f"{c:g}" for c in r.chunk_times)
    return f"start {r.start:g}, chunks [{chunks}], end {r.end:g}, prompt {r.prompt_tokens}, output {r.output_tokens}"


def _trace_lines(name: str, records: list[R], duration: float) -> list[str]:
    if len(records) > 6:
        return [f"trace {name}: {len(records)} requests ({sum(not r.success for r in records)} failed), "
                f"duration {duration:g} s"]
    return [f"trace {name}, duration {duration:g} s:"] + [f"  request {i}: {_show(r)}" for i, r in enumerate(records)]


KEY_HINTS = [  # (part of a key, hint): the first that matches the key that differs
    ("duration", "the duration you are given is the benchmark's wall time: report it and divide by it, "
                 "never by the span from the first start to the last end"),
    ("request_goodput", "goodput = requests meeting every SLO given (value <= SLO, in ms) / duration; "
                        "None when no SLO is given"),
    ("throughput", "throughputs divide by the duration you are given; failed requests are counted in `failed` "
                   "and left out of every other figure"),
    ("total_", "sum the tokens of the successful requests only: failed ones are left out of every other figure"),
    ("completed", "completed counts the successful requests, failed the others"),
    ("failed", "completed counts the successful requests, failed the others"),
    ("tpot", "TPOT = (E2EL - TTFT) / (output_tokens - 1), taken over the requests of 2 or more output tokens "
             "only; an empty list reads as 0"),
    ("itl", "pool the chunk gaps of all requests into one list (a long request weighs more), then take statistics"),
    ("std", "std is the population std (numpy's default, ddof=0)"),
    ("_ms", "statistics are in milliseconds; percentiles interpolate linearly, as numpy.percentile"),
]


def _key_hint(key: str) -> str:
    return next((h for part, h in KEY_HINTS if part in key), "compare with the definitions in README.md")


def check_metrics(name, trace, records, duration, slos=None, percentiles=(50, 90, 99), goodput_hint=None):
    """The learner's calculate_metrics(...) dict against the reference's, key by key.

    The hint names what the first key that differs measures; `goodput_hint` replaces it for goodput.
    """
    def run(api):
        want = ref.calculate_metrics(records, duration, slos, percentiles).to_dict()
        got = api.calculate_metrics(records, duration, slos, percentiles)
        head = _trace_lines(trace, records, duration) + [
            f"calculate_metrics(duration={duration:g}, goodput_slos={slos}, percentiles={percentiles})"]
        if not isinstance(got, dict):
            raise Mismatch(*head, f"  expected  a dict with the keys {', '.join(list(want)[:4])}, ...",
                           f"  got       {type(got).__name__}", "hint: return a dict named as vLLM's result JSON")
        for key, value in want.items():  # every key first: a key written wrong may overwrite another one
            if key not in got:
                raise Mismatch(*head, f"  expected  the key {key!r} = {value!r}", "  got       no such key",
                               "hint: the keys are vLLM's: mean_ttft_ms, p99_itl_ms (for p = 99 or 99.0), "
                               "p99.9_e2el_ms, ...")
        for key, value in want.items():
            if not _close(value, got[key]):
                raise Mismatch(*head, f"  {key}", f"  expected  {value!r}", f"  got       {got[key]!r}",
                               "hint: " + (goodput_hint if goodput_hint and key == "request_goodput"
                                           else _key_hint(key)))
    return Case(name, run)


def check_per_request(name, fn, traces, hint):
    """The learner's fn(record) against the reference's, on every successful request."""
    def run(api):
        for trace_name, (records, _) in traces.items():
            for i, r in enumerate(records):
                if not r.success:
                    continue
                want, got = getattr(ref, fn)(r), getattr(api, fn)(r)
                if not _close(want, got):
                    raise Mismatch(f"trace {trace_name}, request {i}: {_show(r)}", f"  {fn}(request)",
                                   f"  expected  {want!r}", f"  got       {got!r}", "hint: " + hint)
    return Case(name, run)


def check_percentiles(name):
    grid = [([0.25, 0.5, 1.0], [0, 50, 90, 99, 100]), ([1.0, 2.0, 3.0, 4.0], [25, 50, 75, 10]),
            ([7.0], [0, 50, 99]), ([3.0, 1.0, 2.0], [50, 90]), ([0.1, 0.1, 0.5, 0.9, 0.9], [10, 33.3, 62.5]),
            ([float(x) for x in range(1, 101)], [99, 99.9, 1])]

    def run(api):
        for values, ps in grid:
            for p in ps:
                want, got = float(np.percentile(values, p)), api.percentile(list(values), p)
                if not _close(want, got):
                    raise Mismatch(f"percentile({values if len(values) < 8 else '[1.0, 2.0, ..., 100.0]'}, {p})",
                                   f"  expected  {want!r}", f"  got       {got!r}",
                                   "hint: sort, then take rank (n - 1) * p / 100 and interpolate linearly between "
                                   "the two values around it (numpy's default); nearest rank is another definition")
    return Case(name, run)


HAND, HAND_F = ("A-B-C", hand(), 4.0), ("A-B-C-failed", hand_with_failure(), 4.0)
TRACES = {"A-B-C": HAND[1:], "A-B-C-failed": HAND_F[1:], "recorded seed 1": recorded(1)}

CASES = [
    check_per_request("ttft_is_first_chunk_minus_start", "ttft", TRACES,
                      "TTFT = arrival of the first chunk that carried output - start"),
    check_per_request("e2el_is_end_minus_start", "e2el", TRACES,
                      "E2EL = end - start, the whole request as the client saw it"),
    check_per_request("itls_are_the_gaps_between_chunks", "itls", TRACES,
                      "ITL = the gaps between consecutive chunks; TTFT is not an inter-token gap, "
                      "and a chunk of several tokens is still one gap"),
    check_per_request("tpot_divides_by_output_tokens_minus_one", "tpot", TRACES,
                      "TPOT = (E2EL - TTFT) / (output_tokens - 1): the first token is TTFT's; "
                      "a request of one output token has no TPOT (None)"),
    check_percentiles("percentile_interpolates_linearly"),
    check_metrics("throughputs_divide_by_the_given_duration", *HAND),
    check_metrics("failed_requests_are_counted_and_left_out", *HAND_F),
    check_metrics("statistics_of_every_metric", *HAND_F, percentiles=(0, 50, 90, 99, 99.9, 100)),
    *[check_metrics(f"goodput_{'_'.join(slo)}_{'_'.join(map(str, slo.values()))}", *HAND_F, slos=slo,
                    goodput_hint="a request is good when its value <= the SLO (an SLO met exactly is met); "
                         "SLOs are in ms, a one-token request has TPOT 0 against the TPOT SLO")
      for slo in ({"ttft": 500}, {"tpot": 125}, {"e2el": 1500}, {"e2el": 1000})],
    *[check_metrics(f"goodput_slos_together_{i}", *HAND_F, slos=slo,
                    goodput_hint="a request is good only when every SLO given holds (value <= SLO)")
      for i, slo in enumerate(({"ttft": 500, "tpot": 125}, {"ttft": 1000, "tpot": 200, "e2el": 1500}))],
    check_metrics("goodput_with_an_empty_mapping_of_slos_is_none", *HAND_F, slos={},
                  goodput_hint="an empty mapping of SLOs, like None, gives no goodput (None): with no SLO given "
                               "there is nothing to meet, not every request good"),
    check_metrics("one_token_requests_have_no_tpot", "one-token", one_token_only(), 1.0, slos={"tpot": 0}),
    check_metrics("every_request_failed_gives_0", "all failed", all_failed(), 1.0, slos={"ttft": 500},
                  percentiles=(50, 99.9),
                  goodput_hint="with SLOs given goodput is a number: 0 good requests / duration is 0 when every "
                               "request failed"),
    check_metrics("percentiles_given_as_floats_and_fractions", *HAND_F, percentiles=(25.0, 99.0, 99.9, 12.5)),
    check_metrics("fractional_percentiles_of_a_recorded_trace", "recorded seed 4, 8 requests/s",
                  *recorded(4, rate=8.0), percentiles=(0.1, 33.3, 99.9)),
    *[check_metrics(f"recorded_trace_seed_{seed}", f"recorded seed {seed}, {rate:g} requests/s",
                    *recorded(seed, rate=rate),
                    slos={"ttft": 300, "tpot": 32, "e2el": 1500}, percentiles=(50, 90, 99))
      for seed, rate in ((1, 4.0), (2, 16.0), (3, 1.0))],
]

"""Cases of exercise 132: the learner's serving metrics against nano_engine.benchmarks.metrics.

The reference is `nano_engine.benchmarks.metrics` (vLLM's `calculate_metrics` from
`vllm/benchmarks/serve.py`, to the letter) and, for a single percentile, `numpy.percentile`, which
vLLM calls. Hand-made traces put values exactly on the boundaries (an SLO met with equality, a
one-token request, a failed one); recorded traces come from a seeded generator that plays what a
load generator sees: Poisson arrivals, a queueing and prefill delay, decode gaps with jitter,
chunks that carry two tokens, one-token answers and a failed request. Everything is deterministic.
The last cases draw inputs at random (hypothesis, seeded): lists and percentiles for `percentile`,
and whole traces with SLOs and percentiles for every function; the smallest input that differs is shown.
"""

import math
import random
from fractions import Fraction
from types import SimpleNamespace

import numpy as np

import nano_engine.benchmarks.metrics as ref
from nano_engine.benchmarks.metrics import RequestRecord as R
from practice.properties import check_property, st
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
    """A-B-C, and a request whose stream was cut after two chunks: failed, its gaps in no figure."""
    return hand() + [R(start=2.5, chunk_times=[2.75, 3.75], end=3.75, prompt_tokens=100, output_tokens=0,
                       success=False, error="the stream ended before data: [DONE]")]


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
    chunks = ", ".join(f"{c:g}" for c in r.chunk_times)
    if not r.success:
        got = f"chunks [{chunks}], " if chunks else ""
        return f"start {r.start:g}, {got}end {r.end:g}, prompt {r.prompt_tokens}, FAILED ({r.error})"
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
    ("itl", "pool the chunk gaps of all successful requests into one list (a long request weighs more; a failed "
            "one is left out, even when chunks came before it failed), then take statistics"),
    ("std", "std is the population std (numpy's default, ddof=0)"),
    ("_ms", "statistics are in milliseconds; percentiles interpolate linearly, as numpy.percentile"),
]


STD_OF_EQUAL_VALUES = ("std is the population std (numpy's default, ddof=0), and these values are equal up to "
                       "rounding: their std is 0; sqrt(mean(x²) - mean²) cancels to rounding noise there, "
                       "sqrt(mean((x - mean)²)) does not")


def _key_hint(key: str) -> str:
    return next((h for part, h in KEY_HINTS if part in key), "compare with the definitions in README.md")


def compare_metrics(api, trace, records, duration, slos=None, percentiles=(50, 90, 99), goodput_hint=None):
    """The learner's calculate_metrics(...) dict against the reference's, key by key.

    The hint names what the first key that differs measures; `goodput_hint` replaces it for goodput.
    """
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
                           "p99.9_e2el_ms, ...; a percentile's number is str(int(p)) when p is whole, else str(p)")
    for key, value in want.items():
        if not _close(value, got[key]):
            raise Mismatch(*head, f"  {key}", f"  expected  {value!r}", f"  got       {got[key]!r}",
                           "hint: " + (goodput_hint if goodput_hint and key == "request_goodput"
                                       else STD_OF_EQUAL_VALUES if key.startswith("std_") and abs(value) < 1e-6
                                       else _key_hint(key)))


def check_metrics(name, trace, records, duration, slos=None, percentiles=(50, 90, 99), goodput_hint=None):
    """A case: compare_metrics on one trace."""
    return Case(name, lambda api: compare_metrics(api, trace, records, duration, slos, percentiles, goodput_hint))


PER_REQUEST_HINTS = {
    "ttft": "TTFT = arrival of the first chunk that carried output - start",
    "e2el": "E2EL = end - start, the whole request as the client saw it",
    "itls": "ITL = the gaps between consecutive chunks; TTFT is not an inter-token gap, "
            "and a chunk of several tokens is still one gap",
    "tpot": "TPOT = (E2EL - TTFT) / (output_tokens - 1): the first token is TTFT's; "
            "a request of one output token has no TPOT (None)",
}


def compare_request(api, fn, trace_name, i, r):
    """The learner's fn(record) against the reference's, on one successful request."""
    want, got = getattr(ref, fn)(r), getattr(api, fn)(r)
    if not _close(want, got):
        raise Mismatch(f"trace {trace_name}, request {i}: {_show(r)}", f"  {fn}(request)",
                       f"  expected  {want!r}", f"  got       {got!r}", "hint: " + PER_REQUEST_HINTS[fn])


def check_per_request(name, fn, traces):
    """The learner's fn(record) against the reference's, on every successful request."""
    def run(api):
        for trace_name, (records, _) in traces.items():
            for i, r in enumerate(records):
                if r.success:
                    compare_request(api, fn, trace_name, i, r)
    return Case(name, run)


def compare_percentile(api, values, p, shown=None):
    given = list(values)
    want, got = float(np.percentile(values, p)), api.percentile(given, p)
    if given != list(values):
        raise Mismatch(f"percentile({values if shown is None else shown}, {p})",
                       f"  expected the list unchanged, {list(values)}", f"  got {given}",
                       "hint: sort a copy (sorted(values)), not the caller's list (values.sort()): calculate_metrics "
                       "and its callers still read theirs in the order it came")
    if not _close(want, got):
        raise Mismatch(f"percentile({values if shown is None else shown}, {p})",
                       f"  expected  {want!r}", f"  got       {got!r}",
                       "hint: sort, then take rank (n - 1) * p / 100 and interpolate linearly between "
                       "the two values around it (numpy's default); nearest rank is another definition")


def check_percentiles(name):
    grid = [([0.25, 0.5, 1.0], [0, 50, 90, 99, 100]), ([1.0, 2.0, 3.0, 4.0], [25, 50, 75, 10]),
            ([7.0], [0, 50, 99]), ([3.0, 1.0, 2.0], [50, 90]), ([0.1, 0.1, 0.5, 0.9, 0.9], [10, 33.3, 62.5]),
            ([float(x) for x in range(1, 101)], [99, 99.9, 1])]

    def run(api):
        for values, ps in grid:
            for p in ps:
                compare_percentile(api, values, p, None if len(values) < 8 else "[1.0, 2.0, ..., 100.0]")
    return Case(name, run)


# ----- random inputs -----

# A percentile: an int, the same as a float (99.0), or a fraction of one or two decimals (99.9, 12.5, 0.05).
PERCENTILE = st.one_of(st.integers(0, 100), st.integers(0, 100).map(float), st.integers(0, 1000).map(lambda k: k / 10),
                       st.integers(0, 10000).map(lambda k: k / 100))
PERCENTILES = st.lists(PERCENTILE, min_size=1, max_size=4, unique_by=float).map(tuple)


@st.composite
def values_and_percentile(draw):
    """A list for percentile: one value or several, unsorted, often with ties."""
    pool = draw(st.lists(st.integers(0, 3000).map(lambda k: k / 1000), min_size=1, max_size=4))
    values = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=10))
    return values, draw(PERCENTILE)


def _gap(unit: int) -> st.SearchStrategy:
    return st.integers(0, max(2, unit // 20))  # up to 50 ms between chunks, or 1/4 s on the clock of 1/8 s


def _steady(ticks: int, other: st.SearchStrategy) -> st.SearchStrategy:
    return st.integers(0, 3).flatmap(lambda k: other if k == 3 else st.just(ticks))  # ticks three times in four


@st.composite
def request(draw, unit: int, first: int, pace: int) -> R:
    """One request on a clock of 1/unit s. Its first chunk comes `first` ticks after its start and its chunks
    `pace` ticks apart, as a steady server gives (equal values, not equal in binary on a clock of 1 ms), or
    at other times; ties (a chunk at its start, two chunks at once, the end at the last chunk) come often;
    chunks may carry two tokens or more; one-token answers; a failure now and then."""
    start = draw(st.integers(0, 3 * unit))
    t = lambda k: k / unit  # noqa: E731
    prompt = draw(st.integers(0, 500))
    if draw(st.integers(0, 5)) == 5:  # failed, perhaps after some chunks (a stream cut short)
        cut = sorted(start + k for k in draw(st.lists(st.integers(0, unit), max_size=2)))
        return R(start=t(start), chunk_times=[t(c) for c in cut], end=t((cut or [start])[-1] + draw(st.integers(0, unit))),
                 prompt_tokens=prompt, output_tokens=0, success=False, error="Connection reset")
    tokens = draw(st.integers(1, 8))
    gaps = draw(st.lists(_steady(pace, _gap(unit)), max_size=tokens - 1))
    chunks = [start + draw(_steady(first, st.integers(0, unit)))]
    for gap in gaps:
        chunks.append(chunks[-1] + gap)
    end = chunks[-1] + draw(st.one_of(st.just(0), st.integers(0, max(1, unit // 100))))
    return R(start=t(start), chunk_times=[t(c) for c in chunks], end=t(end), prompt_tokens=prompt,
             output_tokens=tokens)


def _exact_ms(seconds: float) -> bool:
    """seconds * 1000 and back are exact: an SLO placed on such a value is met by v <= slo / 1000 and by
    v * 1000 <= slo alike (the comparison does not hang on a rounding)."""
    return Fraction(seconds * 1000) == Fraction(seconds) * 1000 and (seconds * 1000) / 1000 == seconds


@st.composite
def trace(draw):
    """(records, duration, slos, percentiles). On a clock of 1/8 s every time, TTFT and E2EL are exact in
    binary, so SLOs are drawn right on a request's value (met with equality) or on a 62.5 ms grid; on a
    clock of 1 ms (as recorded) an SLO is never within a microsecond of a value, where rounding would decide."""
    unit = draw(st.sampled_from([8, 1000]))
    first, pace = draw(st.integers(0, unit)), draw(_gap(unit))
    records = draw(st.lists(request(unit, first, pace), min_size=1, max_size=6))
    duration = (round(max(r.end for r in records) * unit) + draw(st.integers(1, unit))) / unit
    done = [r for r in records if r.success]
    values = {name: [v(r) for r in done] for name, v in
              (("ttft", ref.ttft), ("tpot", lambda r: ref.tpot(r) or 0.0), ("e2el", ref.e2el))}
    kind = draw(st.sampled_from(["none", "empty", "slos", "slos", "slos"]))
    if kind != "slos":
        return records, duration, None if kind == "none" else {}, draw(PERCENTILES)
    slos = {}
    for name in draw(st.lists(st.sampled_from(["ttft", "tpot", "e2el"]), min_size=1, max_size=3, unique=True)):
        if unit == 8:
            on_value = [v * 1000 for v in values[name] if _exact_ms(v)]
            slo = draw(st.sampled_from(on_value) if on_value and draw(st.booleans()) else
                       st.integers(0, 40).map(lambda k: k * 62.5))
        else:
            slo = draw(st.integers(0, 2000)) + 0.5
            if any(abs(v * 1000 - slo) < 1e-3 for v in values[name]):
                slo += 0.2  # a TPOT of x.5 ms (an even number of gaps): move off it
        slos[name] = slo
    return records, duration, slos, draw(PERCENTILES)


def _random_percentiles(api):
    check_property(values_and_percentile(), lambda vp: compare_percentile(api, *vp), examples=PERCENTILE_EXAMPLES)


def _random_traces(api):
    def check(drawn):
        records, duration, slos, percentiles = drawn
        for i, r in enumerate(records):
            if r.success:
                for fn in ("ttft", "e2el", "itls", "tpot"):
                    compare_request(api, fn, "random", i, r)
        compare_metrics(api, "random", records, duration, slos, percentiles)
    check_property(trace(), check, examples=TRACE_EXAMPLES)


PERCENTILE_EXAMPLES, TRACE_EXAMPLES = 200, 150  # about 0.5 s and 1 s of CPU for the reference


HAND, HAND_F = ("A-B-C", hand(), 4.0), ("A-B-C-failed", hand_with_failure(), 4.0)
TRACES = {"A-B-C": HAND[1:], "A-B-C-failed": HAND_F[1:], "recorded seed 1": recorded(1)}

CASES = [
    check_per_request("ttft_is_first_chunk_minus_start", "ttft", TRACES),
    check_per_request("e2el_is_end_minus_start", "e2el", TRACES),
    check_per_request("itls_are_the_gaps_between_chunks", "itls", TRACES),
    check_per_request("tpot_divides_by_output_tokens_minus_one", "tpot", TRACES),
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
    Case("random_percentiles", _random_percentiles),
    Case("random_traces", _random_traces),
]

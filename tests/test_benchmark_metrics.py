"""benchmarks/metrics.py: vLLM's serving metrics on hand-made timestamp traces.

Every expected figure is worked out by hand in this file (sorted lists, linear interpolation, the
population std written out), never by calling the module under test.
"""

import math

import numpy as np
import pytest

from nano_engine.benchmarks.metrics import RequestRecord, calculate_metrics, format_metrics, parse_goodput

approx = pytest.approx


def trace() -> list[RequestRecord]:
    """Four requests over a 4 s benchmark; times are binary fractions so every boundary is exact.

    A: 4 tokens, one per chunk: TTFT 0.5, ITL 0.25 0.25 0.5, E2EL 1.5, TPOT (1.5 - 0.5) / 3 = 1/3
    B: 1 token: TTFT 0.25, no ITL, no TPOT (TPOT 0 against an SLO); its stream closed 0.25 s after
       its only chunk (a usage chunk, say), so E2EL = end - start = 0.5, not last chunk - start
    C: 5 tokens in 2 chunks: TTFT 1.0, ITL 0.5 (one gap per chunk, not per token), E2EL 1.5,
       TPOT (1.5 - 1.0) / 4 = 0.125
    D: failed: counted, and left out of every other figure (its 100 prompt tokens too)
    """
    return [
        RequestRecord(start=0.0, chunk_times=[0.5, 0.75, 1.0, 1.5], end=1.5, prompt_tokens=10, output_tokens=4),
        RequestRecord(start=1.0, chunk_times=[1.25], end=1.5, prompt_tokens=6, output_tokens=1),
        RequestRecord(start=2.0, chunk_times=[3.0, 3.5], end=3.5, prompt_tokens=4, output_tokens=5),
        RequestRecord(start=2.5, chunk_times=[], end=2.625, prompt_tokens=100, output_tokens=0,
                      success=False, error="HTTP 500"),
    ]


def test_counts_and_throughputs_leave_the_failed_request_out():
    m = calculate_metrics(trace(), duration=4.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (10 + 6 + 4, 4 + 1 + 5)
    assert m.duration == 4.0
    assert m.request_throughput == approx(3 / 4)
    assert m.output_throughput == approx(10 / 4)
    assert m.total_token_throughput == approx(30 / 4)
    assert m.goodput is None  # no SLO given


def test_ttft_statistics_and_linear_percentiles():
    m = calculate_metrics(trace(), duration=4.0, percentiles=(0, 50, 90, 99, 100))
    # TTFTs 0.25 0.5 1.0 (sorted); mean 7/12; deviations -4/12, -1/12, 5/12.
    assert m.ttft.mean_ms == approx(7 / 12 * 1000)
    assert m.ttft.median_ms == approx(500)
    assert m.ttft.std_ms == approx(math.sqrt((16 + 1 + 25) / 144 / 3) * 1000)  # population std
    # Linear: rank (n - 1) * p / 100 = 2p/100. p90 -> 1.8 -> 0.5 + 0.8 * 0.5; nearest rank would say 1000.
    assert m.ttft.percentiles_ms == approx({0: 250, 50: 500, 90: 900, 99: 990, 100: 1000})


def test_itls_are_pooled_over_all_requests_and_exclude_ttft():
    m = calculate_metrics(trace(), duration=4.0)
    # All gaps of all requests: 0.25 0.25 0.5 (A) and 0.5 (C). Averaging per request first would
    # give (1/3 + 1/2) / 2 = 0.4167, and counting TTFTs as gaps would add 0.5 0.25 1.0.
    assert m.itl.mean_ms == approx(375)
    assert m.itl.median_ms == approx(375)
    assert m.itl.std_ms == approx(125)
    # Sorted 0.25 0.25 0.5 0.5: p50 rank 1.5 -> 0.375, p90 rank 2.7 -> 0.5, p99 rank 2.97 -> 0.5.
    assert m.itl.percentiles_ms == approx({50: 375, 90: 500, 99: 500})


def test_tpot_skips_one_token_requests_and_divides_by_tokens_minus_one():
    m = calculate_metrics(trace(), duration=4.0)
    a, c = 1 / 3, 0.125  # B (one token) has no TPOT; dividing by 4 and 5 tokens would give 0.25, 0.1
    assert m.tpot.mean_ms == approx((a + c) / 2 * 1000)
    assert m.tpot.median_ms == approx((a + c) / 2 * 1000)
    assert m.tpot.std_ms == approx((a - c) / 2 * 1000)
    assert m.tpot.percentiles_ms[90] == approx((c + 0.9 * (a - c)) * 1000)  # rank 0.9 between c and a


def test_e2el_is_end_minus_start():
    m = calculate_metrics(trace(), duration=4.0)
    mean = (1.5 + 0.5 + 1.5) / 3  # B's 0.5 runs to its end, past its last chunk at 0.25
    assert m.e2el.mean_ms == approx(mean * 1000)
    assert m.e2el.median_ms == approx(1500)
    assert m.e2el.std_ms == approx(math.sqrt((2 * (1.5 - mean) ** 2 + (0.5 - mean) ** 2) / 3) * 1000)
    # Sorted 0.5 1.5 1.5: p50 -> 1.5, p90 rank 1.8 -> 1.5.
    assert m.e2el.percentiles_ms == approx({50: 1500, 90: 1500, 99: 1500})


@pytest.mark.parametrize("slos, good", [
    # TTFTs A 0.5, B 0.25, C 1.0: A sits exactly on the SLO and is good (<=, not <).
    ({"ttft": 500}, 2),
    ({"ttft": 499}, 1),
    # TPOTs A 1/3, B none (counts as 0), C 0.125 exactly on the SLO.
    ({"tpot": 125}, 2),
    ({"tpot": 124}, 1),
    # E2ELs A 1.5, B 0.5, C 1.5.
    ({"e2el": 1500}, 3),
    ({"e2el": 1499}, 1),
    # Together a request is good only when every SLO holds.
    ({"ttft": 500, "tpot": 125}, 1),     # A fails TPOT, C fails TTFT
    ({"ttft": 1000, "tpot": 400, "e2el": 1500}, 3),
    ({"e2el": 10_000}, 3),  # D failed fast (0.125 s): a failed request is never good
])
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    m = calculate_metrics(trace(), duration=4.0, goodput_slos=slos)
    assert m.goodput == approx(good / 4)


def test_only_one_token_requests_give_zero_tpot_and_itl():
    recs = [RequestRecord(start=0.0, chunk_times=[0.25], end=0.25, prompt_tokens=3, output_tokens=1),
            RequestRecord(start=0.5, chunk_times=[1.0], end=1.0, prompt_tokens=3, output_tokens=1)]
    m = calculate_metrics(recs, duration=1.0, goodput_slos={"tpot": 0})
    # vLLM reads an empty list as 0 (np.mean(x or 0)); the TPOT SLO of 0 ms holds for both.
    assert (m.tpot.mean_ms, m.tpot.median_ms, m.tpot.std_ms) == (0, 0, 0)
    assert m.tpot.percentiles_ms == {50: 0, 90: 0, 99: 0}
    assert m.itl.mean_ms == 0 and m.itl.percentiles_ms[99] == 0
    assert m.goodput == approx(2.0)


def test_all_failed_gives_zeros_not_an_error():
    recs = [RequestRecord(start=0.0, chunk_times=[], end=1.0, prompt_tokens=5, output_tokens=0, success=False)]
    m = calculate_metrics(recs, duration=2.0, goodput_slos={"ttft": 100})
    assert (m.completed, m.failed, m.total_input, m.request_throughput, m.goodput) == (0, 1, 0, 0, 0)
    assert m.e2el.mean_ms == 0


def test_to_dict_uses_vllms_result_keys_and_carries_every_statistic():
    m = calculate_metrics(trace(), 4.0, goodput_slos={"ttft": 500}, percentiles=(50, 99, 99.9))
    want = dict(duration=4.0, completed=3, failed=1, total_input_tokens=20, total_output_tokens=10,
                request_throughput=0.75, request_goodput=0.5, output_throughput=2.5, total_token_throughput=7.5)
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = getattr(m, name)  # p99.9: a float percentile keeps its name
        want |= {f"mean_{name}_ms": s.mean_ms, f"median_{name}_ms": s.median_ms, f"std_{name}_ms": s.std_ms,
                 **{f"p{p:g}_{name}_ms": v for p, v in s.percentiles_ms.items()}}
    assert m.to_dict() == want and want["p99.9_ttft_ms"] == approx((0.5 + 0.998 * 0.5) * 1000)  # rank 1.998
    assert calculate_metrics(trace(), 4.0).to_dict()["request_goodput"] is None


def test_format_metrics_prints_vllms_table():
    # Figures from the hand-worked ones above (TTFT mean 7/12 s, TPOT p90 1/8 + 0.9 * (1/3 - 1/8) s),
    # labelled, padded and ruled as vLLM prints them.
    lines = format_metrics(calculate_metrics(trace(), 4.0, goodput_slos={"ttft": 500})).splitlines()
    assert lines[0] == "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=") and lines[-1] == "=" * 50
    for label, value in [("Successful requests:", "3"), ("Failed requests:", "1"), ("Request goodput (req/s):", "0.50"),
                         ("Output token throughput (tok/s):", "2.50"), ("Mean TTFT (ms):", "583.33"),
                         ("P90 TPOT (ms):", "312.50"), ("P99 ITL (ms):", "500.00"), ("Mean E2EL (ms):", "1166.67")]:
        assert f"{label:<40} {value}" in lines
    for section in ("Time to First Token", "Time per Output Token (excl. 1st token)", "Inter-token Latency",
                    "End-to-end Latency"):
        assert "{s:{c}^{n}}".format(s=section, n=50, c="-") in lines
    without = format_metrics(calculate_metrics(trace(), 4.0)).splitlines()  # no SLO: no goodput line, nothing else
    assert without == [line for line in lines if "goodput" not in line]


def test_parse_goodput():
    assert parse_goodput("ttft:500 tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(("tpot:0", "e2el:1.5")) == {"tpot": 0.0, "e2el": 1.5}
    assert parse_goodput("") == {}


@pytest.mark.parametrize("spec, error, named", [
    ("ttft=500", ValueError, "'ttft=500'"), ("ttft:fast", ValueError, "ttft:fast"), (["ttft:5", 3], ValueError, "3"),
    ("itl:50", ValueError, "'itl'"), ("ttft:-1", ValueError, "ttft.*-1"), (5, TypeError, "goodput"),
])
def test_parse_goodput_names_the_bad_part(spec, error, named):
    with pytest.raises(error, match=named):
        parse_goodput(spec)


BASE = dict(start=0.0, chunk_times=[0.5], end=1.0, prompt_tokens=1, output_tokens=1)


@pytest.mark.parametrize("kwargs, error, field", [
    (dict(start=float("nan")), ValueError, "start.*nan"),
    (dict(start=True), ValueError, "start.*True"),
    (dict(end=-1.0, chunk_times=[], success=False), ValueError, "end must be >= start"),
    (dict(chunk_times="0.5"), TypeError, "chunk_times"),
    (dict(chunk_times=[0.5, float("nan")]), ValueError, r"chunk_times\[1\]"),
    (dict(chunk_times=[-0.5]), ValueError, "chunk_times.*start"),               # before start
    (dict(chunk_times=[0.5, 0.75, 0.25]), ValueError, r"chunk_times\[2\]"),    # unsorted
    (dict(chunk_times=[0.5, 0.75, 2.0]), ValueError, "chunk_times.*end"),      # after end
    (dict(prompt_tokens=-1), ValueError, "prompt_tokens"),
    (dict(success=1), TypeError, "success"),
    (dict(chunk_times=[]), ValueError, "chunk time"),  # a success without a first chunk has no TTFT
])
def test_a_record_refuses_impossible_values_naming_the_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        RequestRecord(**{**BASE, **kwargs})


@pytest.mark.parametrize("kwargs, error, named", [
    (dict(duration=0), ValueError, "duration"), (dict(duration=True), ValueError, "duration"),
    (dict(duration=4.0, percentiles=(50, 100.5)), ValueError, "percentiles.*100.5"),
    (dict(duration=4.0, goodput_slos=[("ttft", 5)]), TypeError, "goodput_slos"),
    (dict(duration=4.0, goodput_slos={"ttft": True}), ValueError, "ttft"),
    (dict(duration=4.0, goodput_slos={"itl": 50}), ValueError, "'itl'"),
])
def test_calculate_metrics_refuses_bad_arguments_naming_them(kwargs, error, named):
    with pytest.raises(error, match=named):
        calculate_metrics(trace(), **kwargs)


def test_calculate_metrics_names_the_record_that_is_wrong():
    with pytest.raises(TypeError, match=r"records\[1\]"):
        calculate_metrics([trace()[0], {"start": 0}], 4.0)
    recs = trace()
    recs[2].chunk_times = [3.5, 3.0]  # edited after construction: checked again, with its index
    with pytest.raises(ValueError, match=r"records\[2\]\.chunk_times"):
        calculate_metrics(recs, 4.0)


def test_a_record_takes_edge_values_and_numpy_numbers():
    # Every bound is inclusive: chunks at start and at end, equal chunk times, zero tokens.
    RequestRecord(start=1.0, chunk_times=[1.0, 1.0, 2.0], end=2.0, prompt_tokens=0, output_tokens=0)
    RequestRecord(start=1.0, chunk_times=[], end=1.0, prompt_tokens=0, output_tokens=0, success=False)
    # numpy scalars are numbers (a client that timestamps with numpy is not refused); a tuple of times too.
    r = RequestRecord(start=np.float64(0.0), chunk_times=(np.float32(0.5), np.int64(1)), end=np.int64(1),
                      prompt_tokens=np.int64(3), output_tokens=np.int32(2))
    assert calculate_metrics([r], duration=np.float64(2.0)).total_input == 3


def test_a_two_token_request_has_a_tpot():
    # The smallest request with a TPOT: its one gap after the first token, over 2 - 1 tokens.
    r = RequestRecord(start=0.0, chunk_times=[0.25, 1.0], end=1.0, prompt_tokens=1, output_tokens=2)
    assert calculate_metrics([r], 1.0).tpot.mean_ms == approx(750)


"""nano_engine's scheduler against recorded decisions of vLLM's own scheduler, step by step, without vLLM.

Each file in tests/data/vllm_traces/ holds a seeded scenario and, per step, what vLLM 0.32's
`vllm.v1.core.sched.scheduler.Scheduler` did with it: which request got how many tokens from which
position (for a request just admitted, its prefix-cache hit) and whom it preempted, in order. They
were recorded by `.venv-vllm/bin/python bench/vllm_parity.py --record`; the suite needs no vLLM.

Where vLLM decides differently on purpose (a rule ours does not have), the trace documents our
steps there and the cause ("nano_engine_differs"): the test asserts exactly those steps, and that
with that one vLLM rule put into ours (bench/parity_rules.py) we make vLLM's decision at every step.
"""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from parity_rules import CAUSES, run_with  # noqa: E402
from parity_scenarios import features, run_nano, step_key  # noqa: E402

TRACES = sorted((Path(__file__).parent / "data" / "vllm_traces").glob("*.json"))
DIFFERING = [p for p in TRACES if "nano_engine_differs" in json.loads(p.read_text())]


def assert_same_steps(ours: list[dict], expected: list[dict], what: str) -> None:
    for i in range(max(len(ours), len(expected))):
        o = ours[i] if i < len(ours) else "(done)"
        e = expected[i] if i < len(expected) else "(done)"
        assert isinstance(o, dict) and isinstance(e, dict) and step_key(o) == step_key(e), (
            f"{what}, step {i}:\n  expected: {e}\n  ours:     {o}")


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_same_decisions_as_vllm_at_every_step(path):
    rec = json.loads(path.read_text())
    expected = rec["steps"]
    differs = rec.get("nano_engine_differs")
    if differs:  # vLLM's steps, except where the trace documents ours
        ours_there = {int(i): st for i, st in differs["steps"].items()}
        assert ours_there, "a documented difference lists the steps where ours differs"
        expected = [ours_there.get(i) or expected[i] for i in range(differs["num_steps"])]
    assert_same_steps(run_nano(rec["scenario"]), expected,
                      f"{path.stem} ({rec['about']}; {'documented: ' + differs['cause'] if differs else 'as vLLM'})")


@pytest.mark.parametrize("path", DIFFERING, ids=lambda p: p.stem)
def test_the_documented_vllm_rule_explains_the_whole_difference(path):
    rec = json.loads(path.read_text())
    causes = rec["nano_engine_differs"]["cause"].split(" + ")
    assert set(causes) <= set(CAUSES)
    assert_same_steps(run_with(rec["scenario"], causes), rec["steps"], f"{path.stem} with vLLM's {causes}")


def test_the_traces_cover_chunking_preemption_prefix_hits_and_priority():
    seen, settings = set(), set()
    for path in TRACES:
        rec = json.loads(path.read_text())
        sc = rec["scenario"]
        seen |= features(rec["steps"], sc)
        settings |= {sc["policy"], f"chunked={sc['enable_chunked_prefill']}", f"caching={sc['enable_prefix_caching']}"}
    assert 4 <= len(TRACES) <= 8
    assert {"chunking", "preemption", "prefix_hit"} <= seen
    assert {"fcfs", "priority", "chunked=True", "chunked=False", "caching=True", "caching=False"} <= settings
    assert {json.loads(p.read_text())["nano_engine_differs"]["cause"] for p in DIFFERING} == {
        "cache timing", "stop pass"}

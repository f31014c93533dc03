"""A long life in bounded memory (a short one here; bench/long_life.py runs 100,000 steps): the
step log keeps its last step_log_size records, released requests leave the engine, nothing leaks."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

from long_life import serve  # noqa: E402

from nano_engine import LLMEngine, SamplingParams  # noqa: E402
from nano_engine.tiny import tiny_model  # noqa: E402


def test_a_long_run_stays_bounded():
    engine = LLMEngine(tiny_model(seed=1, num_layers=1), num_blocks=24, block_size=4, max_num_batched_tokens=32,
                       max_num_seqs=4, step_log_size=50)
    sizes = []
    counts = serve(engine, num_requests=300, num_steps=1500, seed=2,
                   report=lambda step, eng: sizes.append((len(eng.step_log), len(eng.requests))))
    assert counts["added"] == 300 == counts["finished"] + counts["aborted"] and counts["aborted"] >= 5
    assert engine.stats.num_finished == counts["finished"] and engine.stats.preemptions > 0
    assert all(n <= 50 for n, _ in sizes) and sizes[-1][0] == 50
    assert all(r <= counts["max_live"] for _, r in sizes) and not engine.requests
    assert engine.stats.steps == 1500 and engine.step_log[-1].step < 1450  # the idle steps at the end: no record
    assert engine.block_pool.num_free == 24 and not engine.has_unfinished()
    engine.block_pool.check()


def test_generate_releases_and_the_log_can_be_off(tiny):
    engine = LLMEngine(tiny, step_log_size=0)
    for _ in range(3):
        done = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert [r.finish_reason for r in done] == ["length"] * 2 and not engine.requests
    assert not engine.requests and not engine.step_log and engine.stats.num_finished == 6
    # A record holds this step's events and counts only, not copies of the queues.
    engine = LLMEngine(tiny, max_num_seqs=1)
    for i in range(30):
        engine.add_request([1 + i % 60], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    engine.step()
    rec = engine.step_log[-1]
    assert (rec.num_waiting, rec.added, rec.scheduled) == (29, [], [("0", 1, "decode")]) and len(repr(rec)) < 400

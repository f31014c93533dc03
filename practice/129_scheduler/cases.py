"""Cases of exercise 129: the learner's Scheduler against nano_engine's, decision by decision.

Scripted scenarios first (who gets how many tokens at each step, whom a step preempts, when
admission stops, each request's state), then 300 random scenarios over every setting the engine
accepts (practice/randomized.py), then end-to-end runs of the real engine on a tiny model, whose outputs must
equal single-request generation. Prefix caching is off everywhere: it is the next chapter's job.
"""

import random

import nano_engine.scheduler as ref
from practice.endtoend import check_end_to_end
from practice.randomized import check_random
from practice.scenarios import Arrival as A
from practice.scenarios import Scenario, check_scenario
from practice.worker import Case, Mismatch

REFERENCE_FILE = ref.__file__


def learner(module):
    cls = getattr(module, "Scheduler", None)
    if not (isinstance(cls, type) and issubclass(cls, ref.Scheduler)):
        raise Mismatch("your file must define class Scheduler, a subclass of nano_engine.scheduler.Scheduler")
    return cls


def reference():
    return ref.Scheduler


def scripted(name, **scenario):
    sc = Scenario(**scenario)
    return Case(name, lambda cls: check_scenario(cls, ref.Scheduler, sc))


def randomized(name, seed, **kinds):
    return Case(name, lambda cls: check_random(cls, ref.Scheduler, seed, 100, **kinds))


def end_to_end(name, settings, workload, **kw):
    settings = {"enable_prefix_caching": False, **settings}
    return Case(name, lambda cls: check_end_to_end(cls, ref.Scheduler, settings, workload, **kw))


def _mixed():
    """A longer run: arrivals over time, a small budget, a tight pool and few sequences."""
    rng = random.Random(129)
    reqs = [A(f"q{i}", rng.randint(1, 14), rng.randint(1, 6), step=rng.randint(0, 12)) for i in range(12)]
    return sorted(reqs, key=lambda a: a.step)


SIX = [(5, 8, 0), (17, 6, 0), (30, 10, 0), (9, 12, 0), (1, 7, 0), (22, 9, 0)]  # (prompt, max_tokens, priority)

CASES = [
    scripted("one_request_prefill_then_decode",
             arrivals=[A("a", 5, max_tokens=3)], settings=dict(max_num_batched_tokens=16)),
    scripted("budget_shared_by_one_step",
             arrivals=[A("a", 6, 3), A("b", 7, 3), A("c", 3, 3)], settings=dict(max_num_batched_tokens=10)),
    scripted("running_requests_first",
             arrivals=[A("a", 4, 6), A("b", 9, 2, step=2), A("c", 5, 2, step=2)],
             settings=dict(max_num_batched_tokens=6)),
    scripted("long_prompt_chunked_over_steps",
             arrivals=[A("a", 20, 3), A("b", 3, 2, step=1)], settings=dict(max_num_batched_tokens=8)),
    scripted("running_pass_respects_the_budget",
             arrivals=[A("a", 6, 4), A("b", 6, 4)], settings=dict(max_num_batched_tokens=4)),
    scripted("one_token_prompt_chunk_is_a_prefill",
             arrivals=[A("a", 6, 2)], settings=dict(max_num_batched_tokens=5)),
    scripted("without_chunking_a_prompt_waits_whole",
             arrivals=[A("a", 6, 3), A("b", 12, 2), A("c", 2, 2)],
             settings=dict(max_num_batched_tokens=14, enable_chunked_prefill=False)),
    scripted("max_num_seqs_caps_the_running_queue",
             arrivals=[A("a", 3, 3), A("b", 3, 4), A("c", 3, 2)],
             settings=dict(max_num_batched_tokens=100, max_num_seqs=2)),
    scripted("admission_stops_at_a_request_whose_blocks_cannot_be_had",
             arrivals=[A("a", 8, 6), A("b", 9, 2, step=1), A("c", 2, 1, step=1)],
             num_blocks=4, settings=dict(max_num_batched_tokens=32)),
    scripted("preempt_the_tail",
             arrivals=[A("a", 8, 6), A("b", 3, 3), A("c", 1, 3)],
             num_blocks=4, settings=dict(max_num_batched_tokens=32)),
    scripted("no_admission_in_a_step_that_preempted",
             arrivals=[A("a", 4, 6), A("b", 2, 6), A("c", 4, 4, step=1), A("d", 2, 2, step=2)],
             num_blocks=4, settings=dict(max_num_batched_tokens=6)),
    scripted("victim_is_the_request_being_scheduled",
             arrivals=[A("a", 3, 2), A("b", 8, 2)], num_blocks=3, settings=dict(max_num_batched_tokens=32)),
    scripted("recompute_after_preemption",
             arrivals=[A("a", 8, 5), A("b", 3, 4), A("c", 2, 4)],
             num_blocks=4, settings=dict(max_num_batched_tokens=8)),
    scripted("mixed_workload_tight_pool", arrivals=_mixed(), num_blocks=8,
             settings=dict(max_num_batched_tokens=10, max_num_seqs=4)),
    randomized("random_scenarios_chunked_prefill", 1291, chunked=True),
    randomized("random_scenarios_without_chunking", 1292, chunked=False),
    randomized("random_scenarios_tightest_pool", 1293, tight=True),
    end_to_end("end_to_end_defaults", {}, SIX),
    end_to_end("end_to_end_small_budget_chunks", {"max_num_batched_tokens": 8}, SIX, seed=1),
    end_to_end("end_to_end_tight_pool_preempts", {"max_num_batched_tokens": 16, "num_blocks": 12, "block_size": 4},
               [(n, m, 0) for n, m in [(5, 10), (17, 12), (14, 10), (9, 12), (3, 11), (12, 9)]], seed=2,
               expect_preemption=True),
    end_to_end("end_to_end_without_chunking", {"max_num_batched_tokens": 48, "enable_chunked_prefill": False},
               SIX, seed=3),
]

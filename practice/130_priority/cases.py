"""Cases of exercise 130: the learner's priority policy inside nano_engine's scheduler.

Every scenario runs nano_engine's schedule() twice, once with the learner's priority_key,
next_waiting and select_victim, once with the reference policy (policy="priority"), and compares
the decisions step by step: who gets how many tokens, who is preempted, the running queue, which
requests wait (not in which order: the policy picks from the waiting queue by key, so a solution
that keeps it sorted decides the same), each request's state. Scripted scenarios exercise every
part of the key (ties in priority, then in arrival_time, then seq), 200 random ones every setting;
the end-to-end runs check outputs against single-request generation.
"""

import random

import nano_engine.policies as policies
import nano_engine.scheduler as ref
from practice.endtoend import check_end_to_end
from practice.randomized import check_random
from practice.scenarios import Arrival as A
from practice.scenarios import Scenario, check_scenario
from practice.worker import Case, Mismatch

REFERENCE_FILE = policies.__file__


def learner(module):
    cls = getattr(module, "PriorityScheduler", None)
    if not (isinstance(cls, type) and issubclass(cls, ref.Scheduler)):
        raise Mismatch("your file must define class PriorityScheduler, a subclass of nano_engine.scheduler.Scheduler")
    return cls


def reference():
    return policies.PriorityScheduler


def scripted(name, aging=0.0, **scenario):
    scenario["settings"] = {"policy": "priority", "priority_aging": aging, **scenario.get("settings", {})}
    sc = Scenario(**scenario)
    return Case(name, lambda cls: check_scenario(cls, policies.PriorityScheduler, sc))


def randomized(name, seed, **kinds):
    return Case(name, lambda cls: check_random(cls, policies.PriorityScheduler, seed, 100, priority=True, **kinds))


def end_to_end(name, settings, workload, **kw):
    settings = {"enable_prefix_caching": False, "policy": "priority", **settings}
    return Case(name, lambda cls: check_end_to_end(cls, policies.PriorityScheduler, settings, workload, **kw))


def _stream():
    """An old, less urgent request, and an urgent newcomer at every step."""
    return [A("old", 4, 1, priority=3)] + [A(f"new{t}", 4, 1, step=t, priority=0) for t in range(7)]


def _mixed(seed, n=12):
    rng = random.Random(seed)
    reqs = [A(f"q{i}", rng.randint(1, 12), rng.randint(1, 6), step=rng.randint(0, 10), priority=rng.randint(0, 3))
            for i in range(n)]
    return sorted(reqs, key=lambda a: a.step)


CASES = [
    scripted("waiting_served_by_priority",
             arrivals=[A("low", 4, 2, priority=5), A("high", 4, 2, priority=0), A("mid", 4, 2, priority=1)],
             settings=dict(max_num_batched_tokens=4)),
    scripted("ties_go_to_the_earlier_arrival",
             arrivals=[A("a", 3, 2, priority=1), A("b", 3, 2, priority=1), A("c", 3, 2, step=1, priority=0),
                       A("d", 3, 2, step=1, priority=1)],
             settings=dict(max_num_batched_tokens=3)),
    scripted("ties_go_to_the_earlier_arrival_time_not_the_first_added",
             arrivals=[A("a", 3, 2, priority=1, arrival_time=2.0), A("b", 3, 2, priority=1, arrival_time=1.0),
                       A("c", 3, 2, priority=1, arrival_time=1.5)],
             settings=dict(max_num_batched_tokens=3)),
    scripted("urgent_request_jumps_the_queue",
             arrivals=[A("a", 4, 3, priority=2), A("b", 4, 3, priority=2), A("c", 4, 3, priority=2),
                       A("urgent", 2, 3, step=1, priority=0)],
             settings=dict(max_num_batched_tokens=6, max_num_seqs=2)),
    scripted("victim_is_the_least_urgent_not_the_tail",
             arrivals=[A("low", 4, 8, priority=5), A("urgent", 3, 8, step=1, priority=0)],
             num_blocks=3, settings=dict(max_num_batched_tokens=16)),
    scripted("victim_among_equals_is_the_latest_arrival",
             arrivals=[A("a", 4, 6, priority=2), A("b", 3, 6, priority=2), A("c", 1, 6, priority=2)],
             num_blocks=4, settings=dict(max_num_batched_tokens=32)),
    scripted("victim_among_equal_priorities_is_the_latest_arrival_time",
             arrivals=[A("a", 4, 6, priority=2, arrival_time=9.0), A("b", 3, 6, priority=2, arrival_time=1.0),
                       A("c", 1, 6, priority=2, arrival_time=2.0)],
             num_blocks=4, settings=dict(max_num_batched_tokens=32)),
    scripted("victim_among_equal_priority_and_arrival_time_is_the_last_added",
             arrivals=[A("a", 4, 6, priority=2, arrival_time=5.0), A("b", 3, 6, priority=2, arrival_time=5.0),
                       A("c", 1, 6, priority=2, arrival_time=5.0)],
             num_blocks=4, settings=dict(max_num_batched_tokens=32)),
    scripted("aging_lets_an_old_request_through", aging=1.0, arrivals=_stream(),
             settings=dict(max_num_batched_tokens=4, max_num_seqs=1)),
    scripted("aging_by_fractions", aging=0.5, arrivals=_stream(),
             settings=dict(max_num_batched_tokens=4, max_num_seqs=1)),
    scripted("aging_applies_to_victims_too", aging=1.0,
             arrivals=[A("old", 4, 10, priority=3), A("newer", 3, 10, step=4, priority=1)],
             num_blocks=4, settings=dict(max_num_batched_tokens=16)),
    scripted("mixed_priorities_tight_pool", arrivals=_mixed(130), num_blocks=7,
             settings=dict(max_num_batched_tokens=10, max_num_seqs=4)),
    scripted("mixed_priorities_with_aging", aging=0.5, arrivals=_mixed(131), num_blocks=7,
             settings=dict(max_num_batched_tokens=8, max_num_seqs=3)),
    randomized("random_priorities", 1301),
    randomized("random_priorities_with_aging", 1302, aging=True),
    end_to_end("end_to_end_priorities_tight_pool", {"max_num_batched_tokens": 16, "num_blocks": 12, "block_size": 4},
               [(5, 10, 2), (17, 12, 0), (14, 10, 1), (9, 12, 3), (3, 11, 0), (12, 9, 2)], seed=4,
               expect_preemption=True),
    end_to_end("end_to_end_priorities_with_aging",
               {"max_num_batched_tokens": 8, "num_blocks": 10, "block_size": 4, "priority_aging": 0.5},
               [(5, 10, 2), (17, 12, 0), (14, 10, 1), (9, 12, 3), (3, 11, 0), (12, 9, 2)], seed=5),
]

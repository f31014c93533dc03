"""Exercise 130: priority scheduling, then aging. Edit this file, then run

    python practice/judge.py 130

Implement the three methods below; the statement is in README.md. The rest of the scheduler
(schedule(), the block allocation, preemption itself) is nano_engine's: its schedule() asks
`next_waiting()` which waiting request to admit next and `select_victim()` whom to preempt when
blocks run out. The cases run this class with SchedulerConfig(policy="priority",
priority_aging=...), so `self.config.priority_aging` is the aging rate.

`self.steps_waited(req)` (given) counts the steps since a request was added; a preemption does
not reset it. A request has `priority` (an int, smaller is more urgent, as in vLLM), `arrival_time` (a float)
and `seq` (its arrival order, which breaks ties in arrival_time).
"""

from nano_engine.request import Request
from nano_engine.scheduler import Scheduler


class PriorityScheduler(Scheduler):
    def priority_key(self, req: Request):
        """A sort key: smaller is served first, and preempted last.

        Order by priority, then by arrival (arrival_time, then seq). With aging, every step a
        request has waited lowers its priority value by self.config.priority_aging.
        """
        raise NotImplementedError

    def next_waiting(self) -> Request:
        """The waiting request (in self.waiting) to admit next."""
        raise NotImplementedError

    def select_victim(self) -> Request:
        """The running request (in self.running) to preempt when blocks run out."""
        raise NotImplementedError

"""A learner-style solution of exercise 130, written from the statement alone: it passes every case.

The mutants next to it subclass it and break one thing each.
"""

from nano_engine.scheduler import Scheduler


class PriorityScheduler(Scheduler):
    def priority_key(self, req):
        effective = req.priority - self.config.priority_aging * self.steps_waited(req)
        return (effective, req.arrival_time, req.seq)

    def next_waiting(self):
        return min(self.waiting, key=self.priority_key)

    def select_victim(self):
        return max(self.running, key=self.priority_key)

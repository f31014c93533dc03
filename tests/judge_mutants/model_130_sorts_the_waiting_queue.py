"""A right solution of exercise 130 that keeps the waiting queue sorted by key, in place.

It decides exactly as the reference does (the policy picks from the waiting queue by key, so the
queue's order is its own business): the judge must pass it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_130 import PriorityScheduler as Model  # noqa: E402


class PriorityScheduler(Model):
    def next_waiting(self):
        ordered = sorted(self.waiting, key=self.priority_key)
        self.waiting.clear()
        self.waiting.extend(ordered)  # the same deque, now sorted: smallest key at the front
        return self.waiting[0]

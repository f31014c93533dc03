"""Mutant of exercise 130: the next waiting request is the head unless a more urgent one is right behind it."""

EXPECTED_HINT = "waiting requests are served smallest key first"

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_130 import PriorityScheduler as Model  # noqa: E402


class PriorityScheduler(Model):
    def next_waiting(self):
        head = self.waiting[0]
        if len(self.waiting) > 1 and self.priority_key(self.waiting[1]) < self.priority_key(head):
            return self.waiting[1]  # MUTANT: min over the whole queue
        return head

"""Mutant of exercise 129: never chunks a prompt: one that does not fit the budget left waits."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_129 import Scheduler as Model  # noqa: E402


class Scheduler(Model):
    def waiting_pass(self, out, budget):
        config = self.config
        try:
            self.config = type(config)(**{**vars(config), "enable_chunked_prefill": False})  # MUTANT
            return super().waiting_pass(out, budget)
        finally:
            self.config = config

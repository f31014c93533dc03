import os

import pytest
import torch
from hypothesis import settings

from nano_engine.tiny import tiny_model

# HYPOTHESIS_PROFILE=long runs the property tests with many more examples (minutes, not seconds).
settings.register_profile("long", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_make_parametrize_id(config, val, argname):
    """A dtype in a test's id reads as its name (test_x[bfloat16]), not as its place (dtype1)."""
    return str(val).removeprefix("torch.") if isinstance(val, torch.dtype) else None


@pytest.fixture(scope="session")
def tiny():
    """A tiny float64 Llama-style model shared by the fast tests."""
    return tiny_model(seed=0)

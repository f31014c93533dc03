import os

import pytest
from hypothesis import settings

from nano_engine.tiny import tiny_model

# HYPOTHESIS_PROFILE=long runs the property tests with many more examples (minutes, not seconds).
settings.register_profile("long", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def tiny():
    """A tiny float64 Llama-style model shared by the fast tests."""
    return tiny_model(seed=0)

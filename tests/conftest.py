import pytest

from nano_engine.tiny import tiny_model


@pytest.fixture(scope="session")
def tiny():
    """A tiny float64 Llama-style model shared by the fast tests."""
    return tiny_model(seed=0)

"""Small helpers shared by the test files (imported as a plain module: tests/ is on sys.path)."""

import re


def whole(message: str) -> str:
    """A pytest.raises(match=...) pattern that matches exactly this message, not a part of it."""
    return "^" + re.escape(message) + "$"

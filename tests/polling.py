"""Waiting on a condition in a test: poll it until it holds, and fail naming what was awaited once a
deadline passes. Deadlines are generous (only a failing test waits one out); no outcome depends on them."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(cond: Callable[[], object], what: str = "the condition", timeout: float = 60.0) -> None:
    """Return as soon as `cond()` is true; an AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)

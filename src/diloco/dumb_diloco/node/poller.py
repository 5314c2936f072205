"""Step 5 on a worker: the poll lane. At most one poll for a newer global is in flight; the node asks at
every boundary and, between boundaries, when one is `due` (poll_interval since the last ask). A finished
poll's global is staged; a failed poll is counted and logged, and fails the run only under fail_fast (a
poll never kills training otherwise). The master polls nothing: its globals come from its outer loop.
Prose: docs/dumb_diloco.md ("Node lifecycle").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..settings import Settings
from ..wire.global_state import GlobalSnapshot
from ..wire.tensor_format import InvalidTensorFile
from .counters import Counters
from .lanes import describe, fail_fast

log = logging.getLogger("diloco.dumb_diloco")


class Poller:
    """One node's poll lane and its cadence (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        counters: Counters,
        fetch: Callable[[], GlobalSnapshot | None],
        stage: Callable[[GlobalSnapshot], None],
        clock: Callable[[], float],
    ):
        self.s = settings
        self.counters = counters
        self.fetch, self.stage, self.clock = fetch, stage, clock
        self._lane: Any = None  # a one-thread executor or lanes.InlineLane, from `start`
        self._future: Future | None = None
        self._last = -math.inf  # when the node last asked for a poll

    def start(self, lane: Any) -> None:
        self._lane = lane
        self._last = self.clock()

    @property
    def in_flight(self) -> bool:
        return self._future is not None and not self._future.done()

    def due(self) -> bool:
        """True once poll_interval has passed since the node last `asked`."""
        return self.clock() - self._last >= self.s.poll_interval

    def asked(self) -> None:
        """The node asks for a poll now (at a boundary, or when one is due)."""
        self._last = self.clock()

    def submit(self) -> bool:
        """Start a poll on the lane (False if one is still in flight)."""
        if self.in_flight:
            return False
        self._future = self._lane.submit(self.fetch)
        return True

    def collect(self) -> None:
        """A poll that finished since the last call: its global staged, or its failure handled."""
        if self._future is None or not self._future.done():
            return
        future, self._future = self._future, None
        err = future.exception()
        if err is not None:
            self.failed(err)
            return
        snapshot = future.result()
        if snapshot is not None:
            self.stage(snapshot)

    def failed(self, err: BaseException) -> None:
        """A poll's failure (also the start-up fetch's): fatal under fail_fast, else counted and retried."""
        fail_fast(self.s, err, "polling for a global")
        if isinstance(err, InvalidTensorFile):
            log.error("node %s: not installing the repository's global: %s", self.s.node_id, err.reason)
            return
        self.counters.poll_failures += 1
        log.warning(f"node {self.s.node_id}: polling for a global failed ({describe(err)}); will retry")

    def shutdown(self) -> None:
        if self._lane is not None:
            self._lane.shutdown(wait=False, cancel_futures=True)

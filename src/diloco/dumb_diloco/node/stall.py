"""The training thread's time on one node: inside the node after each step (its stall, every step and at
boundaries, kept in the node's Counters and so in its checkpoint; the longest boundary stall) and between
steps (the trainer's busy time, whose mean per step is this node's pace for dynamic local steps).
Prose: docs/dumb_diloco.md ("Metrics").
"""

from .counters import Counters


class StallMeter:
    """Stall and busy time of one node's training thread (see the module docstring)."""

    def __init__(self, counters: Counters):
        self.counters = counters
        self.max_boundary = 0.0  # the longest boundary stall of this process (not checkpointed)
        self.busy_seconds, self.busy_steps = 0.0, 0
        self._left: float | None = None  # when the node last returned to the trainer

    def entered(self, now: float) -> None:
        """The node is called after a step: the time since it returned was the trainer's."""
        if self._left is not None:
            self.busy_seconds += now - self._left
            self.busy_steps += 1

    def stalled(self, seconds: float, boundary: bool) -> None:
        self.counters.stall_seconds += seconds
        if boundary:
            self.counters.boundary_stall_seconds += seconds
            self.max_boundary = max(self.max_boundary, seconds)

    def left(self, now: float) -> None:
        self._left = now

    @property
    def step_micros(self) -> int:
        """The trainer's busy microseconds per step so far (0 before the node's second step)."""
        return round(1e6 * self.busy_seconds / self.busy_steps) if self.busy_steps else 0

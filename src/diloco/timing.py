"""A run's clocks: its wall and inner-compute seconds across resumes, and injected heterogeneity."""

from __future__ import annotations

import time


class Clock:
    """Wall-clock and inner-compute seconds of the run, carried across resumes."""

    def __init__(self):
        self.offset, self.inner_seconds, self.started = 0.0, 0.0, time.perf_counter()

    def resume(self, wall_seconds: float, inner_seconds: float) -> None:
        self.offset, self.inner_seconds = wall_seconds, inner_seconds

    def wall(self) -> float:
        return self.offset + time.perf_counter() - self.started


class InjectedPace:
    """Injected heterogeneity (experiments): how long a step sleeps after `busy` seconds of work.

    train.step_seconds > 0 emulates nodes on hardware of their own on a machine whose cores they share:
    every step takes step_seconds (a slow shard's: slowdown x step_seconds) whatever its work took, so a
    step's time no longer depends on what the other processes are doing. Steps whose work alone took
    longer are counted (summary.json `emulated_step`); if there are many, step_seconds is too short.
    step_seconds 0: a slow shard sleeps (slowdown - 1) x its work, the others not at all."""

    def __init__(self, train, slow: bool):
        self.factor = train.slowdown if slow else 1.0
        self.floor = self.factor * train.step_seconds
        self.steps = self.over = 0
        self.active = self.floor > 0 or self.factor > 1  # else the training loop never calls rest()

    def rest(self, busy: float) -> float:
        self.steps += 1
        if self.floor > 0:
            self.over += busy > self.floor
            return max(0.0, self.floor - busy)
        return (self.factor - 1.0) * busy

    def summary(self) -> dict:
        if not self.floor:
            return {}
        return {"emulated_step": {"seconds": self.floor, "steps": self.steps, "steps_over": self.over}}

"""A node's estimate of the whole run's step, for `budget: global` (past the spec, issue 12): the nodes
share num_nodes x train.max_steps node-steps (synchronous DiLoCo's tokens with as many workers), so fast
nodes train more steps than slow ones and every node stops at about the same time, and the inner lr
follows the run's step instead of the node's own (schedule.py).

    run step = (steps of every node that the installed global includes) / num_nodes
               + (this node's steps that it does not include yet)

The first term comes from the global's `included` (node -> newest applied local step, in step_count.json,
or from the master's own outer loop), so the rule is the same on every transport. A node stops once its
run step reaches train.max_steps (train.py's loop, through `Strategy.progress`); the end of run (ending.py)
then sends its last delta as always, so nothing is lost. With `budget: local` (the spec) the run step is
the local step. The estimate assumes every other node made as many steps since its last included delta as
this one: it is exact for nodes in lock step, and otherwise off by at most the steps some node has made
that the installed global does not include yet (about one round). It never goes back (the lr never rises):
after an install that lowers the estimate it holds until the estimate catches up.

`dynamic_local_steps` (Async Local-SGD's dynamic local updates, arXiv 2401.09135): a node's round is
H x pace steps, pace = the fastest node's busy seconds per step / this node's (at most 1), so a node at half
the others' speed uploads every H/2 of its steps and every node's delta arrives at about the same time.
Each node measures its own (the trainer's time between steps, without its waits and stalls) and sends it
with its deltas; the master publishes every node's latest with each global (`step_micros`). A time, not a
count of steps: with `install_wait_seconds` every node makes the same steps per round, whatever its speed.
Prose: docs/dumb_diloco.md ("Past the specification", "global budget", "dynamic local steps").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GlobalProgress:
    """What the newest installed global says of the run's progress (see the module docstring)."""

    node_id: str
    num_nodes: int
    global_budget: bool  # False: `budget: local`, the run step is the local step
    included_steps: int = 0  # every node's newest applied local step, summed
    included_own: int = 0  # this node's newest applied local step
    held: float = 0.0  # the run step just before the last install: it never goes back
    pace: float = 1.0  # this node's speed / the fastest node's, from the last install (dynamic local steps)

    def installed(
        self, included: dict[str, int], local_step: int, step_micros: dict | None = None, own_micros: int = 0
    ) -> None:
        """A global was installed after `local_step` steps; `included`: its node -> newest applied local step
        (-1: none). An install that lowers the estimate (a fast node learning that a slow one is further
        behind than it assumed) holds the run step, and the lr, until the estimate catches up."""
        self.held = self.step(local_step)
        self.included_steps = sum(max(step, 0) for step in included.values())
        self.included_own = max(included.get(self.node_id, 0), 0)
        if own_micros > 0 and (known := [m for m in (step_micros or {}).values() if m > 0]):
            self.pace = min(min(known) / own_micros, 1.0)  # the fastest node's time per step / this node's

    def round_steps(self, inner_steps: int) -> int:
        """A round's inner steps under dynamic local updates: H x pace, at least 1."""
        return max(1, round(inner_steps * self.pace))

    def step(self, local_step: int) -> float:
        """The run's step after `local_step` steps of this node."""
        if not self.global_budget:
            return local_step
        estimate = self.included_steps / self.num_nodes + max(local_step - self.included_own, 0)
        return max(estimate, self.held)

    def state_dict(self) -> dict:
        out = {"included_steps": self.included_steps, "included_own": self.included_own, "held": self.held}
        return out | {"pace": self.pace}

    def load_state_dict(self, state: dict) -> None:
        self.included_steps, self.included_own = int(state["included_steps"]), int(state["included_own"])
        self.held, self.pace = float(state.get("held", 0.0)), float(state.get("pace", 1.0))

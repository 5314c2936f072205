"""The master's part of a DumbDiLoCo node: `MasterRole` owns the repository's lease (the flock on
<state_dir>/<node_id>/master.lock), the outer loop (loop.py) and its stop and save; the node composes it
(None on a worker) and reads the snapshot, the final status and the figures through it.

Invariants: `start` takes the lease, recovers the newest state (startup.py), hands its global to
`on_snapshot` and then starts the loop; `stop` drains at most `drain_timeout` and saves (idempotent);
`close` is `stop(0)` (one last round) and releases the lock (idempotent). With `manual_rounds` no thread
is started: the caller drives every round through `outer.run_once()` (a simulation in lock step). Prose:
docs/dumb_diloco.md ("Master outer loop", "Restarts and checkpoints").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import IO

import torch

from ..settings import Settings
from ..wire.global_state import GlobalSnapshot
from .loop import OuterLoop
from .recovery import MasterState
from .startup import Repository, open_outer_loop, recover_outer_loop, take_lease

log = logging.getLogger("diloco.dumb_diloco")


class MasterRole:
    """The master's lease and outer loop (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        joiner: Repository,
        state_dir: Path,
        *,
        fetch: Callable[[], GlobalSnapshot | None],
        check_layout: Callable[[dict[str, torch.Tensor], str], None],
        on_snapshot: Callable[[GlobalSnapshot], None],
        max_file_bytes: int,
        init_sha256: str,
        hf_config: dict | None,
        manual_rounds: bool = False,
    ):
        self.s = settings
        self.joiner = joiner  # its transport, once connected, is the repository's
        self.state_dir = state_dir
        self.fetch, self.check_layout, self.on_snapshot = fetch, check_layout, on_snapshot
        self.max_file_bytes, self.init_sha256, self.hf_config = max_file_bytes, init_sha256, hf_config
        self.manual_rounds = manual_rounds  # True: no outer-loop thread; the caller calls outer.run_once()
        self.checkpoint: MasterState | None = None  # the trainer checkpoint's master state, for `start`
        self.outer: OuterLoop | None = None  # from `start`
        self._lock: IO | None = None  # the open master.lock (flock)
        self.closed = False

    def load(self, checkpoint: dict) -> None:
        """A trainer checkpoint's master state (`state_dict`), recovered from at `start`."""
        self.checkpoint = MasterState.from_checkpoint(checkpoint)

    def start(self, model_state: dict[str, torch.Tensor]) -> None:
        """Take the repository (the lease), recover the newest state, publish it if the repository is
        behind, hand its global to `on_snapshot`, start the outer loop (startup.py; not with
        `manual_rounds`)."""
        instance, self._lock = take_lease(self.s, self.joiner.transport, self.state_dir)
        self.outer, publish, adopted = recover_outer_loop(
            self.joiner,
            self.fetch,
            self.check_layout,
            model_state,
            checkpoint=self.checkpoint,
            state_dir=self.state_dir,
            max_file_bytes=self.max_file_bytes,
            instance=instance,
            init_sha256=self.init_sha256,
            hf_config=self.hf_config,
            on_snapshot=self.on_snapshot,
        )
        open_outer_loop(self.outer, self.s, publish, adopted)
        self.on_snapshot(self.outer.snapshot())
        if not self.manual_rounds:
            self.outer.start()

    def stop(self, drain_timeout: float) -> None:
        """Rounds until every node's final delta is processed (at most `drain_timeout`; 0: one last round),
        then stop and save. Idempotent."""
        if self.outer is not None and not self.outer.stopped:
            if not self.outer.stop(drain_timeout, self.s.shutdown_timeout):
                log.warning("master: the outer loop was still running after the shutdown timeout; leaving it")
            self.outer.save_state()

    def close(self) -> None:
        """One last round, then release the lock (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.stop(0.0)
        if self._lock is not None:
            self._lock.close()  # releases the flock on <state_dir>/<node_id>/master.lock

    # ---------------------------------------------------------------- what the node reads

    @property
    def dead(self) -> str:
        return self.outer.dead if self.outer is not None else ""

    @property
    def outer_step(self) -> int:
        return self.outer.state.outer_step if self.outer is not None else -1

    @property
    def total_bytes(self) -> int:
        return self.outer.bytes_uploaded + self.outer.bytes_downloaded if self.outer is not None else 0

    def snapshot(self) -> GlobalSnapshot:
        assert self.outer is not None, "the master was not started"
        return self.outer.snapshot()

    def final_status(self, identity: tuple[str, int, str] | None) -> str:
        """What became of this node's final delta (`identity`: node, local step, sha256)."""
        if identity is None:
            return "none: this node uploaded no delta"
        if self.outer is None:
            return "not applied"
        e = self.outer.ledger_entry(identity)
        return f"{e.status} at outer step {e.outer_step}" if e is not None else "not applied"

    def state_dict(self) -> dict | None:
        """The full outer state, for the trainer's checkpoint (None before `start`)."""
        if self.outer is None:
            return None
        return self.outer.checkpoint()

    def metrics(self) -> dict[str, float]:
        o = self.outer
        if o is None:
            return {}
        return {
            "outer/master_step": o.state.outer_step,
            "outer/rounds": o.rounds,
            "outer/errors": o.errors,
            "outer/deltas_accepted": o.deltas_accepted,
            "outer/deltas_rejected": o.deltas_rejected,
            "outer/pseudo_grad_norm": o.last_pseudo_grad_norm,
            "outer/pending_deltas": o.pending,
            "outer/staleness_max": max(o.last_staleness, default=0),  # outer steps since the base
            "outer/staleness_mean": sum(o.last_staleness) / max(len(o.last_staleness), 1),
        }

    def node_steps_applied(self) -> int:
        """Every node's newest applied local step, summed."""
        if self.outer is None:
            return 0
        return self.outer.node_steps_applied()

    def describe_left(self) -> str:
        return self.outer.describe_left() if self.outer is not None else ""

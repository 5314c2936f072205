"""How a node installs a global G (step 6): the `Installer`, which owns the staged global, the installed
global's outer step and, for `translate`, the reference and the snapshots of deltas no global includes yet.

`replace` (the specification): the live weights and the baseline become G, so the node's progress since
its last upload survives only in that upload, which the master then applies to a newer global than it
was computed from. `translate` (past the spec, issue 12): the node keeps its own progress on top of G.
With S the node's snapshot at the newest of its own deltas that G includes (G's `included` map; the
previously installed global if G includes none newer), the live weights, the baseline and every
snapshot of a delta G does not include yet move by G - S. Every next delta (baseline - weights) is
unchanged, so nothing is lost or counted twice, and installing with zero delay is synchronous DiLoCo
exactly. With `install_when_staged` the node installs as soon as a global is staged, mid-round, not
only at its next boundary.

Invariants: a global is staged from any thread and installed on the training thread only; tensors a job
in flight reads are never written (translated tensors are new ones); the shift is computed in float32
and cast back to the model's dtype; an installed global's tensors are never mutated. Prose:
docs/dumb_diloco.md ("Past the specification").
"""

from __future__ import annotations

import threading

import torch

from ..settings import DumbDiLoCoError
from ..wire.global_state import GlobalSnapshot, state_layout
from .lanes import Buffers, DeltaJob

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]
Snapshot = dict[str, torch.Tensor]


def shifted(t: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """A new tensor: t + shift in float32, in t's dtype and device."""
    return (t.float() + shift.to(t.device)).to(t.dtype)


class Installer:
    """Step 6 into `model`: which global is staged, which is installed, and (translate) what the next
    install shifts. The baseline is the uploader's: `install` takes it and returns the new one."""

    def __init__(
        self,
        model: torch.nn.Module,
        node_id: str,
        translating: bool,
        layout: Layout,
        delta_keys: list[str],
        buffers: Buffers,
    ):
        self.model = model
        self.node_id = node_id
        self.translating = translating
        self.layout = layout
        self.delta_keys = delta_keys
        self.buffers = buffers
        self.outer_step = -1  # the installed global's
        self.num_peers = 0  # the nodes whose deltas the installed global holds
        self._staged: GlobalSnapshot | None = None  # the newest global polled, not installed yet
        self._stage_lock = threading.Lock()
        # translate's state: the last installed global, its newest own delta, the snapshots it lacks
        self.reference: Snapshot | None = None
        self.included_step = -1
        self.pending_snapshots: dict[int, Snapshot] = {}

    # ---- the staged global (any thread)

    def stage(self, snapshot: GlobalSnapshot) -> None:
        """Keep the newest global for the training thread (called from any thread)."""
        with self._stage_lock:
            if self._staged is None or snapshot.outer_step > self._staged.outer_step:
                self._staged = snapshot

    @property
    def staged(self) -> GlobalSnapshot | None:
        return self._staged

    def newest_known(self) -> int:
        staged = self._staged
        return max(self.outer_step, staged.outer_step if staged is not None else -1)

    def take(self) -> GlobalSnapshot | None:
        """The staged global, now no longer staged, if it is newer than the installed one."""
        with self._stage_lock:
            snapshot, self._staged = self._staged, None
        if snapshot is None or snapshot.outer_step <= self.outer_step:
            return None
        return snapshot

    def check_layout(self, state: dict[str, torch.Tensor], what: str) -> None:
        got = state_layout(state)
        if got != self.layout:
            diff = sorted(set(got) ^ set(self.layout)) or [k for k in got if got[k] != self.layout[k]]
            raise DumbDiLoCoError(
                f"{what} does not match this model (keys, shapes or dtypes differ, e.g. {diff[:3]})"
            )

    # ---- the snapshots translate keeps (training thread)

    def remember(self, local_step: int, snapshot: Snapshot) -> None:
        """A captured delta's snapshot, kept until an installed global includes that delta (translate)."""
        if self.translating:
            self.pending_snapshots[local_step] = snapshot

    def forget(self, local_step: int) -> None:
        """A delta whose upload failed: no global will include it (the next delta carries it)."""
        self.pending_snapshots.pop(local_step, None)

    @property
    def held(self) -> int:
        return len(self.pending_snapshots)

    # ---- the install (training thread)

    def install(
        self, g: GlobalSnapshot, baseline: Snapshot, in_flight: DeltaJob | None, boundary: DeltaJob | None
    ) -> tuple[Snapshot, bool]:
        """Copy `g` into the live model. Returns the new baseline and whether the inner loop restarts
        from `g` (replace, or translate's first install). `in_flight`: the upload job that may still read
        buffers; `boundary`: the boundary's job, not yet dispatched (replace: its snapshot, which `g`
        replaces as the baseline, becomes its delta in place)."""
        if self.translating and self.reference is not None:
            new, restarted = self.translate(g, baseline, in_flight), False
        else:
            new, restarted = self.replace(g, baseline, boundary), True
        self.outer_step, self.num_peers = g.outer_step, g.num_peers
        return new, restarted

    @torch.no_grad()
    def replace(self, g: GlobalSnapshot, baseline: Snapshot, boundary: DeltaJob | None) -> Snapshot:
        """The specification's install: the live weights and the baseline become `g`."""
        for k, t in self.model.state_dict().items():
            t.copy_(g.state[k])
        if boundary is not None and baseline is boundary.snapshot:
            boundary.in_place = boundary.snapshot.file is not None
        elif not self.translating:  # a job that reads it ends before the next capture takes it
            self.buffers.keep(baseline)
        new = {k: g.state[k] for k in self.delta_keys}  # the snapshot is never mutated
        self.reference, self.pending_snapshots = dict(new), {}
        self.included_step = g.included.get(self.node_id, -1)
        return new

    @torch.no_grad()
    def translate(self, g: GlobalSnapshot, baseline: Snapshot, in_flight: DeltaJob | None) -> Snapshot:
        """Install `g` keeping the node's own progress (see the module docstring). One tensor's shift at
        a time (no model-sized float32 shift); when S is the baseline itself (g includes the node's newest
        delta: the usual case), the baseline becomes g's tensors exactly and S is free for the next capture."""
        mine = g.included.get(self.node_id, -1)
        if mine > self.included_step and mine in self.pending_snapshots:
            ref = self.pending_snapshots[mine]
        else:  # g includes no newer delta of this node (or one this process did not capture: a restart)
            ref = self.reference
            mine = self.included_step if mine not in self.pending_snapshots else mine
        later = {step: snap for step, snap in self.pending_snapshots.items() if step > mine}
        exact = baseline is ref  # S is the baseline: it becomes g
        new: Snapshot = {}
        pending: dict[int, Snapshot] = {step: {} for step in later}
        for k, t in self.model.state_dict().items():
            if k not in baseline:
                t.copy_(g.state[k])  # what is not in a delta (integer buffers) is the global's
                continue
            shift = g.state[k].float() - ref[k].float()  # the one temporary of this tensor's size
            if t.dtype == torch.float32:
                t.add_(shift)
            else:
                t.copy_(shifted(t, shift))
            new[k] = g.state[k] if exact else shifted(baseline[k], shift)
            for step, snap in later.items():  # the baseline is the newest snapshot: shifted once
                pending[step][k] = new[k] if snap is baseline else shifted(snap[k], shift)
        released = [snap for step, snap in self.pending_snapshots.items() if step <= mine]
        self.pending_snapshots = pending
        self.reference = {k: g.state[k] for k in self.delta_keys}  # never mutated
        self.included_step = max(self.included_step, mine)
        for snap in [*released, baseline]:  # free for the next capture unless a job in flight reads it
            if in_flight is None or (snap is not in_flight.base and snap is not in_flight.snapshot):
                self.buffers.keep(snap)
        return new

    # ---- checkpoints

    def state_dict(self) -> dict | None:
        """translate's state (references, no copies), None before its first install or under replace."""
        if not (self.translating and self.reference is not None):
            return None
        pending = {str(k): dict(v) for k, v in self.pending_snapshots.items()}  # no file
        return {"reference": self.reference, "included_step": self.included_step, "pending": pending}

    def resume(self, outer_step: int, translate: dict | None) -> None:
        """A checkpoint's installed outer step and (translate) its reference and pending snapshots."""
        self.outer_step = outer_step
        if translate and self.translating:
            self.reference, self.included_step = dict(translate["reference"]), int(translate["included_step"])
            self.pending_snapshots = {int(k): dict(v) for k, v in translate["pending"].items()}

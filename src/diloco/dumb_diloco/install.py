"""How a node installs a global G (step 6). `replace` (the specification): the live weights and the
baseline become G, so the node's progress since its last upload survives only in that upload, which the
master then applies to a newer global than it was computed from. `translate` (past the spec, issue 12):
the node keeps its own progress on top of G. With S the node's snapshot at the newest of its own deltas
that G includes (G's `included` map; the previously installed global if G includes none newer), the
live weights, the baseline and every snapshot of a delta G does not include yet move by G - S. Every
next delta (baseline - weights) is unchanged, so nothing is lost or counted twice, and installing with
zero delay is synchronous DiLoCo exactly. With `install_when_staged` the node installs as soon as a
global is staged, mid-round, not only at its next boundary.

Invariants: tensors a job in flight reads are never written (translated tensors are new ones); the
shift is computed in float32 and cast back to the model's dtype. Prose: docs/dumb_diloco.md ("Past the
specification").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .recovery import GlobalSnapshot

if TYPE_CHECKING:
    from .node import Node


def shifted(t: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """A new tensor: t + shift in float32, in t's dtype and device."""
    return (t.float() + shift.to(t.device)).to(t.dtype)


@torch.no_grad()
def translate(node: Node, g: GlobalSnapshot) -> None:
    """Install `g` keeping the node's own progress (see the module docstring). One tensor's shift at a
    time (no model-sized float32 shift); when S is the baseline itself (g includes the node's newest
    delta: the usual case), the baseline becomes g's tensors exactly and S is free for the next capture."""
    mine = g.included.get(node.s.node_id, -1)
    if mine > node.included_step and mine in node.pending_snapshots:
        ref = node.pending_snapshots[mine]
    else:  # g includes no newer delta of this node (or one this process did not capture: a restart)
        ref = node.reference
        mine = node.included_step if mine not in node.pending_snapshots else mine
    later = {step: snap for step, snap in node.pending_snapshots.items() if step > mine}
    old_baseline, exact = node._baseline, node._baseline is ref  # S is the baseline: it becomes g
    baseline: dict[str, torch.Tensor] = {}
    pending: dict[int, dict[str, torch.Tensor]] = {step: {} for step in later}
    for k, t in node.model.state_dict().items():
        if k not in old_baseline:
            t.copy_(g.state[k])  # what is not in a delta (integer buffers) is the global's
            continue
        shift = g.state[k].float() - ref[k].float()  # the one temporary of this tensor's size
        t.add_(shift) if t.dtype == torch.float32 else t.copy_(shifted(t, shift))
        baseline[k] = g.state[k] if exact else shifted(old_baseline[k], shift)
        for step, snap in later.items():  # the baseline is the newest snapshot: shifted once
            pending[step][k] = baseline[k] if snap is old_baseline else shifted(snap[k], shift)
    released = [snap for step, snap in node.pending_snapshots.items() if step <= mine]
    node._baseline, node.pending_snapshots = baseline, pending
    node.reference = {k: g.state[k] for k in node.delta_keys}  # never mutated
    node.included_step = max(node.included_step, mine)
    job = node._upload[0] if node._upload is not None else None
    for snap in [*released, old_baseline]:  # free for the next capture unless a job in flight reads it
        if job is None or (snap is not job.base and snap is not job.snapshot):
            node.buffers.keep(snap)

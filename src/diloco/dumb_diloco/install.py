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
    """Install `g` keeping the node's own progress (see the module docstring)."""
    mine = g.included.get(node.s.node_id, -1)
    if mine > node.included_step and mine in node.pending_snapshots:
        ref = node.pending_snapshots[mine]
    else:  # g includes no newer delta of this node (or one this process did not capture: a restart)
        ref = node.reference
        mine = node.included_step if mine not in node.pending_snapshots else mine
    shift = {k: g.state[k].float() - ref[k].float() for k in node.delta_keys}
    live = node.model.state_dict()
    for k, t in live.items():
        if k in shift:
            t.copy_(shifted(t, shift[k]))
        else:
            t.copy_(g.state[k])  # what is not in a delta (integer buffers) is the global's
    node._baseline = {k: shifted(t, shift[k]) for k, t in node._baseline.items()}
    node.pending_snapshots = {
        step: {k: shifted(t, shift[k]) for k, t in snap.items()}
        for step, snap in node.pending_snapshots.items()
        if step > mine
    }
    node.reference = {k: g.state[k] for k in node.delta_keys}  # never mutated
    node.included_step = max(node.included_step, mine)

"""The arithmetic of deltas: a node's pseudo-gradient (float32 baseline - weights), and step 5 of the
master's outer loop as the deltas arrive, a running float32 sum (issue 12, "Bounded memory"). Prose: docs/dumb_diloco.md ("Master outer loop", "Past the specification": quorum, staleness).

Invariants: one model-sized float32 buffer however many deltas are pending (a delta is added, then
dropped); deltas are added in arrival order, so the equal-weight mean is bit for bit `average`'s over
the same list; a delta's raw weight 1/(1+staleness) is fixed when it is added (the outer step, hence its
staleness, does not move while deltas are pending: it moves only when a round applies them all) and
normalised once, in `mean`, which equals `average` with normalised weights to float32 round-off.
"""

from __future__ import annotations

import torch


class RunningSum:
    """sum_i w_i * delta_i over the deltas added since the last `mean`, in float32 (the mean's buffer)."""

    def __init__(self) -> None:
        self.total: dict[str, torch.Tensor] = {}
        self.weight = 0.0  # sum of the raw weights (the number of deltas when they are all 1)
        self.count = 0
        self._flat: tuple[torch.Tensor, dict] | None = None  # `total` as one tensor, and its layout

    def add(self, delta: dict[str, torch.Tensor], weight: float = 1.0) -> None:
        """Add `weight` * `delta`; `delta` is only read (it may be a view of a file's bytes). A delta whose
        tensors tile one float32 buffer (a file's payload, `decode(views=True)`) is added in one operation
        where the sum has its layout: a few large operations, not one or two per tensor."""
        flat = _flat(delta)
        if self.count == 0 and flat is not None:  # a fresh buffer in the delta's layout; t * 1.0 is exact
            total, layout = flat[0] * weight, flat[1]
            self.total = {k: total[layout[k][0] : layout[k][1]].view(t.shape) for k, t in delta.items()}
            self._flat = (total, layout)
        elif self.count == 0:
            self.total, self._flat = {k: t * weight for k, t in delta.items()}, None
        elif flat is not None and self._flat is not None and flat[1] == self._flat[1]:
            self._flat[0].add_(flat[0], alpha=weight)  # element by element, as the loop below
        else:
            for k, t in self.total.items():
                t.add_(delta[k], alpha=weight)  # alpha=1.0 is the plain sum
        self.weight += weight
        self.count += 1

    @property
    def packed(self) -> bool:
        """Whether the sum is one float32 buffer (a delta of its layout then adds in one operation)."""
        return self._flat is not None

    def mean(self, nodes: int | None = None) -> dict[str, torch.Tensor]:
        """The weighted mean of the deltas added (their sum divided by the sum of weights), in the sum's
        buffer, which this hands over: the running sum starts empty again. `nodes`: a quorum round's
        nodes instead: the mean scaled by count / nodes, so each node's deltas add up (two of a fast node
        count as its progress, not as two nodes) and a lone node's delta is not taken for all of them."""
        total, weight, flat = self.total, self.weight, self._flat
        if nodes is not None and nodes != self.count:
            weight *= nodes / self.count
        self.total, self.weight, self.count, self._flat = {}, 0.0, 0, None
        for t in total.values() if flat is None else [flat[0]]:
            t.div_(weight)  # equal weights: the sum of 1.0s is the exact count (or the nodes)
        return total


def _flat(delta: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, tuple]] | None:
    """`delta` as one float32 tensor and each name's (begin, end, shape) in it, when its tensors are
    contiguous float32 views of one storage that follow each other without a gap; else None."""
    items = sorted(delta.items(), key=lambda kv: kv[1].storage_offset())
    if not items or any(t.dtype != torch.float32 or not t.is_contiguous() for _, t in items):
        return None
    storage, start = items[0][1].untyped_storage(), items[0][1].storage_offset()
    layout, end = {}, start
    for name, t in items:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != end:
            return None
        layout[name], end = (end - start, end - start + t.numel(), t.shape), end + t.numel()
    return torch.empty(0).set_(storage, start, (end - start,)), layout


def average(
    deltas: list[dict[str, torch.Tensor]], weights: list[float] | None = None
) -> dict[str, torch.Tensor]:
    """The reference (the master's step 5 before the running sum): equal-weight mean, or the sum weighted
    by `weights` (normalised by the caller), accumulated in float32 in list order."""
    scale = weights or [1.0] * len(deltas)  # t * 1.0 and alpha=1.0 are exact: the plain sum
    out = {k: t * scale[0] for k, t in deltas[0].items()}
    for d, w in zip(deltas[1:], scale[1:]):
        for k, t in d.items():
            out[k].add_(t, alpha=w)
    if weights is None:
        for t in out.values():
            t.div_(len(deltas))
    return out

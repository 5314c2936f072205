"""A DumbDiLoCo node's upload job and its lanes' executor (node.py runs them; prose: docs/dumb_diloco.md,
"Node lifecycle"). Invariant: a job's base and snapshot buffers are read by that job only, and a base the
node allocated (OwnCopy) is reused only after the job subtracted it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .aggregation import pseudo_gradient
from .tensor_format import DeltaMeta


class InlineLane:
    """`async_*: false` (v1): a lane whose job runs on the training thread, at once (hand-written:
    concurrent.futures has no inline executor; this keeps one code path for v1 and v2)."""

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as err:  # reported like a background job's failure
            future.set_exception(err)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


class OwnCopy(dict):
    """Model-dtype CPU copies that this node allocated (reusable once no baseline or job refers to
    them; reuse measured: scripts/bench_boundary.py); an installed global's tensors are never reused."""


@dataclass
class DeltaJob:
    """One upload: the training thread's one copy (`snapshot`, the new baseline) and the old baseline;
    `materialize` computes float32(base) - float32(snapshot) (+ carry) on the upload lane."""

    local_step: int
    path: str
    meta: DeltaMeta
    steps: int  # optimizer steps the delta covers
    base: dict[str, torch.Tensor] | None = None
    snapshot: dict[str, torch.Tensor] | None = None
    carry: dict[str, torch.Tensor] | None = None  # a failed upload's delta, added to this one
    delta: dict[str, torch.Tensor] | None = None  # float32 pseudo-gradient, owned by the job
    seconds: float = 0.0
    residual: dict[str, torch.Tensor] | None = None  # int8/int4: the codec's residual once this is uploaded
    encoded: threading.Event = field(default_factory=threading.Event)  # set once the file is encoded

    def materialize(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """The delta, and the base's buffers when they are free for reuse. Idempotent."""
        if self.delta is not None:
            return self.delta, None
        delta = pseudo_gradient(self.base, self.snapshot)
        for k, t in (self.carry or {}).items():
            delta[k].add_(t)
        free = self.base if isinstance(self.base, OwnCopy) else None
        self.delta, self.base, self.snapshot, self.carry = delta, None, None, None
        return delta, free

"""A DumbDiLoCo node's upload job, its lanes' executor and what a lane's failure means (the uploader
and the node run them; prose: docs/dumb_diloco.md, "Node lifecycle"). Invariant: a job's base and
snapshot buffers are read by that job only, and a base the node allocated (OwnCopy) is reused only after
the job subtracted it; a lane's failure never kills training unless retrying cannot fix it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..settings import Settings
from ..store.transport import PermanentError, RemoteNotFound
from ..wire.delta_file import DeltaFile
from ..wire.global_state import pseudo_gradient
from ..wire.tensor_format import DeltaMeta


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
    them; reuse measured: scripts/bench_boundary.py); an installed global's tensors are never reused.
    A float32 model's are views of a DeltaFile (`file`), so that one can become its delta in place."""

    file: DeltaFile | None = None

    @classmethod
    def of_file(cls, file: DeltaFile) -> OwnCopy:
        copy = cls(file.tensors)
        copy.file = file
        return copy


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
    # float32 on the wire: the delta is computed into its file's payload (delta_file.py), a new one or,
    # `in_place`, the snapshot's own (a snapshot no longer needed once this job has subtracted it)
    new_file: Callable[[], DeltaFile] | None = None
    in_place: bool = False
    file: DeltaFile | None = None
    free: dict[str, torch.Tensor] | None = None  # the base's buffers, reusable once this job is done

    def materialize(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """The delta, and the base's buffers when they are free for reuse. Idempotent."""
        if self.delta is not None:
            return self.delta, None
        if self.new_file is None:
            delta = pseudo_gradient(self.base, self.snapshot)
        else:  # float32(base) - float32(snapshot), written where the file's payload is
            self.file = self.snapshot.file if self.in_place else self.new_file()
            delta = self.file.tensors
            for k, out in delta.items():
                base, snap = self.base[k], self.snapshot[k]
                if base.is_complex():
                    base, snap = torch.view_as_real(base), torch.view_as_real(snap)
                if base.dtype == snap.dtype == torch.float32:
                    torch.sub(base, snap, out=out)  # `out` may be `snap` itself (in place)
                else:  # promoted to float32 before subtracting, as pseudo_gradient does
                    out.copy_(base)
                    out.sub_(snap)
        for k, t in (self.carry or {}).items():
            delta[k].add_(t)
        free = self.base if isinstance(self.base, OwnCopy) else None
        self.delta = delta
        self.base = None
        self.snapshot = None
        self.carry = None
        return delta, free


class Buffers:
    """Where a node's snapshots and delta files come from (training thread only). float32 on the wire:
    a delta is computed into its file (delta_file.py), and a float32 model's snapshots are such files
    (one becomes its delta in place when an install replaces it). `free`: at most one buffer kept for
    the next capture (a baseline the upload lane subtracted, an uploaded in-place delta, a snapshot
    translate dropped); taken only at a capture, which needs an idle upload lane, so no job reads it."""

    def __init__(self, state: dict[str, torch.Tensor], delta_keys: list[str], float32_wire: bool):
        self.shapes = {k: (*state[k].shape, *((2,) if state[k].is_complex() else ())) for k in delta_keys}
        self.new_file = (lambda: DeltaFile(self.shapes)) if float32_wire else None
        self.files = float32_wire and all(state[k].dtype == torch.float32 for k in delta_keys)
        self.free: list[OwnCopy] = []

    def snapshot(self, state: dict[str, torch.Tensor]) -> OwnCopy:
        if self.free:
            return self.free.pop()
        if self.files:
            return OwnCopy.of_file(self.new_file())
        return OwnCopy({k: torch.empty_like(state[k], device="cpu") for k in self.shapes})

    def keep(self, buffers: dict[str, torch.Tensor] | None) -> None:
        if isinstance(buffers, OwnCopy) and not self.free and (buffers.file is not None) == self.files:
            self.free.append(buffers)


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


def fail_fast(settings: Settings, err: BaseException, what: str) -> None:
    """A refused token or a repository gone (issue 12): the node stops with one line, not train alone."""
    if isinstance(err, PermanentError) or (isinstance(err, RemoteNotFound) and what.startswith("upload")):
        raise settings.error(f"{what} failed for a reason retrying will not fix: {describe(err)}")

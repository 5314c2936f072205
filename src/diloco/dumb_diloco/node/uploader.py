"""A node's uploads (steps 3 and 4, and the end of its run): the `Uploader` owns the baseline, the steps
since it, a failed upload's carry, the upload lane with the job in flight, and the node's final marker.

At a boundary the training thread copies the weights once (`capture`: the snapshot becomes the new
baseline); the upload lane subtracts, encodes and writes (`send`). Invariants: no local progress is lost
(a failed upload's delta is carried into the next one); one job is in flight at a time (a capture needs
an idle lane, the node skips the boundary otherwise); the final marker says "finished" only once the
last upload succeeded or failed for good (ending.py). Prose: docs/dumb_diloco.md ("Node lifecycle",
"Guarantees").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from ..settings import Settings
from ..store.transport import Transport
from ..wire.delta_codec import DeltaCodec
from ..wire.repo_paths import delta_path
from ..wire.tensor_format import DeltaMeta, parse_header
from .counters import Counters
from .ending import write_marker
from .lanes import Buffers, DeltaJob, OwnCopy, describe

log = logging.getLogger("diloco.dumb_diloco")
Snapshot = dict[str, torch.Tensor]


@dataclass
class Finished:
    """An upload the lane finished: `error` None and its size in bytes, or why it failed."""

    job: DeltaJob
    bytes: int = 0
    error: BaseException | None = None


class Uploader:
    """Steps 3-4 of one node (see the module docstring); the node tells it when to capture and hands it
    the installed global's outer step and, at an install, the new baseline."""

    def __init__(
        self,
        model: torch.nn.Module,
        settings: Settings,
        delta_keys: list[str],
        buffers: Buffers,
        codec: DeltaCodec,
        counters: Counters,
        *,
        tokens_per_step: int,
        samples_per_step: int,
        clock: Callable[[], float],
    ):
        self.model = model
        self.s = settings
        self.delta_keys = delta_keys
        self.buffers = buffers
        self.codec = codec
        self.counters = counters  # the node's: this part counts its uploads, their bytes and failures
        self.clock = clock
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.translating = settings.install == "translate"
        self.transport: Transport | None = None  # set by `connect`, once the node opened its store
        self._lane: Any = None  # a one-thread executor or lanes.InlineLane, from `start`
        self._baseline: Snapshot = {}  # model-dtype CPU copies (see lanes.OwnCopy)
        self._steps_since_capture = 0
        self._carry: DeltaJob | None = None  # a failed upload: its delta goes into the next one
        self._upload: tuple[DeltaJob, Future] | None = None
        self.last_uploaded: tuple[int, str] | None = None  # (local step, payload SHA-256) of the last delta
        self.last_delta_bytes = 0
        self.last_upload_seconds = 0.0

    def connect(self, transport: Transport) -> None:
        self.transport = transport

    def start(self, lane: Any) -> None:
        self._lane = lane

    def shutdown(self) -> None:
        if self._lane is not None:
            self._lane.shutdown(wait=False, cancel_futures=True)

    # ---- what it holds

    @property
    def baseline(self) -> Snapshot:
        return self._baseline

    @property
    def carry(self) -> DeltaJob | None:
        return self._carry

    @property
    def steps_since_capture(self) -> int:
        return self._steps_since_capture

    @property
    def unsent(self) -> bool:
        """Progress that no upload holds yet: steps since the last capture, or a failed upload's."""
        return self._steps_since_capture > 0 or self._carry is not None

    @property
    def in_flight(self) -> DeltaJob | None:
        """The job submitted last and not collected yet (it may still read its buffers)."""
        return self._upload[0] if self._upload is not None else None

    @property
    def uploading(self) -> bool:
        return self._upload is not None and not self._upload[1].done()

    def count_step(self) -> None:
        self._steps_since_capture += 1

    def rebase(self, baseline: Snapshot, restart: bool) -> None:
        """An install's new baseline; `restart`: the inner loop restarts from it (no steps since)."""
        self._baseline = baseline
        if restart:
            self._steps_since_capture = 0

    # ---- steps 3 and 4

    def capture(self, local_step: int, base_outer_step: int, step_micros: int) -> DeltaJob:
        """Step 3: one copy of the current weights becomes the new baseline; the job computes the
        cumulative pseudo-gradient float32(old baseline) - float32(snapshot), plus a failed upload's.
        `base_outer_step`: the installed global's; `step_micros`: this node's pace for the others'."""
        state = self.model.state_dict()
        snapshot = self.buffers.snapshot(state)
        # one copy per tensor (as fast as torch's fused multi-tensor copy on CPU: 1.6-2.0 ms for the 14m
        # model's 57 tensors either way); device-to-host is synchronous: the snapshot is complete here
        for k in self.delta_keys:
            snapshot[k].copy_(state[k].detach())
        base, carry = self._baseline, self._carry
        self._baseline, self._carry = snapshot, None
        steps = self._steps_since_capture
        if carry is not None:
            base_outer_step, steps = min(base_outer_step, carry.meta.base_outer_step), steps + carry.steps
        self._steps_since_capture = 0
        meta = DeltaMeta(
            self.s.node_id,
            local_step,
            max(base_outer_step, 0),
            steps * self.tokens_per_step,
            steps * self.samples_per_step,
            step_micros=step_micros,
        )
        path = delta_path(self.s.node_id, local_step)
        delta = carry.delta if carry is not None else None
        return DeltaJob(
            local_step, path, meta, steps, base, snapshot, carry=delta, new_file=self.buffers.new_file
        )

    def dispatch(self, job: DeltaJob) -> None:
        self._upload = (job, self._lane.submit(self.send, job))

    def send(self, job: DeltaJob) -> tuple[int, str]:
        """Step 4, on the upload lane: subtract, encode, write. Returns the bytes and the payload SHA-256."""
        t0 = time.perf_counter()
        try:
            delta, job.free = job.materialize()  # the training thread pools the base when the job is done
            if job.file is not None:  # float32: the delta is already laid out as its file
                blob, job.residual = job.file.file(job.meta.to_header()), None
            else:
                blob, job.residual = self.codec.encode(delta, job.meta)  # int8/int4: delta + the residual
            job.encoded.set()
            self.transport.write(
                {job.path: blob}, message=f"{self.s.node_id}: delta at local step {job.local_step}"
            )
            self.codec.commit(job.residual)  # uploaded: the master has Q(delta + residual)
            job.delta = None  # uploaded: freed here, not on the training thread (860 MB at 150M: ~30 ms)
            job.file = job.file if job.in_place else None  # an in-place one is kept as the next snapshot
            return len(blob), parse_header(blob).metadata["payload_sha256"]
        finally:
            job.seconds = time.perf_counter() - t0
            job.encoded.set()  # also when it failed before encoding

    def collect(self) -> Finished | None:
        """The upload that ended since the last call, if one did (training thread), counted. A failed one
        is the node's to judge (fail fast, or `carry_over`)."""
        if self._upload is None or not self._upload[1].done():
            return None
        (job, future), self._upload = self._upload, None
        self.last_upload_seconds = job.seconds
        if not self.translating:  # translating: the base may be a snapshot translate still needs
            self.buffers.keep(job.free)
        job.free = None
        err = future.exception()
        if err is not None:
            self.counters.upload_failures += 1
            return Finished(job, error=err)
        if job.in_place and job.file is not None:  # the uploaded delta's buffer: a snapshot again
            self.buffers.keep(OwnCopy.of_file(job.file))
        job.file = None
        n, sha = future.result()
        self.last_uploaded = (job.local_step, sha)
        self.last_delta_bytes = n
        self.counters.uploads += 1
        self.counters.bytes_uploaded += n
        log.info(f"node {self.s.node_id}: uploaded {job.path} ({n} bytes, {job.seconds:.2f}s)")
        return Finished(job, n)

    def carry_over(self, failed: Finished) -> None:
        """A failed upload's delta goes into the next one (one job in flight: a capture took the previous
        carry into this job)."""
        job = failed.job
        job.materialize()  # already done unless the failure came before the subtraction
        self._carry = job
        log.warning(
            f"node {self.s.node_id}: upload of {job.path} failed ({describe(failed.error)}); its progress "
            "goes into the next delta"
        )

    def wait(self, deadline: float) -> None:
        """Wait for the upload in flight (if any) until `deadline` (clock time); `collect` then sees it."""
        if self._upload is not None:
            wait_futures([self._upload[1]], max(0.0, deadline - self.clock()))

    def warn_still_uploading(self) -> None:
        job = self._upload[0]
        log.warning(
            f"node {self.s.node_id}: {job.path} ({job.steps} step(s)) was still uploading after "
            f"shutdown_timeout {self.s.shutdown_timeout:g}s; leaving it (it may not arrive)"
        )

    # ---- the final marker (ending.py)

    def announce(self) -> None:
        """A node (re)starting: "running" in its marker, so that the master waits for it at the end (even
        before its first delta) and an earlier run's "finished" no longer counts."""
        otherwise = "the master may not wait for it at the end"
        write_marker(self.transport, self.s.node_id, {"state": "running"}, "running", otherwise)

    def mark_finished(self, local_step: int) -> None:
        """The final marker, once the last upload succeeded or failed for good: it names the last delta."""
        step, sha = self.last_uploaded or (-1, "")
        marker = {"state": "finished", "last_local_step": step, "last_delta_sha256": sha}
        marker |= {"local_step": local_step, "uploads": self.counters.uploads}
        if self._carry is not None:
            marker["steps_never_uploaded"] = self._carry.steps
        what = f"final marker (last delta at local step {step})"
        write_marker(
            self.transport, self.s.node_id, marker, what, "the master waits for it until drain_timeout"
        )

    # ---- checkpoints

    def carry_state(self) -> dict | None:
        c = self._carry
        if c is None:
            return None
        delta = {k: t.clone() for k, t in c.delta.items()}
        return {"delta": delta, "base_outer_step": c.meta.base_outer_step, "steps": c.steps}

    def resume_identity(self, last: list | None) -> None:
        """A checkpoint's last upload, [local step, payload SHA-256] (what `mark_finished` names)."""
        if last:
            self.last_uploaded = (int(last[0]), str(last[1]))

    def resume(self, baseline: Snapshot, steps_since_capture: int, carry: dict | None) -> None:
        """A checkpoint's inner loop: its baseline (copied to the CPU), the steps since it and its carry."""
        self._baseline = {k: t.detach().to("cpu", copy=True) for k, t in baseline.items()}
        self._steps_since_capture = steps_since_capture
        if carry:
            meta = DeltaMeta(self.s.node_id, 0, int(carry["base_outer_step"]))
            self._carry = DeltaJob(0, "", meta, int(carry["steps"]), delta=dict(carry["delta"]))

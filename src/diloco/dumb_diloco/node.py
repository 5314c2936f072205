"""A DumbDiLoCo node (master or worker): the seven steps after each optimizer step, and its two lanes.

After each optimizer step (1) `Node.on_step` receives the local step (2); at a boundary
(local_step % inner_steps == 0; or every H x pace steps, `dynamic_local_steps`) it takes the cumulative pseudo-gradient float32(baseline) -
float32(weights), plus any delta whose upload failed (3), uploads it as
nodes/<node_id>/delta_<local_step>.safetensors (4), polls for a newer global (5; between boundaries at
most once per poll_interval), installs a compatible one (6) and tells the trainer to reset its inner
optimizer (7). Invariants: no local progress is lost (a failed upload is carried into the next delta);
a global is installed only right after a boundary captured the progress; the training thread copies
the weights once per boundary, the upload lane subtracts/encodes/writes and the poll lane downloads
(`async_*: false` runs them inline); a boundary that finds an upload in flight is skipped and its
progress stays in the next cumulative delta. Prose: docs/dumb_diloco.md ("Node lifecycle").
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diloco.model import weights_sha256

from .budget import PaceCheck
from .delta_codec import DeltaCodec
from .install import translate
from .lanes import Buffers, DeltaJob, OwnCopy
from .master import OuterLoop
from .progress import GlobalProgress
from .recovery import GlobalSnapshot, MasterState, delta_layout, state_layout
from .repo_paths import delta_path
from .settings import DumbDiLoCoError, Settings
from .startup import GlobalReader
from .tensor_format import DeltaMeta, InvalidTensorFile, parse_header
from .transport import HubTransport, PermanentError, RemoteNotFound, Transport

log = logging.getLogger("diloco.dumb_diloco")


@dataclass
class StepResult:
    reset_optimizer: bool = False  # step 7: the trainer must clear the inner optimizer's state
    installed: bool = False
    metrics: dict[str, float] | None = None


_COUNTERS = ("installs", "uploads", "upload_failures", "skipped_boundaries", "poll_failures", "boundaries")
_COUNTERS += ("rejected_globals", "bytes_uploaded", "bytes_downloaded", "stall_seconds")
_COUNTERS += ("boundary_stall_seconds",)


class Node:
    """One node's side of DumbDiLoCo around the live model (see the module docstring); strategy.py adds
    the trainer's lifecycle (start, finish, state, summary, close)."""

    def __init__(
        self,
        model: torch.nn.Module,
        settings: Settings,
        transport: Transport | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,  # its state is cleared after an install (step 7)
        num_workers: int = 1,  # the run's node count, for effective_step / total_samples / tokens_seen
        tokens_per_step: int = 0,
        samples_per_step: int = 0,
        hf_config: dict | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if settings.role == "single":
            raise ValueError("role=single has no node (it trains like distributed=none)")
        self.model, self.s, self.transport = model, settings, transport
        self.optimizer, self.num_workers = optimizer, num_workers
        self.global_progress = GlobalProgress(settings.node_id, num_workers, settings.budget == "global")
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.hf_config = hf_config if settings.publish_hf_config else None
        self.clock, self.sleep = clock, sleep
        state = model.state_dict()
        # the weights this node was built with, before any checkpoint or global: the master publishes
        # its own with every global and a worker refuses to join a master that started elsewhere
        self.init_sha256 = weights_sha256(model)
        self._global_layout = state_layout(state)  # what a global must look like to be installed
        self.delta_keys = list(delta_layout(state))
        self.translating = settings.install == "translate"
        self.codec = DeltaCodec.from_settings(settings)  # float32, or int8/int4 with error feedback
        self.buffers = Buffers(state, self.delta_keys, float32_wire=self.codec.bits is None)  # lanes.py
        # install.translate's state: the last installed global, its newest own delta, the snapshots it lacks
        self.reference: dict[str, torch.Tensor] | None = None
        self.included_step = -1
        self.pending_snapshots: dict[int, dict[str, torch.Tensor]] = {}
        size = sum(t.nbytes for t in state.values())
        self.max_file_bytes = settings.max_file_bytes or 2 * size + 16 * 2**20
        self.state_dir = Path(settings.state_dir).expanduser() / settings.node_id
        self.started = self.closed = False
        self._baseline: dict[str, torch.Tensor] = {}  # model-dtype CPU copies (see OwnCopy)
        self._carry: DeltaJob | None = None  # a failed upload: its delta goes into the next one
        self._steps_since_capture = 0
        self._staged: GlobalSnapshot | None = None
        self._stage_lock = threading.Lock()
        self.reader = GlobalReader(self._global_layout, self.max_file_bytes, self._downloaded)
        self._last_poll = -math.inf
        self.local_step = 0  # the last step the trainer reported
        self._lanes: dict[str, Any] = {}  # "upload", "poll": a one-thread executor or InlineLane
        self._upload: tuple[DeltaJob, Future] | None = None
        self._polling: Future | None = None
        self.outer: OuterLoop | None = None
        self.ckpt_master: MasterState | None = None
        self.state_lock = None  # the master's open <state_dir>/<node_id>/master.lock (flock: one process)
        self._resume: dict | None = None  # a trainer checkpoint taken mid-inner-loop (past the spec)
        self.pace_check = PaceCheck()  # the Hub commit budget at this node's measured pace
        for k in _COUNTERS:
            setattr(self, k, 0.0 if k.endswith("seconds") else 0)
        self.installed_outer_step, self.num_peers, self.last_delta_bytes = -1, 0, 0
        self.last_uploaded: tuple[int, str] | None = None  # (local step, payload SHA-256) of the last delta
        self.final_status = ""  # after finish: what became of this node's final delta
        self.last_upload_seconds = self.max_boundary_stall = 0.0
        self.busy_seconds, self.busy_steps, self._left = 0.0, 0, None  # the trainer's time between steps

    # ---------------------------------------------------------------- the seven steps

    def on_step(self, local_step: int) -> StepResult:
        """Steps 2-7 for the optimizer step the trainer just finished (step 1)."""
        if self.closed or not self.started:
            raise self.s.error(
                "this node was closed; it cannot be started again" if self.closed else "not started"
            )
        if self.outer is not None and self.outer.dead:  # a dead outer loop fails the master's run
            raise self.s.error(f"the outer loop stopped: {self.outer.dead}")
        t0, now = time.perf_counter(), self.clock()
        if self._left is not None:  # the trainer's time for this step, without this node's stalls
            self.busy_seconds, self.busy_steps = self.busy_seconds + now - self._left, self.busy_steps + 1
        self.local_step = local_step  # 2
        self._steps_since_capture += 1
        self._collect_lanes()
        if self.s.dynamic_local_steps:  # Async Local-SGD: H x pace steps since the last capture (progress.py)
            boundary = self._steps_since_capture % self.global_progress.round_steps(self.s.inner_steps) == 0
        else:
            boundary = local_step % self.s.inner_steps == 0
        captured = installed_now = False
        if boundary:
            self.boundaries += 1
            held, cap = len(self.pending_snapshots), self.s.max_pending_snapshots
            if self.uploading or 0 < cap <= held:  # its steps stay in the next cumulative delta
                self.skipped_boundaries += 1
                why = "the previous upload is still in flight" if self.uploading else (
                    f"{held} uploaded deltas are in no global yet (max_pending_snapshots)")  # fmt: skip
                log.warning(f"node {self.s.node_id}: boundary at step {local_step} skipped, {why}")
            else:
                self._collect_lanes()  # an upload that ended since the first collect: its carry counts
                job = self._capture(local_step)  # 3
                if not self.translating and self._install_staged(job):  # 6 before 4: the delta is fixed
                    installed_now = True  # and the snapshot, no longer the baseline, becomes it in place
                self._dispatch(job)  # 4
                captured = True
        if boundary or self.clock() - self._last_poll >= self.s.poll_interval:
            self._last_poll = self.clock()
            self._poll()  # 5
        self._collect_lanes()  # inline lanes (v1) are done already
        if captured and self.s.install_wait_seconds > 0:
            self._await_inclusion(local_step)
        when_staged = self.translating and self.s.install_when_staged  # mid-round: no progress is lost
        installed = ((captured or when_staged) and self._install_staged()) or installed_now  # 6
        stall = time.perf_counter() - t0
        self.stall_seconds += stall
        result = StepResult(installed and self.s.reset_inner_optimizer, installed)  # 7
        if boundary:
            self.boundary_stall_seconds += stall
            self.max_boundary_stall = max(self.max_boundary_stall, stall)
            if isinstance(self.transport, HubTransport) and (
                warn := self.pace_check.boundary(self.s, self.clock())
            ):
                log.warning("node %s: at this node's pace, %s", self.s.node_id, warn)
            result.metrics = self.metrics(stall)
        self._left = self.clock()
        return result

    @property
    def step_micros(self) -> int:
        """This node's busy microseconds per step so far (0 before its second step)."""
        return round(1e6 * self.busy_seconds / self.busy_steps) if self.busy_steps else 0

    @property
    def uploading(self) -> bool:
        return self._upload is not None and not self._upload[1].done()

    @property
    def polling(self) -> bool:
        return self._polling is not None and not self._polling.done()

    def _capture(self, local_step: int) -> DeltaJob:
        """Step 3: one copy of the current weights becomes the new baseline; the job computes the
        cumulative pseudo-gradient float32(old baseline) - float32(snapshot), plus a failed upload's."""
        state = self.model.state_dict()
        snapshot = self.buffers.snapshot(state)
        src, dst = [state[k].detach() for k in self.delta_keys], [snapshot[k] for k in self.delta_keys]
        if all(t.device.type == "cpu" for t in src):
            torch._foreach_copy_(dst, src)  # one fused call
        else:
            for d, t in zip(dst, src):
                d.copy_(t)  # device-to-host, synchronous: the snapshot is complete when this returns
        base, carry, self._baseline, self._carry = self._baseline, self._carry, snapshot, None
        base_outer_step, steps = self.installed_outer_step, self._steps_since_capture
        if carry is not None:
            base_outer_step, steps = min(base_outer_step, carry.meta.base_outer_step), steps + carry.steps
        self._steps_since_capture = 0
        meta = DeltaMeta(
            self.s.node_id,
            local_step,
            max(base_outer_step, 0),
            steps * self.tokens_per_step,
            steps * self.samples_per_step,
            step_micros=self.step_micros if self.s.dynamic_local_steps else 0,  # for the others' paces
        )
        path, delta = delta_path(self.s.node_id, local_step), carry.delta if carry is not None else None
        if self.translating:
            self.pending_snapshots[local_step] = snapshot  # until an installed global includes its delta
        return DeltaJob(
            local_step, path, meta, steps, base, snapshot, carry=delta, new_file=self.buffers.new_file
        )

    def _dispatch(self, job: DeltaJob) -> None:
        self._upload = (job, self._lanes["upload"].submit(self._send, job))

    def _send(self, job: DeltaJob) -> tuple[int, str]:
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

    def _upload_done(self, job: DeltaJob, future: Future) -> None:
        self.last_upload_seconds = job.seconds
        if not self.translating:  # translating: the base may be a snapshot translate still needs
            self.buffers.keep(job.free)
        job.free = None
        if (err := future.exception()) is None:
            if job.in_place and job.file is not None:  # the uploaded delta's buffer: a snapshot again
                self.buffers.keep(OwnCopy.of_file(job.file))
            job.file = None
            n, sha = future.result()
            self.last_uploaded = (job.local_step, sha)
            self.uploads, self.last_delta_bytes = self.uploads + 1, n
            self.bytes_uploaded += n
            log.info(f"node {self.s.node_id}: uploaded {job.path} ({n} bytes, {job.seconds:.2f}s)")
            return
        self.upload_failures += 1
        self._fail_fast(err, f"uploading {job.path}")
        self.pending_snapshots.pop(job.local_step, None)  # no global will include it: the next delta does
        job.materialize()  # already done unless the failure came before the subtraction
        self._carry = job  # one job in flight: a capture took the previous carry into this job
        log.warning(
            f"node {self.s.node_id}: upload of {job.path} failed ({_describe(err)}); its progress goes "
            "into the next delta"
        )

    def _await_inclusion(self, local_step: int) -> None:
        """Past the spec (`install_wait_seconds`): wait at most that long for a global that includes the delta
        captured at `local_step`, so that a node ahead of the others does not train on without it (bounded
        staleness; nodes in time make synchronous DiLoCo's round). A failed upload ends the wait."""
        deadline = self.clock() + self.s.install_wait_seconds
        while self._carry is None and self.clock() < deadline:
            if (staged := self._staged) is not None and staged.included.get(self.s.node_id, -1) >= local_step:
                return
            self.sleep(min(0.05, self.s.poll_interval))
            if self.clock() - self._last_poll >= self.s.poll_interval:
                self._last_poll = self.clock()
                self._poll()
            self._collect_lanes()

    def _poll(self) -> bool:
        """Step 5 (False if a poll is still in flight). The master's globals come from its own outer
        loop (the snapshot callback) instead."""
        if self.s.is_master or self.polling:
            return False
        self._collect_lanes()
        self._polling = self._lanes["poll"].submit(self.fetch_global)
        return True

    def _collect_lanes(self) -> None:
        if self._upload is not None and self._upload[1].done():
            (job, future), self._upload = self._upload, None
            self._upload_done(job, future)
        if self._polling is not None and self._polling.done():
            future, self._polling = self._polling, None
            if (err := future.exception()) is not None:
                self._fetch_failed(err)
            elif (snapshot := future.result()) is not None:
                self.stage(snapshot)

    # ---------------------------------------------------------------- globals

    def _downloaded(self, n: int) -> None:
        self.bytes_downloaded += n

    def fetch_global(self) -> GlobalSnapshot | None:
        """A global newer than the installed/staged one (reader.GlobalReader), None if there is none."""
        try:
            return self.reader.fetch(self.transport, self.newest_known())
        except InvalidTensorFile:
            self.rejected_globals += 1
            raise

    def _safe_fetch(self) -> GlobalSnapshot | None:
        try:
            return self.fetch_global()
        except Exception as err:  # a poll never kills training
            self._fetch_failed(err)
            return None

    def _fail_fast(self, err: BaseException, what: str) -> None:
        """A refused token or a repository gone (issue 12): the node stops with one line, not train alone."""
        if isinstance(err, PermanentError) or (isinstance(err, RemoteNotFound) and what.startswith("upload")):
            raise self.s.error(f"{what} failed for a reason retrying will not fix: {_describe(err)}")

    def _fetch_failed(self, err: BaseException) -> None:
        self._fail_fast(err, "polling for a global")
        if isinstance(err, InvalidTensorFile):
            log.error("node %s: not installing the repository's global: %s", self.s.node_id, err.reason)
        else:
            self.poll_failures += 1
            log.warning(f"node {self.s.node_id}: polling for a global failed ({_describe(err)}); will retry")

    def newest_known(self) -> int:
        staged = self._staged
        return max(self.installed_outer_step, staged.outer_step if staged is not None else -1)

    def stage(self, snapshot: GlobalSnapshot) -> None:
        """Keep the newest global for the training thread (called from any thread)."""
        with self._stage_lock:
            if self._staged is None or snapshot.outer_step > self._staged.outer_step:
                self._staged = snapshot

    def check_layout(self, state: dict[str, torch.Tensor], what: str) -> None:
        got = state_layout(state)
        if got != self._global_layout:
            diff = sorted(set(got) ^ set(self._global_layout)) or [
                k for k in got if got[k] != self._global_layout[k]
            ]
            raise DumbDiLoCoError(
                f"{what} does not match this model (keys, shapes or dtypes differ, e.g. {diff[:3]})"
            )

    def _install_staged(self, job: DeltaJob | None = None) -> bool:
        """Step 6, on the training thread: copy a staged newer global into the live model. `job`: the
        boundary's upload, not yet dispatched (`replace`): its snapshot, which the global replaces as the
        baseline, becomes its delta in place."""
        with self._stage_lock:
            snapshot, self._staged = self._staged, None
        if snapshot is None or snapshot.outer_step <= self.installed_outer_step:
            return False
        try:
            self.check_layout(snapshot.state, f"global outer step {snapshot.outer_step}")
        except DumbDiLoCoError as err:
            self.rejected_globals += 1
            log.error("node %s: not installing: %s", self.s.node_id, err)
            return False
        if self.translating and self.reference is not None:
            translate(self, snapshot)  # install.py: the node's own progress stays on top of the global
        else:
            with torch.no_grad():
                for k, t in self.model.state_dict().items():
                    t.copy_(snapshot.state[k])
            if job is not None and self._baseline is job.snapshot:
                job.in_place = job.snapshot.file is not None
            elif not self.translating:  # a job that reads it ends before the next capture takes it
                self.buffers.keep(self._baseline)
            self._baseline = {k: snapshot.state[k] for k in self.delta_keys}  # the snapshot is never mutated
            self.reference, self.pending_snapshots = dict(self._baseline), {}
            self.included_step = snapshot.included.get(self.s.node_id, -1)
            self._steps_since_capture = 0
        self.installed_outer_step, self.num_peers = snapshot.outer_step, snapshot.num_peers
        self.global_progress.installed(
            snapshot.included, self.local_step, snapshot.step_micros, self.step_micros
        )
        self.installs += 1
        log.info("node %s: installed global outer step %d", self.s.node_id, snapshot.outer_step)
        return True

    # ---------------------------------------------------------------- metrics, state, shutdown

    def metrics(self, stall: float | None = None) -> dict[str, float]:
        comm = "bytes_uploaded bytes_downloaded total_bytes uploads upload_failures skipped_boundaries poll_failures"
        m = {
            "outer/step": self.installed_outer_step,
            "outer/installs": self.installs,
            "outer_lr": self.s.outer_lr,
            "num_peers": self.num_peers,
            "comm/delta_bytes": self.last_delta_bytes,
            "comm/upload_seconds": self.last_upload_seconds,
            "comm/stall_seconds_total": self.stall_seconds,
        }
        m |= {f"comm/{k}": getattr(self, k) for k in comm.split()}
        m |= {"comm/boundary_stall_seconds": stall} if stall is not None else {}
        if self.codec.bits:  # ||Q(v) - v|| / ||v|| of the last delta encoded (like DiLoCo's)
            m["comm/cast_rel_error"] = self.codec.rel_error
        if (o := self.outer) is not None:
            m |= {
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
        return m

    @property
    def total_bytes(self) -> int:
        outer = self.outer.bytes_uploaded + self.outer.bytes_downloaded if self.outer is not None else 0
        return self.bytes_uploaded + self.bytes_downloaded + outer


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]

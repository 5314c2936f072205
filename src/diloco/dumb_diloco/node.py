"""A DumbDiLoCo node (master or worker) and `DumbDiLoCo`, the trainer's strategy around it.

After each optimizer step (1) `Node.on_step` receives the local step (2); at a boundary
(local_step % inner_steps == 0) it takes the cumulative pseudo-gradient float32(baseline) -
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

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import nullcontext
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

import torch

from diloco.config import ConfigError, check_dumb_diloco, typed
from diloco.model import weights_sha256
from diloco.schema import DumbDiLoCoConfig

from .master import OuterLoop
from .reader import GlobalMismatch, GlobalReader
from .recovery import (
    GlobalSnapshot,
    MasterState,
    delta_layout,
    lease_holder,
    load_published_state,
    read_lease,
    recover,
    state_layout,
)
from .tensor_format import DeltaMeta, InvalidTensorFile, delta_path, encode, pseudo_gradient
from .transport import (
    HubTransport,
    RemoteNotFound,
    RetryPolicy,
    TransientError,
    Transport,
    TransportError,
    check_commit_budget,
    open_transport,
)

log = logging.getLogger("diloco.dumb_diloco")


class DumbDiLoCoError(ConfigError):
    """A node that cannot take part (bad setting, unreachable repository, no master): one readable line.
    A ConfigError, so the trainer prints it as `error: ...` instead of a traceback."""


@dataclass
class Settings(DumbDiLoCoConfig):
    """The `distributed:` block of a DumbDiLoCo node, checked (keys and defaults: diloco.schema)."""

    def __post_init__(self) -> None:
        if not self.enabled:
            self.role = "single"
        if isinstance(self.collaborators, str) or not hasattr(self.collaborators, "__iter__"):
            raise ConfigError(_COLLABORATORS + f"got {self.collaborators!r}")
        self.collaborators = tuple(self.collaborators)
        self.repo_id = self.repo_id.strip() if isinstance(self.repo_id, str) else self.repo_id
        self.state_dir = str(self.state_dir)
        if not isinstance(self.retry, RetryPolicy):
            try:
                self.retry = RetryPolicy(**(self.retry if isinstance(self.retry, dict) else vars(self.retry)))
            except TypeError as err:
                raise ConfigError(f"distributed.retry: {err}") from None
        check_dumb_diloco(self)

    @classmethod
    def from_config(cls, dcfg: Any) -> Settings:
        """Validate a config block (DictConfig or dict); raise ConfigError naming the key."""
        if (mode := dcfg.get("mode", "dumb_diloco")) != "dumb_diloco":
            raise ConfigError(f"distributed.mode must be dumb_diloco here, got {mode!r}")
        if isinstance(dcfg.get("collaborators"), str):  # before OmegaConf turns the string away
            raise ConfigError(_COLLABORATORS + f"got {dcfg.get('collaborators')!r}")
        block = typed(dcfg, DumbDiLoCoConfig, "distributed.")
        s = cls(**{f.name: getattr(block, f.name) for f in dataclass_fields(DumbDiLoCoConfig)})
        if s.token is not None and s.role != "single":
            log.warning(
                "distributed.token is set in the config: prefer the HF_TOKEN environment variable or "
                "`hf auth login`, and never commit a token to a config file (it is not logged or saved)"
            )
        return s

    @property
    def is_master(self) -> bool:
        return self.role == "master"


_COLLABORATORS = "distributed.collaborators must be a list of node IDs, e.g. '[worker-1,worker-2]', "


class _Inline:
    """`async_*: false` (v1): a lane whose job runs on the training thread, at once."""

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as err:  # reported like a background job's failure
            future.set_exception(err)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


class _Snapshot(dict):
    """Model-dtype CPU copies that this node allocated (reusable once no baseline or job refers to
    them); an installed global's tensors are never reused."""


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

    def materialize(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """The delta, and the base's buffers when they are free for reuse. Idempotent."""
        if self.delta is not None:
            return self.delta, None
        delta = pseudo_gradient(self.base, self.snapshot)
        for k, t in (self.carry or {}).items():
            delta[k].add_(t)
        free = self.base if isinstance(self.base, _Snapshot) else None
        self.delta, self.base, self.snapshot, self.carry = delta, None, None, None
        return delta, free


@dataclass
class StepResult:
    reset_optimizer: bool = False  # step 7: the trainer must clear the inner optimizer's state
    installed: bool = False
    metrics: dict[str, float] | None = None


_COUNTERS = (
    "installs",
    "uploads",
    "upload_failures",
    "skipped_boundaries",
    "poll_failures",
    "rejected_globals",
)
_COUNTERS += ("bytes_uploaded", "bytes_downloaded", "boundaries", "stall_seconds", "boundary_stall_seconds")


class Node:
    """One node's side of DumbDiLoCo around a live model: see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        settings: Settings,
        transport: Transport | None = None,
        *,
        tokens_per_step: int = 0,
        samples_per_step: int = 0,
        hf_config: dict | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if settings.role == "single":
            raise ValueError("role=single has no node (it trains like distributed=none)")
        self.model, self.s, self.transport = model, settings, transport
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.hf_config = hf_config if settings.publish_hf_config else None
        self._clock, self._sleep = clock, sleep
        state = model.state_dict()
        # the weights this node was built with, before any checkpoint or global: the master publishes
        # its own with every global and a worker refuses to join a master that started elsewhere
        self.init_sha256 = weights_sha256(model)
        self._global_layout = state_layout(state)  # what a global must look like to be installed
        self._delta_keys = list(delta_layout(state))
        self.max_file_bytes = (
            settings.max_file_bytes or 2 * sum(t.nbytes for t in state.values()) + 16 * 2**20
        )
        self.state_dir = Path(settings.state_dir).expanduser() / settings.node_id
        self.started = self.closed = False
        self._baseline: dict[str, torch.Tensor] = {}  # model-dtype CPU copies (see _Snapshot)
        self._carry: DeltaJob | None = None  # a failed upload: its delta goes into the next one
        # free snapshot buffers (a baseline the upload lane subtracted, or one an install replaced); taken
        # only at a capture, which needs an idle upload lane, so no job still reads them (at most 2)
        self._free: list[_Snapshot] = []
        self._steps_since_capture = 0
        self._staged: GlobalSnapshot | None = None
        self._stage_lock = threading.Lock()
        self.reader = GlobalReader(self._global_layout, self.max_file_bytes, self._downloaded)
        self._last_poll = -math.inf
        self.local_step = 0  # the last step the trainer reported
        self._lanes: dict[str, Any] = {}  # "upload", "poll": a one-thread executor or _Inline
        self._upload: tuple[DeltaJob, Future] | None = None
        self._polling: Future | None = None
        self.outer: OuterLoop | None = None
        self._ckpt_master: MasterState | None = None
        self._resume: dict | None = None  # a trainer checkpoint taken mid-inner-loop (past the spec)
        self._first_boundary_time: float | None = None
        self._budget_checked = False
        for k in _COUNTERS:
            setattr(self, k, 0.0 if k.endswith("seconds") else 0)
        self.installed_outer_step, self.num_peers, self.last_delta_bytes = -1, 0, 0
        self.last_upload_seconds = self.max_boundary_stall = 0.0

    # ---------------------------------------------------------------- start-up

    def _fail(self, message: str) -> DumbDiLoCoError:
        return DumbDiLoCoError(f"{'master' if self.s.is_master else 'node'} {self.s.node_id}: {message}")

    def connect(self) -> None:
        """Open the repository. A worker waits (up to startup_timeout) for the master's first global and
        stages it; the master creates the repository (private, on the Hub)."""
        s = self.s
        if self.transport is not None and (s.is_master or self._newest_known() >= 0):
            return  # already connected (and, a worker, holding a global)
        deadline, announced, rejected = self._clock() + s.startup_timeout, False, ""
        while True:
            try:
                if self.transport is None:
                    try:
                        self.transport = open_transport(
                            s.repo_id,
                            token=s.token,
                            create=s.is_master,
                            retry=s.retry,
                            timeout_s=s.request_timeout,
                        )
                    except ValueError as err:
                        raise DumbDiLoCoError(f"distributed.repo_id: {err}") from None
                if s.is_master:
                    return
                if (snapshot := self.fetch_global()) is not None:
                    self._check_same_start()
                    self._stage(snapshot)
                    return
                waiting_for = "the master's first global model"
            except (RemoteNotFound, TransientError) as err:
                if s.is_master:
                    raise self._fail(f"cannot open {s.repo_id}: {err}") from None
                waiting_for = f"the repository ({err})"
            except TransportError as err:
                raise self._fail(f"cannot {'open' if s.is_master else 'read'} {s.repo_id}: {err}") from None
            except GlobalMismatch as err:
                raise self._fail(
                    f"the global model in {s.repo_id} is not this model ({err.reason}); use the same model "
                    "config as the master, or another repo_id"
                ) from None
            except InvalidTensorFile as err:
                rejected = err.reason
            if rejected:
                waiting_for = f"a valid global model (the newest was rejected: {rejected})"
            if (remaining := deadline - self._clock()) <= 0:
                raise self._fail(
                    f"no global model in {s.repo_id} after {s.startup_timeout:g}s (waiting for {waiting_for}); "
                    "start the master (distributed.role=master) with the same distributed.repo_id, or raise "
                    "distributed.startup_timeout"
                )
            if not announced:
                log.info("node %s: waiting for %s in %s", s.node_id, waiting_for, s.repo_id)
                announced = True
            self._sleep(min(s.poll_interval, 2.0, remaining))

    def _check_same_start(self) -> None:
        """A worker built with other initial weights than the master's (another seed, model config or
        transformers version) would compute deltas for another model: stop, naming both hashes."""
        theirs = self.reader.step_info.get("init_sha256")
        if theirs is not None and theirs != self.init_sha256:
            raise self._fail(
                f"initial weights differ from the master's (sha256 {self.init_sha256} here, {theirs} on "
                f"{self.reader.step_info.get('master', 'the master')}): use the master's seed, model config "
                "and transformers version"
            )

    def start(self) -> None:
        """Once the trainer has restored its checkpoint, before the first forward pass: connect, continue
        from the latest global (or the checkpoint's inner loop), start the lanes and the master's loop."""
        if self.closed:
            raise self._fail("this node was closed; it cannot be started again")
        if self.started:
            return
        self.connect()
        if self.s.is_master:
            self._start_master()
        elif (newer := self._safe_fetch()) is not None:
            self._stage(newer)
        if self._resume is not None:
            self._resume_inner_loop()
        elif not self._install_staged():
            raise self._fail("the global model cannot be installed into this model")
        for lane, on in (("upload", self.s.async_delta_upload), ("poll", self.s.async_global_poll)):
            on = on and not (lane == "poll" and self.s.is_master)
            self._lanes[lane] = (
                ThreadPoolExecutor(1, f"dumb-diloco-{lane}-{self.s.node_id}") if on else _Inline()
            )
        self._last_poll = self._clock()
        self.started = True
        log.info(
            "node %s (%s, %s upload, %s poll): starting from global outer step %d, a delta every %d steps",
            self.s.node_id, self.s.role, "async" if self.s.async_delta_upload else "sync",
            "callback" if self.s.is_master else "async" if self.s.async_global_poll else "sync",
            self.installed_outer_step, self.s.inner_steps,
        )  # fmt: skip

    def _start_master(self) -> None:
        """Recover the state (recovery.recover), publish it if the repository is behind, start the loop."""
        s = self.s
        if s.lease_seconds > 0:  # single-master lease (past the spec)
            try:
                other = lease_holder(self.transport, s.node_id, s.lease_seconds, time.time())
                lease = read_lease(self.transport)
            except TransportError as err:
                raise self._fail(f"cannot read {s.repo_id}: {err}") from None
            if other is not None:
                raise self._fail(
                    f"{s.repo_id} is held by master {other[0]!r} (lease heartbeat {other[1]:.0f}s ago, "
                    f"lease_seconds {s.lease_seconds:g}); run one master per repository, or start this one "
                    "after that master stopped and its lease expired"
                )
            if lease is not None and lease.get("master") != s.node_id:
                log.warning("master %s: taking over %s from master %r (its lease expired)", s.node_id, s.repo_id,
                            lease.get("master"))  # fmt: skip
        try:
            local = MasterState.load(self.state_dir)
        except (OSError, ValueError, InvalidTensorFile) as err:
            raise DumbDiLoCoError(f"master state in {self.state_dir} is unreadable: {err}") from None
        for saved in (local, self._ckpt_master):
            if saved is not None:
                self._check_layout(saved.published(), f"the master state in {self.state_dir}")
        try:
            repo = self.fetch_global()
        except GlobalMismatch as err:
            raise self._fail(f"the global model in {s.repo_id} is not this model ({err.reason}); "
                             "use the model config of that run, or another repo_id") from None  # fmt: skip
        except InvalidTensorFile as err:
            log.warning("master: the repository's global is corrupt (%s); it will be replaced", err)
            repo = None
        except TransportError as err:
            raise self._fail(f"cannot read {s.repo_id}: {err}") from None

        def published(outer_step: int):
            if not s.publish_master_state:
                return None
            try:
                sha = self.reader.step_info.get("global_sha256", "")
                return load_published_state(self.transport, outer_step, sha, self.max_file_bytes)
            except TransportError as err:
                raise self._fail(f"cannot read {s.repo_id}: {err}") from None

        corrupt = max((k for k, _ in self.reader.rejected), default=-1)
        state, publish, adopted = recover(local, self._ckpt_master, repo, self.reader.step_info, published,
                                          self.model.state_dict(), corrupt)  # fmt: skip
        self.outer = OuterLoop(
            self.transport, state, node_id=s.node_id, collaborators=s.collaborators, outer_lr=s.outer_lr,
            outer_momentum=s.outer_momentum, poll_interval=s.poll_interval, state_dir=self.state_dir,
            max_file_bytes=self.max_file_bytes, on_snapshot=self._stage, hf_config=self.hf_config,
            min_deltas_per_round=s.min_deltas_per_round, staleness_weighting=s.staleness_weighting,
            delayed_nesterov_period=s.delayed_nesterov_period if s.delayed_nesterov else 0,
            publish_state=s.publish_master_state, keep_deltas=s.keep_deltas, lease_seconds=s.lease_seconds,
            init_sha256=self.init_sha256,
        )  # fmt: skip
        if adopted:
            n = self.outer.mark_existing_as_processed()
            log.warning("master: no local master state; adopted global outer step %d from %s and treat its %d "
                        "existing delta(s) as already processed", state.outer_step, s.repo_id, n)  # fmt: skip
        if publish:
            self.outer.publish()
            log.info("master: published global outer step %d to %s", state.outer_step, s.repo_id)
        else:
            self.outer.heartbeat()  # take the lease now (a publication carries it otherwise)
        self.outer.save_state()
        self._stage(self.outer.snapshot())
        self.outer.start()

    # ---------------------------------------------------------------- the seven steps

    def on_step(self, local_step: int) -> StepResult:
        """Steps 2-7 for the optimizer step the trainer just finished (step 1)."""
        if self.closed or not self.started:
            raise self._fail(
                "this node was closed; it cannot be started again" if self.closed else "not started"
            )
        t0 = time.perf_counter()
        self.local_step = local_step  # 2
        self._steps_since_capture += 1
        self._collect_lanes()
        boundary, captured = local_step % self.s.inner_steps == 0, False
        if boundary:
            self.boundaries += 1
            if self.uploading:
                self.skipped_boundaries += 1
                log.warning("node %s: boundary at step %d skipped, the previous upload is still in flight (its "
                            "progress stays in the next cumulative delta)", self.s.node_id, local_step)  # fmt: skip
            else:
                job = self._capture(local_step)  # 3
                self._upload = (job, self._lanes["upload"].submit(self._send, job))  # 4
                captured = True
        if boundary or self._clock() - self._last_poll >= self.s.poll_interval:
            self._last_poll = self._clock()
            self._poll()  # 5
        self._collect_lanes()  # inline lanes (v1) are done already
        installed = captured and self._install_staged()  # 6
        stall = time.perf_counter() - t0
        self.stall_seconds += stall
        result = StepResult(installed and self.s.reset_inner_optimizer, installed)  # 7
        if boundary:
            self.boundary_stall_seconds += stall
            self.max_boundary_stall = max(self.max_boundary_stall, stall)
            self._check_commit_budget()
            result.metrics = self.metrics(stall)
        return result

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
        snapshot = self._free.pop() if self._free else None
        if snapshot is None:
            snapshot = _Snapshot({k: torch.empty_like(state[k], device="cpu") for k in self._delta_keys})
        src, dst = [state[k].detach() for k in self._delta_keys], [snapshot[k] for k in self._delta_keys]
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
        meta = DeltaMeta(self.s.node_id, local_step, max(base_outer_step, 0), steps * self.tokens_per_step,
                         steps * self.samples_per_step)  # fmt: skip
        job = DeltaJob(local_step, delta_path(self.s.node_id, local_step), meta, steps, base, snapshot)
        job.carry = carry.delta if carry is not None else None
        return job

    def _send(self, job: DeltaJob) -> int:
        """Step 4, on the upload lane: subtract, encode, write."""
        t0 = time.perf_counter()
        try:
            delta, free = job.materialize()
            if free is not None:
                self._free.append(free)  # the training thread takes it at the next capture, after this job
            blob = encode(delta, job.meta.to_header())
            self.transport.write(
                {job.path: blob}, message=f"{self.s.node_id}: delta at local step {job.local_step}"
            )
            return len(blob)
        finally:
            job.seconds = time.perf_counter() - t0

    def _upload_done(self, job: DeltaJob, future: Future) -> None:
        self.last_upload_seconds = job.seconds
        if (err := future.exception()) is None:
            n = future.result()
            self.uploads, self.bytes_uploaded, self.last_delta_bytes = (
                self.uploads + 1,
                self.bytes_uploaded + n,
                n,
            )
            log.info("node %s: uploaded %s (%d bytes, %.2fs)", self.s.node_id, job.path, n, job.seconds)
            return
        self.upload_failures += 1
        job.materialize()  # already done unless the failure came before the subtraction
        self._carry = job  # one job in flight: a capture took the previous carry into this job
        log.warning("node %s: upload of %s failed (%s); its progress goes into the next delta", self.s.node_id,
                    job.path, _describe(err))  # fmt: skip

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
                self._stage(snapshot)

    # ---------------------------------------------------------------- globals

    def _downloaded(self, n: int) -> None:
        self.bytes_downloaded += n

    def fetch_global(self) -> GlobalSnapshot | None:
        """A global newer than the installed/staged one (reader.GlobalReader), None if there is none."""
        try:
            return self.reader.fetch(self.transport, self._newest_known())
        except InvalidTensorFile:
            self.rejected_globals += 1
            raise

    def _safe_fetch(self) -> GlobalSnapshot | None:
        try:
            return self.fetch_global()
        except Exception as err:  # a poll never kills training
            self._fetch_failed(err)
            return None

    def _fetch_failed(self, err: BaseException) -> None:
        if isinstance(err, InvalidTensorFile):
            log.error("node %s: not installing the repository's global: %s", self.s.node_id, err.reason)
        else:
            self.poll_failures += 1
            log.warning(
                "node %s: polling for a global failed (%s); will retry", self.s.node_id, _describe(err)
            )

    def _newest_known(self) -> int:
        staged = self._staged
        return max(self.installed_outer_step, staged.outer_step if staged is not None else -1)

    def _stage(self, snapshot: GlobalSnapshot) -> None:
        """Keep the newest global for the training thread (called from any thread)."""
        with self._stage_lock:
            if self._staged is None or snapshot.outer_step > self._staged.outer_step:
                self._staged = snapshot

    def _check_layout(self, state: dict[str, torch.Tensor], what: str) -> None:
        got = state_layout(state)
        if got != self._global_layout:
            diff = sorted(set(got) ^ set(self._global_layout)) or [
                k for k in got if got[k] != self._global_layout[k]
            ]
            raise DumbDiLoCoError(
                f"{what} does not match this model (keys, shapes or dtypes differ, e.g. {diff[:3]})"
            )

    def _install_staged(self) -> bool:
        """Step 6, on the training thread: copy a staged newer global into the live model."""
        with self._stage_lock:
            snapshot, self._staged = self._staged, None
        if snapshot is None or snapshot.outer_step <= self.installed_outer_step:
            return False
        try:
            self._check_layout(snapshot.state, f"global outer step {snapshot.outer_step}")
        except DumbDiLoCoError as err:
            self.rejected_globals += 1
            log.error("node %s: not installing: %s", self.s.node_id, err)
            return False
        with torch.no_grad():
            for k, t in self.model.state_dict().items():
                t.copy_(snapshot.state[k])
        if isinstance(self._baseline, _Snapshot):  # reusable once the job in flight (if any) is done
            self._free.append(self._baseline)
        self._baseline = {k: snapshot.state[k] for k in self._delta_keys}  # the snapshot is never mutated
        self._steps_since_capture = 0
        self.installed_outer_step, self.num_peers = snapshot.outer_step, snapshot.num_peers
        self.installs += 1
        log.info("node %s: installed global outer step %d", self.s.node_id, snapshot.outer_step)
        return True

    # ---------------------------------------------------------------- metrics, state, shutdown

    def _check_commit_budget(self) -> None:
        """Warn once if this node alone would exceed the Hub's commit rate limit."""
        if self._budget_checked or not isinstance(self.transport, HubTransport):
            return
        now = self._clock()
        if self._first_boundary_time is None:
            self._first_boundary_time = now
            return
        self._budget_checked = True
        if warning := check_commit_budget(1, max(now - self._first_boundary_time, 1e-3)):
            log.warning("node %s: %s", self.s.node_id, warning)

    def metrics(self, stall: float | None = None) -> dict[str, float]:
        comm = ("bytes_uploaded", "bytes_downloaded", "total_bytes", "uploads", "upload_failures")
        comm += ("skipped_boundaries", "poll_failures")
        m = {"outer/step": self.installed_outer_step, "outer/installs": self.installs, "outer_lr": self.s.outer_lr,
             "num_peers": self.num_peers, "comm/delta_bytes": self.last_delta_bytes,
             "comm/upload_seconds": self.last_upload_seconds, "comm/stall_seconds_total": self.stall_seconds}  # fmt: skip
        m |= {f"comm/{k}": getattr(self, k) for k in comm}
        if stall is not None:
            m["comm/boundary_stall_seconds"] = stall
        if (o := self.outer) is not None:
            m |= {"outer/master_step": o.state.outer_step, "outer/rounds": o.rounds, "outer/errors": o.errors,
                  "outer/deltas_accepted": o.deltas_accepted, "outer/deltas_rejected": o.deltas_rejected,
                  "outer/pseudo_grad_norm": o.last_pseudo_grad_norm, "outer/pending_deltas": o.pending}  # fmt: skip
        return m

    @property
    def total_bytes(self) -> int:
        outer = self.outer.bytes_uploaded + self.outer.bytes_downloaded if self.outer is not None else 0
        return self.bytes_uploaded + self.bytes_downloaded + outer

    def summary(self) -> dict:
        """Final figures (pure: what was counted so far; `close` first to count the in-flight work)."""
        return self.metrics() | {
            "comm/boundary_stall_seconds": self.boundary_stall_seconds,
            "comm/boundary_stall_seconds_mean": self.boundary_stall_seconds / max(self.boundaries, 1),
            "comm/boundary_stall_seconds_max": self.max_boundary_stall,
            "comm/boundaries": self.boundaries,
            "outer/rejected_globals": self.rejected_globals,
            "dumb_diloco/role": self.s.role,
            "dumb_diloco/node_id": self.s.node_id,
        }

    def state_dict(self) -> dict:
        """Counters, the installed outer step and (master) the full outer state; past the spec, the
        baseline, the steps since it and a failed upload's carry, so that a node restarted from this
        checkpoint continues its inner loop exactly (its next delta is the uninterrupted one)."""
        out: dict = {k: getattr(self, k) for k in _COUNTERS}
        out |= {"installed_outer_step": self.installed_outer_step, "local_step": self.local_step,
                "steps_since_capture": self._steps_since_capture,
                "baseline": {k: t.clone() for k, t in self._baseline.items()}}  # fmt: skip
        if (c := self._carry) is not None:
            delta = {k: t.clone() for k, t in c.delta.items()}
            out["carry"] = {"delta": delta, "base_outer_step": c.meta.base_outer_step, "steps": c.steps}
        if self.outer is not None:
            with self.outer.lock:
                out["master"] = self.outer.state.to_checkpoint()
        return out

    def load_state_dict(self, state: dict) -> None:
        """Before `start`: counters now; the master state and a mid-inner-loop baseline at `start`."""
        for k in _COUNTERS:
            if k in state:
                setattr(self, k, type(getattr(self, k))(state[k]))
        if "master" in state and self.s.is_master:
            self._ckpt_master = MasterState.from_checkpoint(state["master"])
        if state.get("baseline") and (state.get("steps_since_capture") or state.get("carry")):
            self._resume = state  # progress since the last boundary: continue that inner loop exactly
        # else: at a boundary; starting from the newest global is what the uninterrupted node would do

    def _resume_inner_loop(self) -> None:
        """Continue the checkpoint's inner loop: the live model already holds the checkpoint's weights;
        restore the baseline, its global version and the steps since it. A newer global stays staged and
        is installed at the next boundary, after that boundary's delta captured the progress."""
        r, self._resume = self._resume, None
        assert r is not None
        expected = {k: self._global_layout[k] for k in self._delta_keys}
        if {k: (tuple(t.shape), t.dtype) for k, t in r["baseline"].items()} != expected:
            raise self._fail("the checkpoint's DumbDiLoCo baseline is not of this model")
        self._baseline = {k: t.detach().to("cpu", copy=True) for k, t in r["baseline"].items()}
        self.installed_outer_step = int(r["installed_outer_step"])
        self.local_step = int(r.get("local_step", 0))
        self._steps_since_capture = int(r.get("steps_since_capture", 0))
        if c := r.get("carry"):
            meta = DeltaMeta(self.s.node_id, 0, int(c["base_outer_step"]))
            self._carry = DeltaJob(0, "", meta, int(c["steps"]), delta=dict(c["delta"]))
        log.info("node %s: resumed mid-inner-loop at local step %d (baseline of global outer step %d, %d step(s) "
                 "since)", self.s.node_id, self.local_step, self.installed_outer_step, self._steps_since_capture)  # fmt: skip

    def close(self) -> None:
        """Bounded shutdown (idempotent): wait for an in-flight upload and (master) a last outer round."""
        if self.closed:
            return
        self.closed = True
        if self._upload is not None:
            job, future = self._upload
            if wait_futures([future], self.s.shutdown_timeout).not_done:
                log.warning("node %s: %s (%d step(s)) was still uploading after shutdown_timeout %gs; leaving it "
                            "(it may not arrive)", self.s.node_id, job.path, job.steps, self.s.shutdown_timeout)  # fmt: skip
            self._collect_lanes()
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        if self.outer is not None:
            if not self.outer.stop(self.s.drain_seconds, self.s.shutdown_timeout):
                log.warning("master: the outer loop was still running after the shutdown timeout; leaving it")
            self.outer.save_state()
        if self._carry is not None:
            log.warning("node %s: %d step(s) of progress were never uploaded (upload failed)", self.s.node_id,
                        self._carry.steps)  # fmt: skip


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


# --------------------------------------------------------------------------- the trainer's strategy


class DumbDiLoCo:
    """`distributed=dumb_diloco`: the trainer's strategy (diloco.strategy.Strategy) around a Node."""

    name = "dumb_diloco"

    @classmethod
    def from_config(cls, cfg, ctx, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """No I/O and no threads here: `start` connects (a worker without a master fails there)."""
        from diloco.distributed import LocalTraining

        settings = Settings.from_config(cfg.distributed)
        if settings.role == "single":
            return LocalTraining(ctx)
        if ctx.world_size > 1:
            raise ConfigError(
                "distributed=dumb_diloco runs one process per node; start each node with plain `python -m diloco.train`"
            )
        if cfg.data.get("shard") is None:
            log.warning("node %s: data.shard/data.num_shards are not set, so this node reads the same data as "
                        "every other node left at the default; give node i of n `data.shard=i data.num_shards=n`",
                        settings.node_id)  # fmt: skip
        hf_config = json.loads(model.config.to_json_string()) if hasattr(model, "config") else None
        node = Node(model, settings, tokens_per_step=cfg.train.batch_size * cfg.data.seq_len,
                    samples_per_step=cfg.train.batch_size, hf_config=hf_config)  # fmt: skip
        # the run's node count, for effective_step / total_samples / tokens_seen
        return cls(node, optimizer, num_workers=int(cfg.data.get("num_shards") or 1))

    def __init__(self, node: Node, optimizer: torch.optim.Optimizer, num_workers: int = 1):
        self.node, self.optimizer, self.num_workers = node, optimizer, num_workers

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def load_state_dict(self, state: dict) -> None:
        self.node.load_state_dict(state)

    def start(self) -> None:
        self.node.start()  # after any checkpoint restore, before the first forward

    def grad_sync(self, last_micro_step: bool):
        return nullcontext()

    def after_inner_step(self, step: int) -> dict[str, float]:
        result = self.node.on_step(step)
        if result.reset_optimizer:
            self.optimizer.state.clear()
        return result.metrics or {}

    def eval_weights(self, step: int):
        """A node evaluates the weights it holds (the master: the final global, see finish)."""
        return nullcontext()

    def finish(self) -> bool:
        """End of training: the last upload (within shutdown_timeout) and, on the master, the outer loop's
        last round (the workers' last deltas, within drain_seconds), whose global is installed for the final
        evaluation. True when the model changed."""
        n = self.node
        n.close()
        if n.outer is None or (final := n.outer.snapshot()).outer_step <= n.installed_outer_step:
            return False
        with torch.no_grad():
            for k, t in n.model.state_dict().items():
                t.copy_(final.state[k])
        log.info(
            "master: installed the final global (outer step %d) for the final evaluation", final.outer_step
        )
        return True

    def state_dict(self) -> dict:
        return self.node.state_dict()

    def summary(self) -> dict:
        return self.node.summary()

    def close(self) -> None:
        self.node.close()

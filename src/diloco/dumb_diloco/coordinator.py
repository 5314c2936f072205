"""DumbDiLoCo node: the worker lifecycle (spec "Inner-loop lifecycle") and the trainer's strategy.

Every node (master or worker) is one `python -m diloco.train distributed=dumb_diloco ...` process. After
each optimizer step the trainer calls `after_inner_step(step)`, which runs `Coordinator.on_step`, the
spec's seven steps::

    1. the trainer advances the local scheduler (train.py, before the call)
    2. the coordinator receives the new local step
    3. on a boundary (local_step % inner_steps == 0): the cumulative pseudo-gradient
       float32(baseline) - float32(current), plus any earlier delta whose upload failed
    4. upload it to nodes/<node_id>/delta_<local_step>.safetensors
    5. poll for a newer global version (on a boundary, else at most once per poll_interval)
    6. install a compatible global state (keys, shapes, dtypes checked) if one is ready
    7. return whether the trainer must reset the inner optimizer (only after an install)

The baseline is the state at the last upload or global installation; it moves forward when a delta is
taken, and a delta whose upload fails is carried into the next one, so no local progress is ever lost.
A global is installed only at a boundary right after the local progress was captured in a delta:
installing between boundaries would throw that progress away. The master's training thread gets its
globals from its own outer loop (master.py) through a snapshot callback instead of polling.

v2 (default): at a boundary the training thread only copies the weights once, into a snapshot buffer
reused from two boundaries back, and that snapshot becomes the new baseline; a daemon uploader computes
the delta (old baseline - snapshot, plus any carry), encodes and writes it, then hands the old baseline's
buffer back for reuse (one job at a time: a boundary that finds a job in flight is skipped, its progress
stays in the next cumulative delta). A daemon poll lane downloads and validates globals, which the
training thread installs. `async_delta_upload: false` / `async_global_poll: false` restore the v1
behaviour (all I/O on the training thread). Reference: docs/dumb_diloco.md.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

import torch

from diloco.config import ConfigError, check_dumb_diloco, typed
from diloco.model import weights_sha256
from diloco.schema import DumbDiLoCoConfig

from .master import (
    STEP_FILE_MAX_BYTES,
    GlobalSnapshot,
    LedgerEntry,
    MasterState,
    OuterLoop,
    PublishedState,
    delta_layout,
    lease_holder,
    load_published_state,
    read_lease,
    state_layout,
)
from .tensor_format import (
    GLOBAL_STEP_PATH,
    GLOBAL_WEIGHTS_PATH,
    DeltaMeta,
    InvalidTensorFile,
    decode,
    delta_path,
    encode,
    parse_header,
    pseudo_gradient,
)
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


class GlobalMismatch(InvalidTensorFile):
    """A well-formed global of another model (keys, shapes or dtypes): waiting will not fix it."""


# --------------------------------------------------------------------------- settings


@dataclass
class Settings(DumbDiLoCoConfig):
    """The `distributed:` block of a DumbDiLoCo node, checked (keys and defaults: diloco.schema)."""

    def __post_init__(self) -> None:
        if not self.enabled:
            self.role = "single"
        if isinstance(self.collaborators, str) or not hasattr(self.collaborators, "__iter__"):
            raise ConfigError(
                "distributed.collaborators must be a list of node IDs, e.g. '[worker-1,worker-2]', "
                f"got {self.collaborators!r}"
            )
        self.collaborators = tuple(self.collaborators)
        if isinstance(self.repo_id, str):
            self.repo_id = self.repo_id.strip()
        self.state_dir = str(self.state_dir)
        if not isinstance(self.retry, RetryPolicy):
            fields = self.retry if isinstance(self.retry, dict) else vars(self.retry)
            try:
                self.retry = RetryPolicy(**fields)
            except TypeError as err:
                raise ConfigError(f"distributed.retry: {err}") from None
        check_dumb_diloco(self)

    @classmethod
    def from_config(cls, dcfg: Any) -> Settings:
        """Validate a config block (DictConfig or dict); raise ConfigError naming the key."""
        mode = dcfg.get("mode", "dumb_diloco")
        if mode != "dumb_diloco":
            raise ConfigError(f"distributed.mode must be dumb_diloco here, got {mode!r}")
        if isinstance(dcfg.get("collaborators"), str):  # before OmegaConf turns the string away
            raise ConfigError(
                "distributed.collaborators must be a list of node IDs, e.g. '[worker-1,worker-2]', "
                f"got {dcfg.get('collaborators')!r}"
            )
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


def _copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i: one fused call when everything is on the CPU, else per tensor
    (a device-to-host copy, synchronous, so the snapshot is complete when this returns)."""
    if all(t.device.type == "cpu" for t in src):
        torch._foreach_copy_(dst, src)
    else:
        for d, t in zip(dst, src):
            d.copy_(t)


# --------------------------------------------------------------------------- background lanes


class _Snapshot(dict):
    """Model-dtype CPU copies of the delta entries that this coordinator allocated (so it may reuse
    them once no baseline or job refers to them); an installed global's tensors are never reused."""


@dataclass
class DeltaJob:
    """One upload. The training thread fills in base, snapshot and carry (the one copy it makes is the
    snapshot); `materialize` computes the delta, on the uploader thread in v2."""

    local_step: int
    path: str
    meta: DeltaMeta
    steps: int  # optimizer steps the delta covers
    base: dict[str, torch.Tensor] | None = None  # the baseline the delta is taken against
    snapshot: dict[str, torch.Tensor] | None = None  # the weights at this boundary (the new baseline)
    carry: _Carry | None = None  # a failed upload's delta, added to this one
    delta: dict[str, torch.Tensor] | None = None  # float32 pseudo-gradient, owned by the job

    def materialize(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """float32(base) - float32(snapshot) (+ carry). Returns the delta and the base's buffers when
        they are free for reuse (the baseline has moved on to the snapshot). Idempotent."""
        if self.delta is not None:
            return self.delta, None
        delta = pseudo_gradient(self.base, self.snapshot)
        if self.carry is not None:
            for k, t in self.carry.delta.items():
                delta[k].add_(t)
        free = self.base if isinstance(self.base, _Snapshot) else None
        self.delta, self.base, self.snapshot, self.carry = delta, None, None, None
        return delta, free


@dataclass
class _Outcome:
    item: Any
    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0


class Lane:
    """A daemon thread that runs `fn(item)` for one item at a time; the training thread submits items
    and collects outcomes without ever waiting (except in `join` at shutdown)."""

    def __init__(self, name: str, fn: Callable[[Any], Any]):
        self.fn = fn
        self._cv = threading.Condition()
        self._item: Any = None
        self._pending = False
        self._busy = False
        self._outcomes: list[_Outcome] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        with self._cv:
            return self._pending or self._busy

    def submit(self, item: Any = None) -> bool:
        """Hand over `item`; False (nothing done) if the lane is still busy with the previous one."""
        with self._cv:
            if self._pending or self._busy or self._stopped:
                return False
            self._item, self._pending = item, True
            self._cv.notify_all()
            return True

    def outcomes(self) -> list[_Outcome]:
        with self._cv:
            out, self._outcomes = self._outcomes, []
            return out

    def join(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until idle, then stop the thread. False if it was still busy."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while (self._pending or self._busy) and time.monotonic() < deadline:
                self._cv.wait(max(0.0, deadline - time.monotonic()))
            idle = not (self._pending or self._busy)
            self._stopped = True
            self._cv.notify_all()
        return idle

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stopped:
                    self._cv.wait()
                if not self._pending:
                    return
                item, self._pending, self._busy = self._item, False, True
            out = _Outcome(item)
            t0 = time.perf_counter()
            try:
                out.value = self.fn(item)
            except BaseException as err:  # reported to the training thread, never raised here
                out.error = err
            out.seconds = time.perf_counter() - t0
            with self._cv:
                self._outcomes.append(out)
                self._busy = False
                self._cv.notify_all()


# --------------------------------------------------------------------------- the coordinator


@dataclass
class StepResult:
    reset_optimizer: bool = False  # step 7: the trainer must clear the inner optimizer's state
    installed: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Carry:
    """Local progress already taken out of the baseline but not delivered (its upload failed)."""

    delta: dict[str, torch.Tensor]
    base_outer_step: int
    steps: int


class Coordinator:
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
            raise ValueError("role=single has no coordinator (it trains like distributed=none)")
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
        size = sum(t.numel() * t.element_size() for t in state.values())
        self.max_file_bytes = settings.max_file_bytes or 2 * size + 16 * 2**20
        self.state_dir = Path(settings.state_dir).expanduser() / settings.node_id

        self.started = False
        self.closed = False
        self._baseline: dict[str, torch.Tensor] = {}  # model-dtype CPU copies (see _Snapshot)
        self._carry: _Carry | None = None
        # free snapshot buffers: a baseline the uploader has subtracted, or one an install replaced. Only
        # taken at a capture, which waits for an idle uploader, so no job still reads them (at most 2).
        self._free: list[_Snapshot] = []
        self._steps_since_capture = 0
        self._staged: GlobalSnapshot | None = None
        self._stage_lock = threading.Lock()
        self._seen_revision: str | None = None
        self._rejected_globals: set[tuple[int, str]] = set()
        self._last_step_info: dict = {}  # step_count.json of the newest global fetched
        self._last_poll = -math.inf
        self.local_step = 0  # the last step the trainer reported
        self._uploader: Lane | None = None
        self._poller: Lane | None = None
        self.outer: OuterLoop | None = None
        self._ckpt_master: MasterState | None = None
        self._resume: dict | None = None  # a trainer checkpoint taken mid-inner-loop (past the spec)
        self._first_boundary_time: float | None = None
        self._budget_checked = False
        # metrics
        self.installed_outer_step = -1
        self.installs = 0
        self.uploads = 0
        self.upload_failures = 0
        self.skipped_boundaries = 0
        self.poll_failures = 0
        self.rejected_globals = 0
        self.bytes_uploaded = 0
        self.bytes_downloaded = 0
        self.last_delta_bytes = 0
        self.last_upload_seconds = 0.0
        self.boundaries = 0
        self.stall_seconds = 0.0  # all time spent in on_step
        self.boundary_stall_seconds = 0.0  # the part spent on boundary steps
        self.max_boundary_stall = 0.0
        self.num_peers = 0

    # ---------------------------------------------------------------- start-up

    def _open(self, create: bool) -> Transport:
        try:
            return open_transport(
                self.s.repo_id,
                token=self.s.token,
                create=create,
                retry=self.s.retry,
                timeout_s=self.s.request_timeout,
            )
        except ValueError as err:
            raise DumbDiLoCoError(f"distributed.repo_id: {err}") from None

    def connect(self) -> None:
        """Open the repository. A worker waits (up to startup_timeout) for the master's first global and
        stages it; the master creates the repository (private, on the Hub)."""
        if self.s.is_master:
            if self.transport is None:
                try:
                    self.transport = self._open(create=True)
                except TransportError as err:
                    raise DumbDiLoCoError(
                        f"master {self.s.node_id}: cannot open {self.s.repo_id}: {err}"
                    ) from None
            return
        if self.transport is not None and self._newest_known() >= 0:
            return  # already connected and holding a global
        deadline = self._clock() + self.s.startup_timeout
        announced = False
        rejected = ""  # why the newest global was refused, if it was
        while True:
            try:
                if self.transport is None:
                    self.transport = self._open(create=False)
                snapshot = self.fetch_global()
                if snapshot is not None:
                    self._check_same_start()
                    self._stage(snapshot)
                    return
                waiting_for = "the master's first global model"
            except (RemoteNotFound, TransientError) as err:
                waiting_for = f"the repository ({err})"
            except TransportError as err:
                raise DumbDiLoCoError(f"node {self.s.node_id}: cannot read {self.s.repo_id}: {err}") from None
            except GlobalMismatch as err:
                raise DumbDiLoCoError(
                    f"node {self.s.node_id}: the global model in {self.s.repo_id} is not this model "
                    f"({err.reason}); use the same model config as the master, or another repo_id"
                ) from None
            except InvalidTensorFile as err:
                rejected = err.reason
            if rejected:
                waiting_for = f"a valid global model (the newest was rejected: {rejected})"
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise DumbDiLoCoError(
                    f"node {self.s.node_id}: no global model in {self.s.repo_id} after "
                    f"{self.s.startup_timeout:g}s (waiting for {waiting_for}); start the master "
                    "(distributed.role=master) with the same distributed.repo_id, or raise distributed.startup_timeout"
                )
            if not announced:
                log.info("node %s: waiting for %s in %s", self.s.node_id, waiting_for, self.s.repo_id)
                announced = True
            self._sleep(min(self.s.poll_interval, 2.0, remaining))

    def _check_same_start(self) -> None:
        """A worker built with other initial weights than the master's (another seed, model config or
        transformers version) would compute deltas for another model: stop, naming both hashes."""
        theirs = self._last_step_info.get("init_sha256")
        if theirs is not None and theirs != self.init_sha256:
            raise DumbDiLoCoError(
                f"node {self.s.node_id}: initial weights differ from the master's (sha256 {self.init_sha256} "
                f"here, {theirs} on {self._last_step_info.get('master', 'the master')}): use the master's "
                "seed, model config and transformers version"
            )

    def start(self) -> None:
        """Called once the trainer has restored its checkpoint, before the first forward pass: every
        node starts (and restarts) from the latest global model."""
        if self.closed:
            raise DumbDiLoCoError(
                f"node {self.s.node_id}: this coordinator was closed; it cannot be started again"
            )
        if self.started:
            return
        self.connect()
        if self.s.is_master:
            self._start_master()
        else:
            newer = self._safe_fetch()
            if newer is not None:
                self._stage(newer)
        if self._resume is not None:
            self._resume_inner_loop()
        elif not self._install_staged():
            raise DumbDiLoCoError(
                f"node {self.s.node_id}: the global model cannot be installed into this model"
            )
        if self.s.async_delta_upload:
            self._uploader = Lane(f"dumb-diloco-upload-{self.s.node_id}", self._send)
        if self.s.async_global_poll and not self.s.is_master:
            self._poller = Lane(f"dumb-diloco-poll-{self.s.node_id}", lambda _: self.fetch_global())
        self._last_poll = self._clock()
        self.started = True
        log.info(
            "node %s (%s, %s upload, %s poll): starting from global outer step %d, a delta every %d steps",
            self.s.node_id, self.s.role, "async" if self._uploader else "sync",
            "async" if self._poller else ("callback" if self.s.is_master else "sync"),
            self.installed_outer_step, self.s.inner_steps,
        )  # fmt: skip

    def _start_master(self) -> None:
        """Pick the newest of (state_dir, trainer checkpoint, repository), publish if the repository is
        behind, and start the outer loop thread."""
        self._check_lease()
        try:
            local = MasterState.load(self.state_dir)
        except (OSError, ValueError, InvalidTensorFile) as err:
            raise DumbDiLoCoError(f"master state in {self.state_dir} is unreadable: {err}") from None
        chosen = max(
            (s for s in (local, self._ckpt_master) if s is not None), key=lambda s: s.outer_step, default=None
        )
        if chosen is not None:
            self._check_layout(chosen.published(), f"the master state in {self.state_dir}")
        try:
            repo = self.fetch_global()
        except GlobalMismatch as err:
            raise DumbDiLoCoError(
                f"master {self.s.node_id}: the global model in {self.s.repo_id} is not this model ({err.reason}); "
                "use the model config of that run, or another repo_id"
            ) from None
        except InvalidTensorFile as err:
            log.warning("master: the repository's global is corrupt (%s); it will be replaced", err)
            repo = None
        except TransportError as err:
            raise DumbDiLoCoError(f"master {self.s.node_id}: cannot read {self.s.repo_id}: {err}") from None
        publish = True
        if repo is None:
            state = chosen or MasterState.from_model_state(self.model.state_dict(), outer_step=0)
            corrupt = max((k for k, _ in self._rejected_globals), default=-1)
            state.outer_step = max(state.outer_step, corrupt + 1)  # readers only install newer steps
        elif chosen is not None and chosen.outer_step >= repo.outer_step:
            state, publish = chosen, chosen.outer_step > repo.outer_step
        elif (published := self._published_state(repo.outer_step)) is not None:
            state, publish = MasterState.from_model_state(repo.state, repo.outer_step), False
            state.ledger, state.momentum = published.ledger, published.momentum
            state.delayed, state.delayed_count = published.delayed, published.delayed_count
            log.warning(
                "master: continuing from %s at outer step %d with its published ledger (%d entries) and momentum%s",
                self.s.repo_id, repo.outer_step, len(state.ledger),
                f" (local state was at outer step {chosen.outer_step})" if chosen is not None else "",
            )  # fmt: skip
            chosen = state  # exact: no delta of the repository is treated as preexisting
        else:
            state, publish = MasterState.from_model_state(repo.state, repo.outer_step), False
            if chosen is not None:
                log.warning(
                    "master: local state is at outer step %d but %s is at %d; adopting the repository's weights "
                    "(momentum and ledger kept)", chosen.outer_step, self.s.repo_id, repo.outer_step,
                )  # fmt: skip
                state.momentum, state.ledger = chosen.momentum, chosen.ledger
            for d in self._last_step_info.get("deltas", []):  # the round we have no record of
                state.ledger.add(LedgerEntry(d["node_id"], int(d["local_step"]), d["sha256"], "applied",
                                             repo.outer_step, int(d.get("base_outer_step", -1))))  # fmt: skip
        self.outer = OuterLoop(
            self.transport,
            state,
            node_id=self.s.node_id,
            collaborators=self.s.collaborators,
            outer_lr=self.s.outer_lr,
            outer_momentum=self.s.outer_momentum,
            poll_interval=self.s.poll_interval,
            state_dir=self.state_dir,
            max_file_bytes=self.max_file_bytes,
            on_snapshot=self._stage,
            hf_config=self.hf_config,
            min_deltas_per_round=self.s.min_deltas_per_round,
            staleness_weighting=self.s.staleness_weighting,
            delayed_nesterov_period=self.s.delayed_nesterov_period if self.s.delayed_nesterov else 0,
            publish_state=self.s.publish_master_state,
            keep_deltas=self.s.keep_deltas,
            lease_seconds=self.s.lease_seconds,
            init_sha256=self.init_sha256,
        )
        if repo is not None and chosen is None:
            n = self.outer.mark_existing_as_processed()
            log.warning(
                "master: no local master state; adopted global outer step %d from %s and treat its %d existing "
                "delta(s) as already processed", repo.outer_step, self.s.repo_id, n,
            )  # fmt: skip
        if not publish:
            self.outer.heartbeat()  # take the lease now (a publication carries it otherwise)
        if publish:
            self.outer.publish()
            log.info("master: published global outer step %d to %s", state.outer_step, self.s.repo_id)
        self.outer.save_state()
        self._stage(self.outer.snapshot())
        self.outer.start()

    def _check_lease(self) -> None:
        """Single-master lease (past the spec): refuse to start while another master's lease is fresh."""
        if self.s.lease_seconds <= 0:
            return
        try:
            other = lease_holder(self.transport, self.s.node_id, self.s.lease_seconds, time.time())
            lease = read_lease(self.transport)
        except TransportError as err:
            raise DumbDiLoCoError(f"master {self.s.node_id}: cannot read {self.s.repo_id}: {err}") from None
        if other is not None:
            raise DumbDiLoCoError(
                f"master {self.s.node_id}: {self.s.repo_id} is held by master {other[0]!r} (lease heartbeat "
                f"{other[1]:.0f}s ago, lease_seconds {self.s.lease_seconds:g}); run one master per repository, "
                "or start this one after that master stopped and its lease expired"
            )
        if lease is not None and lease.get("master") != self.s.node_id:
            log.warning("master %s: taking over %s from master %r (its lease expired)", self.s.node_id,
                        self.s.repo_id, lease.get("master"))  # fmt: skip

    def _published_state(self, outer_step: int) -> PublishedState | None:
        if not self.s.publish_master_state:
            return None
        try:
            return load_published_state(self.transport, outer_step, self._last_step_info.get("global_sha256", ""),
                                        self.max_file_bytes)  # fmt: skip
        except TransportError as err:
            raise DumbDiLoCoError(f"master {self.s.node_id}: cannot read {self.s.repo_id}: {err}") from None

    # ---------------------------------------------------------------- the seven steps

    def on_step(self, local_step: int) -> StepResult:
        """Steps 2-7 for the optimizer step the trainer just finished (step 1)."""
        if self.closed:
            raise DumbDiLoCoError(
                f"node {self.s.node_id}: this coordinator was closed; it cannot be started again"
            )
        if not self.started:
            self.start()
        t0 = time.perf_counter()
        self.local_step = local_step  # 2
        self._steps_since_capture += 1
        self._collect_lanes()
        boundary = local_step % self.s.inner_steps == 0
        captured = False
        if boundary:
            self.boundaries += 1
            if self._uploader is not None and self._uploader.busy:
                self.skipped_boundaries += 1
                log.warning(
                    "node %s: boundary at step %d skipped, the previous upload is still in flight "
                    "(its progress stays in the next cumulative delta)", self.s.node_id, local_step,
                )  # fmt: skip
            else:
                job = self._capture(local_step)  # 3
                self._dispatch(job)  # 4
                captured = True
        if boundary or self._clock() - self._last_poll >= self.s.poll_interval:
            self._last_poll = self._clock()
            self._poll()  # 5
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

    def _capture(self, local_step: int) -> DeltaJob:
        """Step 3: one copy of the current weights becomes the new baseline; the job computes the
        cumulative pseudo-gradient float32(old baseline) - float32(snapshot), plus a failed upload's."""
        state = self.model.state_dict()
        snapshot = self._free.pop() if self._free else None
        if snapshot is None:
            snapshot = _Snapshot({k: torch.empty_like(state[k], device="cpu") for k in self._delta_keys})
        _copy_into([snapshot[k] for k in self._delta_keys], [state[k].detach() for k in self._delta_keys])
        base, carry = self._baseline, self._carry
        self._baseline, self._carry = snapshot, None
        base_outer_step, steps = self.installed_outer_step, self._steps_since_capture
        if carry is not None:
            base_outer_step, steps = min(base_outer_step, carry.base_outer_step), steps + carry.steps
        self._steps_since_capture = 0
        meta = DeltaMeta(
            node_id=self.s.node_id,
            local_step=local_step,
            base_outer_step=max(base_outer_step, 0),
            tokens_since_baseline=steps * self.tokens_per_step,
            samples_since_baseline=steps * self.samples_per_step,
        )
        path = delta_path(self.s.node_id, local_step)
        return DeltaJob(local_step, path, meta, steps, base=base, snapshot=snapshot, carry=carry)

    def _dispatch(self, job: DeltaJob) -> None:
        """Step 4: v2 hands the job to the uploader thread; v1 uploads here."""
        if self._uploader is not None:
            self._uploader.submit(job)
            return
        t0 = time.perf_counter()
        try:
            n = self._send(job)
        except Exception as err:  # never kill training: the delta is carried into the next one
            self._upload_done(_Outcome(job, error=err, seconds=time.perf_counter() - t0))
        else:
            self._upload_done(_Outcome(job, value=n, seconds=time.perf_counter() - t0))

    def _send(self, job: DeltaJob) -> int:
        delta, free = job.materialize()
        if free is not None:
            self._free.append(free)  # the training thread takes it at the next boundary, after this job
        blob = encode(delta, job.meta.to_header())
        self.transport.write(
            {job.path: blob}, message=f"{self.s.node_id}: delta at local step {job.local_step}"
        )
        return len(blob)

    def _upload_done(self, out: _Outcome) -> None:
        job: DeltaJob = out.item
        self.last_upload_seconds = out.seconds
        if out.error is None:
            self.uploads += 1
            self.bytes_uploaded += out.value
            self.last_delta_bytes = out.value
            log.info(
                "node %s: uploaded %s (%d bytes, %.2fs)", self.s.node_id, job.path, out.value, out.seconds
            )
            return
        self.upload_failures += 1
        delta, _ = job.materialize()  # already done unless the failure came before the subtraction
        if self._carry is None:
            self._carry = _Carry(delta, job.meta.base_outer_step, job.steps)
        else:  # cannot happen with one job in flight, but never drop progress
            for k, t in delta.items():
                self._carry.delta[k].add_(t)
            self._carry.steps += job.steps
        log.warning(
            "node %s: upload of %s failed (%s); its progress goes into the next delta",
            self.s.node_id, job.path, _describe(out.error),
        )  # fmt: skip

    def _poll(self) -> None:
        """Step 5. The master's globals come from its own outer loop (snapshot callback) instead."""
        if self.s.is_master:
            return
        if self._poller is not None:
            self._poller.submit()
            return
        snapshot = self._safe_fetch()
        if snapshot is not None:
            self._stage(snapshot)

    def _collect_lanes(self) -> None:
        if self._uploader is not None:
            for out in self._uploader.outcomes():
                self._upload_done(out)
        if self._poller is not None:
            for out in self._poller.outcomes():
                if out.error is not None:
                    self._fetch_failed(out.error)
                elif out.value is not None:
                    self._stage(out.value)

    # ---------------------------------------------------------------- globals

    def fetch_global(self) -> GlobalSnapshot | None:
        """A global newer than the installed/staged one, read from one revision and fully validated;
        None if there is none. Raises TransportError, or InvalidTensorFile for a global that fails
        validation (remembered, so the same file is not downloaded again)."""
        revision = self.transport.revision()
        if revision == self._seen_revision:
            return None
        try:
            raw = self.transport.read(GLOBAL_STEP_PATH, revision, max_bytes=STEP_FILE_MAX_BYTES)
        except RemoteNotFound:
            self._seen_revision = revision
            return None
        self.bytes_downloaded += len(raw)
        info = parse_step_info(raw)
        outer_step, sha = info["outer_step"], info.get("global_sha256", "")
        if outer_step <= self._newest_known() or (outer_step, sha) in self._rejected_globals:
            self._seen_revision = revision
            return None
        blob = self.transport.read(GLOBAL_WEIGHTS_PATH, revision, max_bytes=self.max_file_bytes)
        self.bytes_downloaded += len(blob)
        self._seen_revision = revision
        try:
            tensors, meta = decode(blob, max_bytes=self.max_file_bytes, expected=self._global_layout)
            if meta.get("outer_step") != str(outer_step):
                raise InvalidTensorFile(
                    f"global file is outer step {meta.get('outer_step')!r} but step_count.json says {outer_step}"
                )
        except InvalidTensorFile as err:
            self._rejected_globals.add((outer_step, sha))
            self.rejected_globals += 1
            kind = GlobalMismatch if self._is_other_model(blob) else InvalidTensorFile
            raise kind(f"global outer step {outer_step}: {err.reason}") from None
        self._last_step_info = info
        peers = len({d.get("node_id") for d in info.get("deltas", []) if isinstance(d, dict)})
        return GlobalSnapshot(outer_step, tensors, source="repo", num_peers=peers)

    def _is_other_model(self, blob: bytes) -> bool:
        """True for a well-formed file whose keys, shapes or dtypes differ from this model's."""
        try:
            parse_header(blob, file_size=len(blob))
        except InvalidTensorFile:
            return False  # corrupt, not another model
        try:
            decode(
                blob,
                max_bytes=len(blob),
                expected=self._global_layout,
                require_finite=False,
                verify_sha=False,
            )
        except InvalidTensorFile:
            return True
        return False

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
        self.installed_outer_step = snapshot.outer_step
        self.installs += 1
        self.num_peers = snapshot.num_peers
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
        warning = check_commit_budget(1, max(now - self._first_boundary_time, 1e-3))
        if warning:
            log.warning("node %s: %s", self.s.node_id, warning)

    def metrics(self, stall: float | None = None) -> dict[str, float]:
        m = {
            "outer/step": self.installed_outer_step,
            "outer/installs": self.installs,
            "outer_lr": self.s.outer_lr,
            "num_peers": self.num_peers,
            "comm/bytes_uploaded": self.bytes_uploaded,
            "comm/bytes_downloaded": self.bytes_downloaded,
            "comm/total_bytes": self.total_bytes,
            "comm/delta_bytes": self.last_delta_bytes,
            "comm/upload_seconds": self.last_upload_seconds,
            "comm/uploads": self.uploads,
            "comm/upload_failures": self.upload_failures,
            "comm/skipped_boundaries": self.skipped_boundaries,
            "comm/poll_failures": self.poll_failures,
            "comm/stall_seconds_total": self.stall_seconds,
        }
        if stall is not None:
            m["comm/boundary_stall_seconds"] = stall
        if self.outer is not None:
            m |= {
                "outer/master_step": self.outer.state.outer_step,
                "outer/rounds": self.outer.rounds,
                "outer/deltas_accepted": self.outer.deltas_accepted,
                "outer/deltas_rejected": self.outer.deltas_rejected,
                "outer/pseudo_grad_norm": self.outer.last_pseudo_grad_norm,
                "outer/errors": self.outer.errors,
                "outer/pending_deltas": self.outer.pending,
            }
        return m

    @property
    def total_bytes(self) -> int:
        outer = self.outer.bytes_uploaded + self.outer.bytes_downloaded if self.outer is not None else 0
        return self.bytes_uploaded + self.bytes_downloaded + outer

    def summary(self) -> dict:
        """Final figures. The trainer asks for them at the very end of the run, so this first finishes
        the pending work (`close`: the in-flight upload, the master's last rounds) to count it."""
        if self.started:
            self.close()
        m = self.metrics()
        m |= {
            "comm/boundary_stall_seconds": self.boundary_stall_seconds,
            "comm/boundary_stall_seconds_mean": self.boundary_stall_seconds / max(self.boundaries, 1),
            "comm/boundary_stall_seconds_max": self.max_boundary_stall,
            "comm/boundaries": self.boundaries,
            "outer/rejected_globals": self.rejected_globals,
            "dumb_diloco/role": self.s.role,
            "dumb_diloco/node_id": self.s.node_id,
        }
        return m

    _COUNTERS = (
        "installs", "uploads", "upload_failures", "skipped_boundaries", "poll_failures", "rejected_globals",
        "bytes_uploaded", "bytes_downloaded", "boundaries", "stall_seconds", "boundary_stall_seconds",
    )  # fmt: skip

    def state_dict(self) -> dict:
        """Counters, the installed outer step and (master) the full outer state; past the spec, the
        baseline, the steps since it and a failed upload's carry, so that a node restarted from this
        checkpoint continues its inner loop exactly (its next delta is the uninterrupted one)."""
        out: dict = {k: getattr(self, k) for k in self._COUNTERS}
        out["installed_outer_step"] = self.installed_outer_step
        out["local_step"] = self.local_step
        out["steps_since_capture"] = self._steps_since_capture
        out["baseline"] = {k: t.clone() for k, t in self._baseline.items()}
        if self._carry is not None:
            out["carry"] = {"delta": {k: t.clone() for k, t in self._carry.delta.items()},
                            "base_outer_step": self._carry.base_outer_step, "steps": self._carry.steps}  # fmt: skip
        if self.outer is not None:
            with self.outer.lock:
                out["master"] = self.outer.state.to_checkpoint()
        return out

    def load_state_dict(self, state: dict) -> None:
        for k in self._COUNTERS:
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
        r = self._resume
        assert r is not None
        baseline = r["baseline"]
        expected = {k: self._global_layout[k] for k in self._delta_keys}
        got = {k: (tuple(t.shape), t.dtype) for k, t in baseline.items()}
        if got != expected:
            raise DumbDiLoCoError(
                f"node {self.s.node_id}: the checkpoint's DumbDiLoCo baseline is not of this model"
            )
        self._baseline = {k: t.detach().to("cpu", copy=True) for k, t in baseline.items()}
        self.installed_outer_step = int(r["installed_outer_step"])
        self.local_step = int(r.get("local_step", 0))
        self._steps_since_capture = int(r.get("steps_since_capture", 0))
        if r.get("carry"):
            c = r["carry"]
            self._carry = _Carry(dict(c["delta"]), int(c["base_outer_step"]), int(c["steps"]))
        self._resume = None
        log.info("node %s: resumed mid-inner-loop at local step %d (baseline of global outer step %d, %d step(s) "
                 "since)", self.s.node_id, self.local_step, self.installed_outer_step, self._steps_since_capture)  # fmt: skip

    def close(self) -> None:
        """Bounded shutdown: wait for an in-flight upload and (master) a last outer round."""
        if self.closed:
            return
        self.closed = True
        if self._uploader is not None:
            job = self._uploader._item
            if not self._uploader.join(self.s.shutdown_timeout):
                what = f"{job.path} ({job.steps} step(s))" if isinstance(job, DeltaJob) else "an upload"
                log.warning("node %s: %s was still uploading after shutdown_timeout %gs; leaving it (it may not "
                            "arrive)", self.s.node_id, what, self.s.shutdown_timeout)  # fmt: skip
            self._collect_lanes()
        if self._poller is not None:
            self._poller.join(0.0)
        if self.outer is not None:
            if not self.outer.stop(self.s.drain_seconds, self.s.shutdown_timeout):
                log.warning("master: the outer loop was still running after the shutdown timeout; leaving it")
            self.outer.save_state()
        if self._carry is not None:
            log.warning("node %s: %d step(s) of progress were never uploaded (upload failed)", self.s.node_id,
                        self._carry.steps)  # fmt: skip


def parse_step_info(raw: bytes) -> dict:
    """global/step_count.json, checked (InvalidTensorFile with one line on anything odd)."""
    try:
        info = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidTensorFile(f"{GLOBAL_STEP_PATH} is not JSON ({err})") from None
    step = info.get("outer_step") if isinstance(info, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidTensorFile(f"{GLOBAL_STEP_PATH} has no valid outer_step: {str(info)[:80]}")
    if not isinstance(info.get("deltas", []), list):
        raise InvalidTensorFile(f"{GLOBAL_STEP_PATH}: deltas must be a list")
    return info


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


# --------------------------------------------------------------------------- the trainer's strategy


class DumbDiLoCo:
    """`distributed=dumb_diloco`: the trainer's strategy object around a Coordinator."""

    name = "dumb_diloco"

    @classmethod
    def from_config(cls, cfg, ctx, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        from diloco.distributed import LocalTraining

        settings = Settings.from_config(cfg.distributed)
        if settings.role == "single":
            return LocalTraining(ctx)
        if ctx.world_size > 1:
            raise ConfigError(
                "distributed=dumb_diloco runs one process per node; start each node with plain `python -m diloco.train`"
            )
        if cfg.data.get("shard") is None:
            log.warning(
                "node %s: data.shard/data.num_shards are not set, so this node reads the same data as every other "
                "node left at the default; give node i of n `data.shard=i data.num_shards=n`", settings.node_id,
            )  # fmt: skip
        hf_config = json.loads(model.config.to_json_string()) if hasattr(model, "config") else None
        coordinator = Coordinator(
            model,
            settings,
            tokens_per_step=cfg.train.batch_size * cfg.data.seq_len,
            samples_per_step=cfg.train.batch_size,
            hf_config=hf_config,
        )
        coordinator.connect()  # a worker fails here, before training, if there is no master
        # the run's node count, for effective_step / total_samples / tokens_seen
        return cls(coordinator, optimizer, num_workers=int(cfg.data.get("num_shards") or 1))

    def __init__(self, coordinator: Coordinator, optimizer: torch.optim.Optimizer, num_workers: int = 1):
        self.coordinator, self.optimizer, self.num_workers = coordinator, optimizer, num_workers

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def start(self) -> None:
        self.coordinator.start()  # after any checkpoint restore, before the first forward

    def grad_sync(self, last_micro_step: bool):
        return nullcontext()

    def after_inner_step(self, step: int) -> dict[str, float]:
        result = self.coordinator.on_step(step)
        if result.reset_optimizer:
            self.optimizer.state.clear()
        return result.metrics

    def eval_weights(self, step: int):
        """A node evaluates the weights it holds (the master: the final global, see finish)."""
        return nullcontext()

    def state_dict(self) -> dict:
        return self.coordinator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.coordinator.load_state_dict(state)

    def finish(self) -> bool:
        """End of training. On the master: stop the outer loop after its last round (the workers' last
        deltas, within drain_seconds) and install that final global into the model, so the trainer's final
        evaluation is of the model the run produced. True when the model changed."""
        c = self.coordinator
        if c.outer is None:
            return False
        c.close()
        final = c.outer.snapshot()
        if final.outer_step <= c.installed_outer_step:
            return False
        with torch.no_grad():
            for k, t in c.model.state_dict().items():
                t.copy_(final.state[k])
        log.info(
            "master: installed the final global (outer step %d) for the final evaluation", final.outer_step
        )
        return True

    def summary(self) -> dict:
        return self.coordinator.summary()

    def close(self) -> None:
        self.coordinator.close()

"""`distributed=dumb_diloco` for the trainer: `DumbDiLoCo`, one node (master or worker) of a DumbDiLoCo
run, composed of parts that own their state: the `Uploader` (uploader.py: baseline, carry, the upload
lane, the final delta and marker), the `Installer` (install.py: the staged and installed global,
translate's snapshots), the `Joiner` (joiner.py: the store, the first global, the quorum), the `Poller`
(poller.py: the poll lane and its cadence), the `StallMeter` (stall.py: the training thread's time inside
and between steps) and the `Counters` (counters.py, shared by the parts that count); on the master, the `MasterRole` (master/role.py: the lease, the outer loop).

The seven steps after each optimizer step: (1) the trainer calls `after_inner_step`; `on_step` receives
the local step (2); at a boundary (local_step % inner_steps == 0; or every H x pace steps,
`dynamic_local_steps`) it takes the cumulative pseudo-gradient float32(baseline) - float32(weights), plus
any delta whose upload failed (3), uploads it as nodes/<node_id>/delta_<local_step>.safetensors (4),
polls for a newer global (5; between boundaries at most once per poll_interval), installs a compatible
one (6) and tells the trainer to reset its inner optimizer (7).

Invariants: no local progress is lost (a failed upload is carried into the next delta); a global is
installed only right after a boundary captured the progress; the training thread copies the weights once
per boundary, the upload lane subtracts/encodes/writes and the poll lane downloads (`async_*: false`
runs them inline); a boundary that finds an upload in flight is skipped and its progress stays in the
next cumulative delta. The constructor does no I/O and starts no thread; `start` (after a resume)
connects, recovers and starts the lanes (a worker without a master fails there, in one line); `finish`
waits for the last upload (and, on the master, the last outer round) so `summary` counts it; `summary`
has no side effects; `close` is idempotent and bounded by shutdown_timeout. Prose: docs/dumb_diloco.md
("Node lifecycle", "Restarts and checkpoints", "Metrics").
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.errors import ConfigError
from diloco.model import weights_sha256
from diloco.schema import DumbDiLoCoConfig
from diloco.strategy import RunShape

from ..master.loop import OuterLoop
from ..master.role import MasterRole
from ..settings import DumbDiLoCoError, Settings
from ..store.base import TransportError
from ..store.budget import PaceCheck
from ..store.transport import HubTransport, Transport, deadline
from ..wire.delta_codec import DeltaCodec
from ..wire.global_state import GlobalSnapshot, delta_layout, state_layout
from ..wire.tensor_format import InvalidTensorFile
from .counters import Counters
from .ending import await_final_status
from .install import Installer
from .joiner import GlobalReader, Joiner
from .lanes import Buffers, DeltaJob, InlineLane, fail_fast
from .poller import Poller
from .progress import GlobalProgress
from .stall import StallMeter
from .uploader import Uploader

log = logging.getLogger("diloco.dumb_diloco")


@dataclass
class StepResult:
    reset_optimizer: bool = False  # step 7: the trainer must clear the inner optimizer's state
    installed: bool = False
    metrics: dict[str, float] | None = None


def saved_tokenizer(name_or_path: str) -> dict[str, bytes]:
    """The files `save_pretrained` writes for the run's tokenizer (tokenizer.json, its config, the special
    tokens map), by name: what the master publishes beside config.json."""
    import tempfile

    from diloco.data import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        load_tokenizer(name_or_path).save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


class DumbDiLoCo:
    """The trainer's strategy: one node of a DumbDiLoCo run (see the module docstring)."""

    name = "dumb_diloco"

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
        tokenizer_files: dict[str, bytes] | None = None,  # master: published beside config.json
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        manual_rounds: bool = False,  # master: no outer-loop thread; the caller drives outer.run_once()
        wrap_transport: Callable[[Transport], Transport] | None = None,  # wraps the store `start` opens
    ):
        if settings.role == "single":
            raise ValueError("role=single has no node (it trains like distributed=none)")
        self.model = model
        self.s = settings
        self.optimizer = optimizer
        self.num_workers = num_workers
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.hf_config = hf_config if settings.publish_hf_config else None
        self.tokenizer_files = tokenizer_files if settings.publish_hf_config and settings.is_master else None
        self.clock, self.sleep = clock, sleep
        self.global_progress = GlobalProgress(settings.node_id, num_workers, settings.budget == "global")
        state = model.state_dict()
        # the weights this node was built with, before any checkpoint or global: the master publishes
        # its own with every global and a worker refuses to join a master that started elsewhere
        self.init_sha256 = weights_sha256(model)
        layout = state_layout(state)  # what a global must look like to be installed
        self.delta_keys = list(delta_layout(state))
        self.translating = settings.install == "translate"
        self.codec = DeltaCodec.from_settings(settings)  # float32, or int8/int4 with error feedback
        self.buffers = Buffers(state, self.delta_keys, float32_wire=not self.codec.lossy)  # lanes.py
        size = sum(t.nbytes for t in state.values())
        self.max_file_bytes = settings.max_file_bytes or 2 * size + 16 * 2**20
        self.state_dir = Path(settings.state_dir).expanduser() / settings.node_id
        self.counters = Counters()
        self.installer = Installer(
            model, settings.node_id, self.translating, layout, self.delta_keys, self.buffers
        )
        self.uploader = Uploader(
            model,
            settings,
            self.delta_keys,
            self.buffers,
            self.codec,
            self.counters,
            tokens_per_step=tokens_per_step,
            samples_per_step=samples_per_step,
            clock=clock,
        )
        reader = GlobalReader(layout, self.max_file_bytes, self._downloaded)
        self.joiner = Joiner(
            settings,
            reader,
            self.init_sha256,
            transport,
            clock=clock,
            sleep=sleep,
            wrap_transport=wrap_transport,
        )
        self.started = False
        self.closed = False
        self.local_step = 0  # the last step the trainer reported
        self.poller = Poller(settings, self.counters, self.fetch_global, self.stage, clock)  # step 5
        self.stall = StallMeter(self.counters)
        # the lease and the outer loop (master/role.py); None: a worker
        self.master: MasterRole | None = self._master_role(manual_rounds) if settings.is_master else None
        self._resume: dict | None = None  # a trainer checkpoint taken mid-inner-loop (past the spec)
        self.pace_check = PaceCheck()  # the Hub commit budget at this node's measured pace
        self.final_status = ""  # after finish: what became of this node's final delta

    def _master_role(self, manual_rounds: bool) -> MasterRole:
        return MasterRole(
            self.s,
            self.joiner,
            self.state_dir,
            fetch=self.fetch_global,
            check_layout=self.installer.check_layout,
            on_snapshot=self.stage,
            max_file_bytes=self.max_file_bytes,
            init_sha256=self.init_sha256,
            hf_config=self.hf_config,
            manual_rounds=manual_rounds,
        )

    # ---------------------------------------------------------------- the trainer's construction

    @classmethod
    def from_config(
        cls,
        dcfg: DumbDiLoCoConfig,
        shape: RunShape,
        ctx,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        transport: Callable[[Transport], Transport] | None = None,
    ):
        """A node of role master or worker (role single is no node: build_strategy trains it like
        distributed=none). `dcfg`: the typed block diloco.config.validate checked (not checked again);
        `shape`: the run's batch, sequence length, shard and nodes; `transport`: wraps the store the node
        opens (None: the store itself). No I/O and no threads here: `start` connects (a worker without a
        master fails there). Under torchrun a node is G ranks with DDP inside (ranks.NodeRanks), whose
        rank 0 alone is a DumbDiLoCo."""
        from diloco.distributed import DataParallel

        settings = Settings.of(dcfg)
        if settings.budget == "global" and ctx.world_size > 1:  # its ranks would need rank 0's run step
            raise ConfigError("distributed.budget=global is not supported yet for a node of several ranks")
        ddp = DataParallel(ctx, model) if ctx.world_size > 1 else None
        if shape.shard is None and ctx.is_main:
            log.warning(
                f"node {settings.node_id}: data.shard/data.num_shards are not set, so this node reads the "
                "same data as every other node left at the default; give node i of n `data.shard=i "
                "data.num_shards=n`"
            )
        hf_config = json.loads(model.config.to_json_string()) if hasattr(model, "config") else None
        tokenizer_files = None
        if settings.is_master and settings.publish_hf_config and shape.tokenizer and ctx.is_main:
            tokenizer_files = saved_tokenizer(shape.tokenizer)
        batch = shape.batch_size  # the node's, split among its ranks
        workers = shape.num_shards or 1
        if settings.budget == "global":  # the budget's node count, checked by diloco.config.validate
            workers = shape.num_shards or shape.nodes
        leader = None
        if ctx.is_main:
            leader = cls(
                model,
                settings,
                optimizer=optimizer,
                num_workers=workers,
                hf_config=hf_config,
                tokenizer_files=tokenizer_files,
                tokens_per_step=batch * shape.seq_len,
                samples_per_step=batch,
                wrap_transport=transport,
            )
        if ddp is None:
            return leader
        from .ranks import NodeRanks

        return NodeRanks(ctx, model, optimizer, ddp, leader, settings, workers)

    # ---------------------------------------------------------------- what the parts hold

    @property
    def transport(self) -> Transport | None:
        return self.joiner.transport

    @transport.setter
    def transport(self, transport: Transport) -> None:
        """A store put in front of the one in use (tests wrap it to inject faults)."""
        self.joiner.transport = transport
        self.uploader.connect(transport)

    @property
    def outer(self) -> OuterLoop | None:
        """The master's outer loop, once started (None on a worker)."""
        return self.master.outer if self.master is not None else None

    @property
    def total_bytes(self) -> int:
        outer = self.master.total_bytes if self.master is not None else 0
        return self.counters.bytes_uploaded + self.counters.bytes_downloaded + outer

    # ---------------------------------------------------------------- the trainer's hooks

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def grad_sync(self, last_micro_step: bool):
        return nullcontext()

    def after_inner_step(self, step: int) -> dict[str, float]:
        result = self.on_step(step)
        if result.reset_optimizer and self.optimizer is not None:
            self.optimizer.state.clear()
        return result.metrics or {}

    def eval_weights(self, step: int):
        """A node evaluates the weights it holds (the master: the final global, see finish)."""
        return nullcontext()

    def progress(self, step: int) -> float:
        """The run's step after `step` steps of this node: `step` itself (`budget: local`, the spec), or
        under `budget: global` its estimate from the installed global (progress.py): the trainer stops
        when it reaches train.max_steps, and the lr schedule is evaluated there."""
        return self.global_progress.step(step)

    # ---------------------------------------------------------------- the seven steps

    def on_step(self, local_step: int) -> StepResult:
        """Steps 2-7 for the optimizer step the trainer just finished (step 1)."""
        if self.closed or not self.started:
            raise self.s.error(
                "this node was closed; it cannot be started again" if self.closed else "not started"
            )
        if self.master is not None and self.master.dead:  # a dead outer loop fails the master's run
            raise self.s.error(f"the outer loop stopped: {self.master.dead}")
        t0 = time.perf_counter()
        self.stall.entered(self.clock())  # the trainer's time for this step, without this node's stalls
        self.local_step = local_step  # 2
        self.uploader.count_step()
        self.collect()
        if self.s.dynamic_local_steps:  # Async Local-SGD: H x pace steps since the last capture (progress.py)
            round_steps = self.global_progress.round_steps(self.s.inner_steps)
            boundary = self.uploader.steps_since_capture % round_steps == 0
        else:
            boundary = local_step % self.s.inner_steps == 0
        captured, installed_now = self._boundary(local_step) if boundary else (False, False)
        if boundary or self.poller.due():
            self.poller.asked()
            self.poll()  # 5
        self.collect()  # inline lanes (v1) are done already
        if captured and self.s.install_wait_seconds > 0:
            self._await_inclusion(local_step)
        when_staged = self.translating and self.s.install_when_staged  # mid-round: no progress is lost
        installed = ((captured or when_staged) and self.install_staged()) or installed_now  # 6
        stall = time.perf_counter() - t0
        self.stall.stalled(stall, boundary)
        result = StepResult(installed and self.s.reset_inner_optimizer, installed)  # 7
        if boundary:
            if isinstance(self.transport, HubTransport):
                warn = self.pace_check.boundary(self.s, self.clock())
                if warn:
                    log.warning("node %s: at this node's pace, %s", self.s.node_id, warn)
            result.metrics = self.metrics(stall)
        self.stall.left(self.clock())
        return result

    def _boundary(self, local_step: int) -> tuple[bool, bool]:
        """Steps 3 and 4 at a boundary (and 6 before 4 under `replace`). Returns (captured, installed)."""
        self.counters.boundaries += 1
        held, cap = self.installer.held, self.s.max_pending_snapshots
        if self.uploader.uploading or 0 < cap <= held:  # its steps stay in the next cumulative delta
            self.counters.skipped_boundaries += 1
            if self.uploader.uploading:
                why = "the previous upload is still in flight"
            else:
                why = f"{held} uploaded deltas are in no global yet (max_pending_snapshots)"
            log.warning(f"node {self.s.node_id}: boundary at step {local_step} skipped, {why}")
            return False, False
        self.collect()  # an upload that ended since the first collect: its carry counts
        job = self.capture(local_step)  # 3
        # 6 before 4 (replace): the delta is fixed, and the snapshot, no longer the baseline, becomes it in place
        installed = not self.translating and self.install_staged(job)
        self.uploader.dispatch(job)  # 4
        return True, installed

    def capture(self, local_step: int) -> DeltaJob:
        """Step 3 (uploader.capture): the weights' snapshot becomes the baseline; translate keeps it until
        an installed global includes its delta."""
        step_micros = self.stall.step_micros if self.s.dynamic_local_steps else 0  # for the others' paces
        job = self.uploader.capture(local_step, self.installer.outer_step, step_micros)
        self.installer.remember(local_step, job.snapshot)
        return job

    def _await_inclusion(self, local_step: int) -> None:
        """Past the spec (`install_wait_seconds`): wait at most that long for a global that includes the delta
        captured at `local_step`, so that a node ahead of the others does not train on without it (bounded
        staleness; nodes in time make synchronous DiLoCo's round). A failed upload ends the wait."""
        end = self.clock() + self.s.install_wait_seconds
        while self.uploader.carry is None and self.clock() < end:
            staged = self.installer.staged
            if staged is not None and staged.included.get(self.s.node_id, -1) >= local_step:
                return
            self.sleep(min(0.05, self.s.poll_interval))
            if self.poller.due():
                self.poller.asked()
                self.poll()
            self.collect()

    def poll(self) -> bool:
        """Step 5 (False if a poll is still in flight). The master's globals come from its own outer
        loop (the snapshot callback) instead."""
        if self.s.is_master or self.poller.in_flight:
            return False
        self.collect()
        return self.poller.submit()

    def collect(self) -> None:
        """What the lanes finished since the last call: an upload (a failed one carried into the next
        delta) and a poll (its global staged)."""
        done = self.uploader.collect()
        if done is not None and done.error is not None:
            fail_fast(self.s, done.error, f"uploading {done.job.path}")
            self.installer.forget(done.job.local_step)  # no global will include it: the next delta does
            self.uploader.carry_over(done)
        self.poller.collect()

    # ---------------------------------------------------------------- globals

    def _downloaded(self, n: int) -> None:
        self.counters.bytes_downloaded += n

    def fetch_global(self) -> GlobalSnapshot | None:
        """A global newer than the installed/staged one (joiner.GlobalReader), None if there is none."""
        try:
            return self.joiner.fetch(self.newest_known())
        except InvalidTensorFile:
            self.counters.rejected_globals += 1
            raise

    def _safe_fetch(self) -> GlobalSnapshot | None:
        try:
            return self.fetch_global()
        except Exception as err:  # a poll never kills training
            self.poller.failed(err)
            return None

    def newest_known(self) -> int:
        return self.installer.newest_known()

    def stage(self, snapshot: GlobalSnapshot) -> None:
        """Keep the newest global for the training thread (called from any thread)."""
        self.installer.stage(snapshot)

    def check_layout(self, state: dict[str, torch.Tensor], what: str) -> None:
        self.installer.check_layout(state, what)

    def install_staged(self, job: DeltaJob | None = None) -> bool:
        """Step 6, on the training thread: copy a staged newer global into the live model. `job`: the
        boundary's upload, not yet dispatched (`replace`): its snapshot, which the global replaces as the
        baseline, becomes its delta in place."""
        snapshot = self.installer.take()
        if snapshot is None:
            return False
        try:
            self.installer.check_layout(snapshot.state, f"global outer step {snapshot.outer_step}")
        except DumbDiLoCoError as err:
            self.counters.rejected_globals += 1
            log.error("node %s: not installing: %s", self.s.node_id, err)
            return False
        up = self.uploader
        baseline, restarted = self.installer.install(snapshot, up.baseline, up.in_flight, job)
        up.rebase(baseline, restart=restarted)  # translate: the node's own progress stays on top
        self.global_progress.installed(
            snapshot.included, self.local_step, snapshot.step_micros, self.stall.step_micros
        )
        self.counters.installs += 1
        log.info("node %s: installed global outer step %d", self.s.node_id, snapshot.outer_step)
        return True

    # ---------------------------------------------------------------- start

    def connect(self) -> None:
        """Open the repository; a worker waits for the first global and stages it (joiner.Joiner)."""
        first = self.joiner.connect(self.fetch_global, holding_a_global=self.newest_known() >= 0)
        if first is not None:
            self.stage(first)
        self.uploader.connect(self.joiner.transport)

    def start(self) -> None:
        """Once the trainer has restored its checkpoint, before the first forward pass: connect, continue
        from the latest global (or the checkpoint's inner loop), start the lanes and the master's loop."""
        s = self.s
        if self.closed:
            raise s.error("this node was closed; it cannot be started again")
        if self.started:
            return
        with deadline(time.monotonic() + s.startup_timeout, "start-up"):  # retries included
            self.connect()
            if self.master is not None:
                self.master.start(self.model.state_dict())  # stages its global
                self._publish_tokenizer()
            else:
                newer = self._safe_fetch()
                if newer is not None:
                    self.stage(newer)
            self.uploader.announce()  # the master waits for this node at its end
            if self._resume is None and self.master is not None:
                self.joiner.await_quorum(self.master.outer_step)  # not a round ahead of the others
            if self._resume is not None:
                at_boundary = not (self._resume.get("steps_since_capture") or self._resume.get("carry"))
                self._resume_inner_loop()
                if at_boundary:  # what the uninterrupted node did there: install a newer global, if any
                    self.install_staged()
            elif not self.install_staged():
                raise self.s.error("the global model cannot be installed into this model")
        self._start_lanes()
        self.started = True
        upload, poll = ("async" if on else "sync" for on in (s.async_delta_upload, s.async_global_poll))
        poll = "callback" if s.is_master else poll
        log.info(
            f"node {s.node_id} ({s.role}, {upload} upload, {poll} poll): starting from global outer step "
            f"{self.installer.outer_step}, a delta every {s.inner_steps} steps"
        )

    def _publish_tokenizer(self) -> None:
        """The run's tokenizer beside config.json, so AutoTokenizer.from_pretrained(repo) loads what
        AutoModelForCausalLM does; one write, skipped when the repository holds these bytes already."""
        files, transport = self.tokenizer_files, self.joiner.transport
        if not files:
            return
        try:
            if all(transport.read(path, max_bytes=len(data)) == data for path, data in files.items()):
                return
        except TransportError:  # absent (RemoteNotFound), larger, or unreadable: write them
            pass
        transport.write(files, message=f"{self.s.node_id}: the run's tokenizer")

    def _start_lanes(self) -> None:
        s = self.s

        def lane(name: str, on: bool):
            return ThreadPoolExecutor(1, f"dumb-diloco-{name}-{s.node_id}") if on else InlineLane()

        self.uploader.start(lane("upload", s.async_delta_upload))
        self.poller.start(lane("poll", s.async_global_poll and not s.is_master))

    # ---------------------------------------------------------------- the end

    def finish(self) -> bool:
        """End of training (ending.py): the last delta and the final marker (within shutdown_timeout); on a
        worker, what the master did with that delta (within the same deadline); on the master, rounds until
        every node's final delta is processed (within drain_timeout), whose global is installed for the
        final evaluation. True when the model changed. It does not close: the trainer calls `close` last,
        after the final evaluation, checkpoint and summary (the order of src/diloco/strategy.py)."""
        end, bound = self.clock() + self.s.shutdown_timeout, time.monotonic() + self.s.shutdown_timeout
        with deadline(bound, "shutdown"):  # the Hub's retries included
            self.send_final(end)
        if self.master is not None:
            self.master.stop(self.s.drain_timeout)
        if self.outer is None:
            with deadline(bound, "shutdown"):
                identity = (
                    (self.s.node_id, *self.uploader.last_uploaded) if self.uploader.last_uploaded else None
                )
                self.final_status = await_final_status(
                    self.transport,
                    identity,
                    end,
                    poll_interval=self.s.poll_interval,
                    clock=self.clock,
                    sleep=self.sleep,
                )
            log.info(f"node {self.s.node_id}: final delta {self.final_status}")
            return False
        identity = (self.s.node_id, *self.uploader.last_uploaded) if self.uploader.last_uploaded else None
        self.final_status = self.master.final_status(identity)
        final = self.master.snapshot()
        if final.outer_step <= self.installer.outer_step:
            return False
        with torch.no_grad():
            for k, t in self.model.state_dict().items():
                t.copy_(final.state[k])
        log.info(
            f"master: installed the final global (outer step {final.outer_step}) for the final evaluation"
        )
        return True

    def send_final(self, end: float) -> None:
        """The steps since the last boundary (and a failed upload's progress) as one last delta, then the
        final marker; each wait bounded by `end` (clock time)."""
        if self.closed or not self.started:
            return
        if not self.wait_upload(end):
            return
        if self.uploader.unsent:
            self.uploader.dispatch(self.capture(self.local_step))
            if not self.wait_upload(end):
                return
        self.uploader.mark_finished(self.local_step)

    def wait_upload(self, end: float) -> bool:
        """Wait for the upload in flight (if any) until `end`; True when none is in flight any more."""
        self.uploader.wait(end)
        self.collect()
        if self.uploader.uploading:
            self.uploader.warn_still_uploading()
        return not self.uploader.uploading

    def close(self) -> None:
        """Bounded shutdown (idempotent): wait for an in-flight upload and (master) a last outer round."""
        if self.closed:
            return
        self.closed = True
        self.wait_upload(self.clock() + self.s.shutdown_timeout)
        self.uploader.shutdown()
        self.poller.shutdown()
        if self.master is not None:
            self.master.close()  # a last outer round, then the lock released
        if self.uploader.carry is not None:
            log.warning(
                f"node {self.s.node_id}: {self.uploader.carry.steps} step(s) of progress were never uploaded "
                "(upload failed)"
            )

    # ---------------------------------------------------------------- metrics, state

    def metrics(self, stall: float | None = None) -> dict[str, float]:
        c = self.counters
        m = {
            "outer/step": self.installer.outer_step,
            "outer/installs": c.installs,
            "outer_lr": self.s.outer_lr,
            "num_peers": self.installer.num_peers,
            "comm/delta_bytes": self.uploader.last_delta_bytes,
            "comm/upload_seconds": self.uploader.last_upload_seconds,
            "comm/stall_seconds_total": c.stall_seconds,
            "comm/bytes_uploaded": c.bytes_uploaded,
            "comm/bytes_downloaded": c.bytes_downloaded,
            "comm/total_bytes": self.total_bytes,
            "comm/uploads": c.uploads,
            "comm/upload_failures": c.upload_failures,
            "comm/skipped_boundaries": c.skipped_boundaries,
            "comm/poll_failures": c.poll_failures,
        }
        if stall is not None:
            m["comm/boundary_stall_seconds"] = stall
        if self.codec.lossy:  # ||Q(v) - v|| / ||v|| of the last delta encoded (like DiLoCo's)
            m["comm/cast_rel_error"] = self.codec.rel_error
        if self.master is not None:
            m |= self.master.metrics()
        return m

    def summary(self) -> dict:
        """Final figures (pure: what was counted so far; `close` first to count the in-flight work)."""
        c, s, gp = self.counters, self.s, self.global_progress
        out = self.metrics() | {
            "comm/boundary_stall_seconds": c.boundary_stall_seconds,
            "comm/boundary_stall_seconds_mean": c.boundary_stall_seconds / max(c.boundaries, 1),
            "comm/boundary_stall_seconds_max": self.stall.max_boundary,
            "comm/boundaries": c.boundaries,
            "outer/rejected_globals": c.rejected_globals,
            "dumb_diloco/role": s.role,
            "dumb_diloco/node_id": s.node_id,
            "dumb_diloco/final_delta": self.final_status,
            "dumb_diloco/budget": s.budget,
            "dumb_diloco/local_steps": self.local_step,
            "dumb_diloco/run_step": self.progress(self.local_step),  # this node's estimate at its end
            "dumb_diloco/pace": gp.pace,  # its speed / the fastest's (dynamic_local_steps)
            "dumb_diloco/round_steps": gp.round_steps(s.inner_steps)
            if s.dynamic_local_steps
            else s.inner_steps,
        }
        out |= self._budget_summary()
        if self.outer is not None:
            out["dumb_diloco/final_left"] = self.master.describe_left()
        return out

    def _budget_summary(self) -> dict:
        """On the master after its drain: the node-steps its final global holds (every node's newest applied
        local step, summed: the run's tokens / tokens_per_step when no delta was lost)."""
        if self.outer is None:
            return {}
        applied = self.master.node_steps_applied()
        return {
            "dumb_diloco/node_steps_applied": applied,
            "dumb_diloco/tokens_applied": applied * self.tokens_per_step,
        }

    def state_dict(self) -> dict:
        """Counters, the installed outer step and (master) the full outer state; past the spec, the
        baseline, the steps since it, a failed upload's carry and (int8/int4) the error-feedback residual,
        so that a node restarted from this checkpoint continues its inner loop exactly (its next delta is
        the uninterrupted one). An upload in flight counts as done (its delta is in no carry)."""
        up = self.uploader
        out: dict = self.counters.state_dict()
        out |= {
            "installed_outer_step": self.installer.outer_step,
            "local_step": self.local_step,
            "steps_since_capture": up.steps_since_capture,
            "baseline": {k: t.clone() for k, t in up.baseline.items()},
            "last_uploaded": list(self.uploader.last_uploaded or ()),
            "progress": self.global_progress.state_dict(),
        }
        translate = self.installer.state_dict()
        if translate is not None:  # install.translate's state (references)
            out["translate"] = translate
        if self.codec.error_feedback:  # int8/int4: the residual, as it is once the upload in flight succeeds
            out["codec"] = self.codec.state_dict(up.in_flight)
        carry = up.carry_state()
        if carry is not None:
            out["carry"] = carry
        master = self.master.state_dict() if self.master is not None else None
        if master is not None:
            out["master"] = master
        return out

    def load_state_dict(self, state: dict) -> None:
        """Before `start`: counters now; the master state and a mid-inner-loop baseline at `start`."""
        self.counters.load_state_dict(state)
        self.uploader.resume_identity(state.get("last_uploaded"))
        if "progress" in state:  # the run step as it was; the next install replaces it
            self.global_progress.load_state_dict(state["progress"])
        if "master" in state and self.master is not None:
            self.master.load(state["master"])
        try:  # the error-feedback residual continues as it was (delta_codec)
            why = self.codec.load_state_dict(state.get("codec", {}), delta_layout(self.model.state_dict()))
        except ValueError as err:
            raise self.s.error(str(err)) from None
        if why:
            log.warning(f"node {self.s.node_id}: {why}")
        if state.get("baseline"):  # continue that inner loop exactly (at a boundary: and a newer global)
            self._resume = state

    def _resume_inner_loop(self) -> None:
        """Continue the checkpoint's inner loop: the live model already holds the checkpoint's weights;
        restore the baseline, its global version and the steps since it. A newer global stays staged and
        is installed at the next boundary, after that boundary's delta captured the progress."""
        r, self._resume = self._resume, None
        assert r is not None
        expected = {k: self.installer.layout[k] for k in self.delta_keys}
        if {k: (tuple(t.shape), t.dtype) for k, t in r["baseline"].items()} != expected:
            raise self.s.error("the checkpoint's DumbDiLoCo baseline is not of this model")
        self.uploader.resume(r["baseline"], int(r.get("steps_since_capture", 0)), r.get("carry"))
        self.installer.resume(int(r["installed_outer_step"]), r.get("translate"))
        self.local_step = int(r.get("local_step", 0))
        log.info(
            f"node {self.s.node_id}: resumed mid-inner-loop at local step {self.local_step} (baseline of "
            f"global outer step {self.installer.outer_step}, {self.uploader.steps_since_capture} step(s) since)"
        )

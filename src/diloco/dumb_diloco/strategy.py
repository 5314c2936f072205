"""`distributed=dumb_diloco` for the trainer: `DumbDiLoCo`, a `Node` (node.py: the seven steps) with the
lifecycle of diloco.strategy.Strategy around it.

Invariants: the constructor does no I/O and starts no thread; `start` (after a resume) connects, recovers
and starts the lanes (a worker without a master fails there, in one line); `finish` waits for the last
upload (and, on the master, the last outer round) so `summary` counts it; `summary` has no side effects;
`close` is idempotent and bounded by shutdown_timeout. Prose: docs/dumb_diloco.md ("Restarts and
checkpoints", "Metrics").
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import torch

from .ending import announce, await_final_status, send_final, wait_upload
from .lanes import DeltaJob, InlineLane
from .node import _COUNTERS, Node
from .recovery import MasterState, delta_layout
from .settings import Settings
from .startup import await_quorum, connect, start_master
from .tensor_format import DeltaMeta
from .transport import deadline

log = logging.getLogger("diloco.dumb_diloco")


class DumbDiLoCo(Node):
    """The trainer's strategy: one node of a DumbDiLoCo run (see the module docstring)."""

    name = "dumb_diloco"

    @classmethod
    def from_config(cls, cfg, ctx, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """No I/O and no threads here: `start` connects (a worker without a master fails there). Under
        torchrun a node is G ranks with DDP inside (ranks.NodeRanks), whose rank 0 alone is a DumbDiLoCo."""
        from diloco.distributed import DataParallel, LocalTraining

        settings = Settings.from_config(cfg.distributed)
        if settings.budget == "global" and ctx.world_size > 1:  # its ranks would need rank 0's run step
            raise settings.error("distributed.budget=global is not supported yet for a node of several ranks")
        ddp = DataParallel(cfg.distributed, ctx, model) if ctx.world_size > 1 else None
        if settings.role == "single":
            return ddp or LocalTraining(ctx)
        if cfg.data.get("shard") is None and ctx.is_main:
            log.warning(
                f"node {settings.node_id}: data.shard/data.num_shards are not set, so this node reads the "
                "same data as every other node left at the default; give node i of n `data.shard=i "
                "data.num_shards=n`"
            )
        hf_config = json.loads(model.config.to_json_string()) if hasattr(model, "config") else None
        batch = cfg.train.batch_size  # the node's, split among its ranks
        workers = int(cfg.data.get("num_shards") or 1)
        if settings.budget == "global":  # the budget's node count, checked by diloco.config.validate
            workers = int(cfg.data.get("num_shards") or cfg.launch.nodes)
        leader = None
        if ctx.is_main:
            leader = cls(
                model,
                settings,
                optimizer=optimizer,
                num_workers=workers,
                hf_config=hf_config,
                tokens_per_step=batch * cfg.data.seq_len,
                samples_per_step=batch,
            )
        if ddp is None:
            return leader
        from .ranks import NodeRanks

        return NodeRanks(ctx, model, optimizer, ddp, leader, settings, workers)

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

    def finish(self) -> bool:
        """End of training (ending.py): the last delta and the final marker (within shutdown_timeout); on a
        worker, what the master did with that delta (within the same deadline); on the master, rounds until
        every node's final delta is processed (within drain_timeout), whose global is installed for the
        final evaluation. True when the model changed."""
        end, bound = self.clock() + self.s.shutdown_timeout, time.monotonic() + self.s.shutdown_timeout
        with deadline(bound, "shutdown"):  # the Hub's retries included
            send_final(self, end)
        self._stop_outer(self.s.drain_timeout)
        self.close()
        if self.outer is None:
            with deadline(bound, "shutdown"):
                self.final_status = await_final_status(self, end)
            log.info(f"node {self.s.node_id}: final delta {self.final_status}")
            return False
        self.final_status = self._own_final_status()
        if (final := self.outer.snapshot()).outer_step <= self.installed_outer_step:
            return False
        with torch.no_grad():
            for k, t in self.model.state_dict().items():
                t.copy_(final.state[k])
        log.info(
            f"master: installed the final global (outer step {final.outer_step}) for the final evaluation"
        )
        return True

    def _own_final_status(self) -> str:
        if self.last_uploaded is None:
            return "none: this node uploaded no delta"
        with self.outer.lock:
            e = self.outer.state.ledger.get((self.s.node_id, *self.last_uploaded))
        return f"{e.status} at outer step {e.outer_step}" if e is not None else "not applied"

    def _stop_outer(self, drain_timeout: float) -> None:
        """The master's loop: rounds until every node's final delta is processed (at most `drain_timeout`;
        0: one last round, as `close` after a failure does), then stop. Idempotent."""
        if self.outer is not None and not self.outer._stop.is_set():  # idempotent
            if not self.outer.stop(drain_timeout, self.s.shutdown_timeout):
                log.warning("master: the outer loop was still running after the shutdown timeout; leaving it")
            self.outer.save_state()

    def connect(self) -> None:
        connect(self)  # startup.py: open the repository; a worker waits for the first global

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
            if s.is_master:
                start_master(self)
            elif (newer := self._safe_fetch()) is not None:
                self.stage(newer)
            announce(self)  # the master waits for this node at its end
            if self._resume is None:
                await_quorum(self)  # a master with a quorum: not a round ahead of the others
            if self._resume is not None:
                at_boundary = not (self._resume.get("steps_since_capture") or self._resume.get("carry"))
                self._resume_inner_loop()
                if at_boundary:  # what the uninterrupted node did there: install a newer global, if any
                    self._install_staged()
            elif not self._install_staged():
                raise self.s.error("the global model cannot be installed into this model")
        for lane, on in (("upload", s.async_delta_upload), ("poll", s.async_global_poll and not s.is_master)):
            self._lanes[lane] = (
                ThreadPoolExecutor(1, f"dumb-diloco-{lane}-{s.node_id}") if on else InlineLane()
            )
        self._last_poll = self.clock()
        self.started = True
        upload, poll = ("async" if on else "sync" for on in (s.async_delta_upload, s.async_global_poll))
        poll = "callback" if s.is_master else poll
        log.info(
            f"node {s.node_id} ({s.role}, {upload} upload, {poll} poll): starting from global outer step "
            f"{self.installed_outer_step}, a delta every {s.inner_steps} steps"
        )

    def summary(self) -> dict:
        """Final figures (pure: what was counted so far; `close` first to count the in-flight work)."""
        return (
            self.metrics()
            | {
                "comm/boundary_stall_seconds": self.boundary_stall_seconds,
                "comm/boundary_stall_seconds_mean": self.boundary_stall_seconds / max(self.boundaries, 1),
                "comm/boundary_stall_seconds_max": self.max_boundary_stall,
                "comm/boundaries": self.boundaries,
                "outer/rejected_globals": self.rejected_globals,
                "dumb_diloco/role": self.s.role,
                "dumb_diloco/node_id": self.s.node_id,
                "dumb_diloco/final_delta": self.final_status,
                "dumb_diloco/budget": self.s.budget,
                "dumb_diloco/local_steps": self.local_step,
                "dumb_diloco/run_step": self.progress(self.local_step),  # this node's estimate at its end
                "dumb_diloco/pace": self.global_progress.pace,  # its speed / the fastest's (dynamic_local_steps)
                "dumb_diloco/round_steps": self.global_progress.round_steps(self.s.inner_steps)
                if self.s.dynamic_local_steps
                else self.s.inner_steps,
            }
            | self._budget_summary()
            | ({"dumb_diloco/final_left": self.outer.describe_left()} if self.outer is not None else {})
        )

    def _budget_summary(self) -> dict:
        """On the master after its drain: the node-steps its final global holds (every node's newest applied
        local step, summed: the run's tokens / tokens_per_step when no delta was lost)."""
        if self.outer is None:
            return {}
        with self.outer.lock:
            applied = sum(max(step, 0) for step in self.outer.state.ledger.included.values())
        return {
            "dumb_diloco/node_steps_applied": applied,
            "dumb_diloco/tokens_applied": applied * self.tokens_per_step,
        }

    def state_dict(self) -> dict:
        """Counters, the installed outer step and (master) the full outer state; past the spec, the
        baseline, the steps since it, a failed upload's carry and (int8/int4) the error-feedback residual,
        so that a node restarted from this checkpoint continues its inner loop exactly (its next delta is
        the uninterrupted one). An upload in flight counts as done (its delta is in no carry)."""
        out: dict = {k: getattr(self, k) for k in _COUNTERS}
        out |= {
            "installed_outer_step": self.installed_outer_step,
            "local_step": self.local_step,
            "steps_since_capture": self._steps_since_capture,
            "baseline": {k: t.clone() for k, t in self._baseline.items()},
            "last_uploaded": list(self.last_uploaded or ()),
            "progress": self.global_progress.state_dict(),
        }
        if self.translating and self.reference is not None:  # install.translate's state (references)
            out["translate"] = {"reference": self.reference, "included_step": self.included_step}
            out["translate"]["pending"] = {
                str(k): dict(v) for k, v in self.pending_snapshots.items()
            }  # no file
        if self.codec.error_feedback:  # int8/int4: the residual, as it is once the upload in flight succeeds
            out["codec"] = self.codec.state_dict(self._upload[0] if self._upload is not None else None)
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
        if last := state.get("last_uploaded"):
            self.last_uploaded = (int(last[0]), str(last[1]))
        if "progress" in state:  # the run step as it was; the next install replaces it
            self.global_progress.load_state_dict(state["progress"])
        if "master" in state and self.s.is_master:
            self.ckpt_master = MasterState.from_checkpoint(state["master"])
        try:  # the error-feedback residual continues as it was (delta_codec)
            if why := self.codec.load_state_dict(
                state.get("codec", {}), delta_layout(self.model.state_dict())
            ):
                log.warning(f"node {self.s.node_id}: {why}")
        except ValueError as err:
            raise self.s.error(str(err)) from None
        if state.get("baseline"):  # continue that inner loop exactly (at a boundary: and a newer global)
            self._resume = state

    def _resume_inner_loop(self) -> None:
        """Continue the checkpoint's inner loop: the live model already holds the checkpoint's weights;
        restore the baseline, its global version and the steps since it. A newer global stays staged and
        is installed at the next boundary, after that boundary's delta captured the progress."""
        r, self._resume = self._resume, None
        assert r is not None
        expected = {k: self._global_layout[k] for k in self.delta_keys}
        if {k: (tuple(t.shape), t.dtype) for k, t in r["baseline"].items()} != expected:
            raise self.s.error("the checkpoint's DumbDiLoCo baseline is not of this model")
        self._baseline = {k: t.detach().to("cpu", copy=True) for k, t in r["baseline"].items()}
        self.installed_outer_step = int(r["installed_outer_step"])
        self.local_step = int(r.get("local_step", 0))
        self._steps_since_capture = int(r.get("steps_since_capture", 0))
        if (t := r.get("translate")) and self.translating:
            self.reference, self.included_step = dict(t["reference"]), int(t["included_step"])
            self.pending_snapshots = {int(k): dict(v) for k, v in t["pending"].items()}
        if c := r.get("carry"):
            meta = DeltaMeta(self.s.node_id, 0, int(c["base_outer_step"]))
            self._carry = DeltaJob(0, "", meta, int(c["steps"]), delta=dict(c["delta"]))
        log.info(
            f"node {self.s.node_id}: resumed mid-inner-loop at local step {self.local_step} (baseline of "
            f"global outer step {self.installed_outer_step}, {self._steps_since_capture} step(s) since)"
        )

    def close(self) -> None:
        """Bounded shutdown (idempotent): wait for an in-flight upload and (master) a last outer round."""
        if self.closed:
            return
        self.closed = True
        wait_upload(self, self.clock() + self.s.shutdown_timeout)
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        self._stop_outer(0.0)
        if self.state_lock is not None:
            self.state_lock.close()  # releases the flock on <state_dir>/<node_id>/master.lock
        if self._carry is not None:
            log.warning(
                f"node {self.s.node_id}: {self._carry.steps} step(s) of progress were never uploaded "
                "(upload failed)"
            )

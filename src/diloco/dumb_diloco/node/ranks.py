"""A DumbDiLoCo node of G ranks (`torchrun --nproc_per_node G`, one torchrun per node): DDP inside the node
over its own process group, and exactly one rank, the node's rank 0, that talks to the store (uploads,
polls, and on the master the outer loop). A global reaches every rank at the same step: at start, at every
boundary and at the master's final global, rank 0 broadcasts whether it installed one and, if so, the
weights; every rank then clears its inner optimizer as rank 0 does.

Invariants: the node's ranks hold bit-identical weights after every install (checked by SHA-256 at the
start and at the end: a node whose ranks disagree stops with one line); the other ranks never open the
store; a failure of rank 0's start or finish reaches every rank as one line. Prose: docs/dumb_diloco.md
("A node of several GPUs").
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from diloco.distributed import DataParallel, DistContext, DistributedError
from diloco.model import weights_sha256

log = logging.getLogger("diloco.dumb_diloco")


class NodeRanks:
    """The trainer's strategy on every rank of a node of G > 1 ranks; `leader` is rank 0's DumbDiLoCo."""

    name = "dumb_diloco"

    def __init__(self, ctx: DistContext, model, optimizer, ddp: DataParallel, leader, settings, num_workers):
        self.ctx = ctx
        self.model = model
        self.optimizer = optimizer
        self.ddp = ddp
        self.leader = leader  # leader: None on ranks > 0
        self.s = settings
        self.num_workers = num_workers

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.ddp.wrap(model)

    def grad_sync(self, last_micro_step: bool):
        return self.ddp.grad_sync(last_micro_step)

    def eval_weights(self, step: int):
        return self.ddp.eval_weights(step)

    def progress(self, step: int) -> float:
        return step  # budget: global is refused for a node of several ranks (DumbDiLoCo.from_config)

    def start(self) -> None:
        """Rank 0 connects and installs the starting global (or resumes); every rank then holds its weights."""
        self._on_leader("start", lambda leader: leader.start())
        self._install_from_leader(True)
        self.check_same_weights("after the start")
        if self.ctx.is_main:
            log.info(
                f"node {self.s.node_id}: {self.ctx.world_size} ranks (DDP inside the node), rank 0 uploads"
            )

    def after_inner_step(self, step: int) -> dict[str, float]:
        result = self.leader.on_step(step) if self.leader is not None else None
        # installs happen at boundaries (and at start and finish), or at any step with install_when_staged
        boundary = step % self.s.inner_steps == 0 or self.s.install_when_staged
        installed = boundary and self._install_from_leader(result is not None and result.installed)
        if installed and self.s.reset_inner_optimizer:
            self.optimizer.state.clear()
        return (result.metrics or {}) if result is not None else {}

    def finish(self) -> bool:
        """Rank 0's end of run (its last delta; the master's drain and final global), on every rank."""
        changed = self._on_leader("finish", lambda leader: leader.finish())
        changed = self._install_from_leader(bool(changed))
        self.check_same_weights("at the end")
        return changed

    def state_dict(self) -> dict:
        return {"ddp": self.ddp.state_dict(), "node": self.leader.state_dict() if self.leader else {}}

    def load_state_dict(self, state: dict) -> None:
        self.ddp.load_state_dict(state["ddp"])
        if self.leader is not None:
            self.leader.load_state_dict(state["node"])

    def summary(self) -> dict:
        node = self.leader.summary() if self.leader is not None else {}
        return node | {
            "dumb_diloco/ranks_per_node": self.ctx.world_size,
            "comm/ddp_bytes": self.ddp.total_bytes,
        }

    def close(self) -> None:
        if self.leader is not None:
            self.leader.close()

    # ---- inside the node

    def _on_leader(self, what: str, fn):
        """Run `fn(leader)` on rank 0; every rank learns whether it failed (and then raises: rank 0 its
        own error, the others one line pointing at rank 0's log)."""
        result, error = None, None
        if self.leader is not None:
            try:
                result = fn(self.leader)
            except Exception as err:  # re-raised below, after the other ranks heard of it
                error = err
        failed = torch.tensor([error is not None], dtype=torch.int32, device=self.ctx.device)
        dist.broadcast(failed, src=0)
        if error is not None:
            raise error
        if bool(failed.item()):
            raise DistributedError(
                f"node {self.s.node_id}: rank 0 failed to {what} (its error is in its log)"
            )
        return result

    def _install_from_leader(self, installed: bool) -> bool:
        """Broadcast rank 0's `installed`; if set, its weights to every rank. Returns the flag."""
        flag = torch.tensor([installed], dtype=torch.int32, device=self.ctx.device)
        dist.broadcast(flag, src=0)
        if not bool(flag.item()):
            return False
        with torch.no_grad():
            for t in self.model.state_dict().values():
                dist.broadcast(t, src=0)
        return True

    def check_same_weights(self, when: str) -> None:
        """Every rank holds the same weights (a collective): a DistributedError names those that differ."""
        mine = weights_sha256(self.model)
        hashes: list = [None] * self.ctx.world_size
        dist.all_gather_object(hashes, mine)
        if len(set(hashes)) > 1:
            differ = [r for r, h in enumerate(hashes) if h != hashes[0]]
            raise DistributedError(
                f"node {self.s.node_id}: the weights of ranks {differ} differ from rank 0's {when} (SHA-256)"
            )

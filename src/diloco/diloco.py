"""Synchronous DiLoCo: Douillard et al., arXiv 2311.08105, Algorithm 1, as OpenDiLoCo runs it
(Jaghouar et al., arXiv 2407.07852, Sec. 2-3). Per worker i of W:

    theta_0: global weights, the same on every worker
    for outer step t = 1..T:
        theta_i <- theta_{t-1}
        for inner step h = 1..H:                                  # the ordinary training loop
            theta_i <- AdamW(theta_i, grad L(theta_i; x ~ D_i))
        pseudo_grad_i = theta_{t-1} - theta_i                       # float32
        pseudo_grad = 1/W sum_i pseudo_grad_i                       # one all-reduce per bucket
        theta_t <- SGD_nesterov(theta_{t-1}, pseudo_grad)           # outer_lr 0.7, outer_momentum 0.9

The trainer calls `after_inner_step(step)` after every AdamW step; every H steps it runs `outer_step`.
The global copy theta_{t-1} and the outer momentum live in float32 on `global_copy_device`. The
averaging goes through `diloco.comm.Averager` (pseudo_grad_dtype float32/float16/bfloat16, all-reduced) or
`diloco.quant.QuantizedAverager` (int8/int4 codes with error feedback, all-gathered). A worker
of G > 1 ranks trains with DDP inside; its ranks split the buckets, each all-reduces its share with
its counterparts in the other workers and broadcasts the mean to its worker, so a worker sends every
byte of the pseudo-gradient once. OpenDiLoCo keeps the AdamW state across rounds; the DumbDiLoCo
spec resets it (`reset_inner_optimizer`).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext

import torch

from diloco import comm, quant
from diloco.checkpoint import CheckpointError
from diloco.config import check_distributed
from diloco.outer import OuterOptimizer


def make_buckets(params: list[torch.Tensor], bucket_size_mb: float) -> list[list[torch.Tensor]]:
    """Consecutive parameters in groups of at most bucket_size_mb of float32 (a bigger tensor alone)."""
    limit, buckets, size = bucket_size_mb * 2**20 / 4, [[]], 0
    for p in params:
        if buckets[-1] and size + p.numel() > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel()
    return buckets


class DiLoCo:
    name = "diloco"

    @classmethod
    def from_config(cls, dcfg, ctx, model, optimizer) -> DiLoCo:
        from diloco.distributed import DataParallel

        check_distributed(dcfg)
        # DDP inside the worker; also checks that every rank holds the same shapes and initial weights
        inner = DataParallel(dcfg, ctx, model, group=ctx.worker_group)
        timeout = dcfg.timeout_seconds
        keys = ("inner_steps", "outer_lr", "outer_momentum", "nesterov", "pseudo_grad_dtype", "fp16_scaling",
                "error_feedback", "quant_block_size", "global_copy_device", "reset_inner_optimizer",
                "bucket_size_mb", "cosine_sample_size", "cosine_sample_seed")  # fmt: skip
        cross, intra = (comm.group_collective(g, timeout) for g in (ctx.cross_group, ctx.worker_group))
        return cls(model, optimizer, cross, intra=intra, inner_strategy=inner, **{k: dcfg[k] for k in keys})

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        cross: comm.Collective,
        *,
        inner_steps: int,
        outer_lr: float,
        outer_momentum: float,
        nesterov: bool,
        pseudo_grad_dtype: str,
        fp16_scaling: bool,
        global_copy_device: str,
        reset_inner_optimizer: bool,
        bucket_size_mb: float,
        cosine_sample_size: int,
        cosine_sample_seed: int,
        error_feedback: bool | None = None,
        quant_block_size: int = 256,
        intra: comm.Collective | None = None,
        inner_strategy=None,
    ):
        self.inner_optimizer, self.inner_steps = inner_optimizer, inner_steps
        self.reset_inner_optimizer = reset_inner_optimizer
        self.cross, self.intra = cross, intra or comm.SoloCollective()
        self.num_workers = cross.size
        self.inner_strategy = inner_strategy
        if pseudo_grad_dtype in quant.QUANT_BITS:  # int8/int4 codes, all-gathered, with error feedback
            ef = error_feedback is None or error_feedback
            self.averager = quant.QuantizedAverager(cross, pseudo_grad_dtype, quant_block_size, ef)
        else:
            self.averager = comm.Averager(cross, pseudo_grad_dtype, fp16_scaling)
        self.buckets = make_buckets([p for p in model.parameters()], bucket_size_mb)
        self.sizes = [[p.numel() for p in b] for b in self.buckets]
        self.device = next(model.parameters()).device
        home = torch.device("cpu") if global_copy_device == "cpu" else self.device
        with torch.no_grad():  # theta_0, float32
            self.global_params = [
                torch.cat([p.reshape(-1).float() for p in b]).to(home) for b in self.buckets
            ]
        self.outer_optimizer = OuterOptimizer(
            self.global_params, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov
        )
        # On the CPU a fresh 128 MB buffer costs page faults every round (several times a copy): reuse them.
        self._pseudo_grads = (
            [torch.empty(t.numel(), device=self.device) for t in self.global_params]
            if self.device.type == "cpu"
            else None
        )
        positions = comm.sample_positions(
            [sum(s) for s in self.sizes], cosine_sample_size, cosine_sample_seed, self.device
        )
        self.meter = comm.RoundMeter(self.averager, self.intra, positions)
        self.outer_round, self.total_bytes, self.metric_bytes = 0, 0, 0
        self.comm_seconds, self.outer_seconds, self.inner_seconds = 0.0, 0.0, 0.0
        self._round_start: float | None = None

    # ---------------------------------------------------------------------------- the training loop's hooks
    def wrap(self, model):
        return self.inner_strategy.wrap(model) if self.inner_strategy else model

    def start(self) -> None:
        pass

    def finish(self) -> bool:
        return False  # every worker already holds the last global weights it evaluates

    def grad_sync(self, last_micro_step: bool):
        if self._round_start is None:  # first micro-step of a round: the inner compute clock starts
            self._round_start = time.perf_counter()
        return self.inner_strategy.grad_sync(last_micro_step) if self.inner_strategy else nullcontext()

    def after_inner_step(self, step: int) -> dict[str, float]:
        if step % self.inner_steps:
            return {}
        start = time.perf_counter()
        inner = start - (self._round_start or start)
        metrics = self.outer_step()
        wall = time.perf_counter() - start
        self.inner_seconds += inner
        self.outer_seconds += wall - metrics["comm/seconds"]
        self._round_start = None
        return {
            **metrics,
            "outer/seconds": wall - metrics["comm/seconds"],
            "outer/inner_seconds": inner,
            "outer/compute_utilization": inner / max(inner + wall, 1e-9),
        }

    @contextmanager
    def eval_weights(self, step: int):
        """Inside: the model holds the last averaged (global) weights, the ones an evaluation must see.
        Mid-round (a run ending, or interrupted, between two outer steps) the live weights are one
        worker's local ones: they are set aside on the CPU and put back afterwards."""
        if step % self.inner_steps == 0:
            yield
            return
        with torch.no_grad():
            local = [[p.detach().to("cpu", copy=True) for p in params] for params in self.buckets]
            for params, theta in zip(self.buckets, self.global_params):
                torch._foreach_copy_(params, _views(theta.to(self.device), params))
        try:
            yield
        finally:
            with torch.no_grad():
                for params, saved in zip(self.buckets, local):
                    for p, t in zip(params, saved):
                        p.copy_(t)

    # ---------------------------------------------------------------------------- the outer step
    @torch.no_grad()
    def outer_step(self) -> dict[str, float]:
        """Average the pseudo-gradients, step the outer optimizer, restart from the new global weights."""
        self.outer_round += 1
        self.meter.begin()
        mean_sq, grads = [], []
        for b, (params, sizes, theta) in enumerate(zip(self.buckets, self.sizes, self.global_params)):
            owner = b % self.intra.size  # the rank of this worker that all-reduces bucket b
            pseudo_grad = (  # [n] float32
                self._pseudo_grads[b]
                if self._pseudo_grads
                else torch.empty(theta.numel(), device=self.device)
            )
            if owner == self.intra.rank:
                torch._foreach_copy_(_views(pseudo_grad, params), params)  # theta_i
                torch.sub(theta.to(self.device), pseudo_grad, out=pseudo_grad)  # theta_{t-1} - theta_i
                self.meter.observe(b, pseudo_grad)
                self.averager.average_(pseudo_grad, sizes, key=b)  # 1/W sum_i, pseudo_grad_dtype on the wire
            self.intra.broadcast_(pseudo_grad, src=owner, tag="intra_worker")
            mean_sq.append(torch.linalg.vector_norm(pseudo_grad).double().square())  # one pass, no copy
            grads.append(pseudo_grad.to(theta.device))
        norm = math.sqrt(torch.stack(mean_sq).sum().item())
        if not math.isfinite(norm):  # the same on every rank: all fail together, nothing is applied
            raise FloatingPointError(
                f"outer step {self.outer_round}: the averaged pseudo-gradient is not finite (training "
                f"diverged, or the {self.averager.dtype} sum overflowed: try fp16_scaling=true or float32)"
            )
        self.outer_optimizer.step(grads)  # theta_t
        for params, theta in zip(self.buckets, self.global_params):  # every rank restarts from theta_t
            torch._foreach_copy_(params, _views(theta.to(self.device), params))
        if self.reset_inner_optimizer:
            self.inner_optimizer.state.clear()
        return self._round_metrics(norm)

    def _round_metrics(self, norm: float) -> dict[str, float]:
        m = self.meter.finish(self.device)
        sent = m["payload"] + m["scales"]  # what this worker sent to the others (per worker, all ranks)
        self.total_bytes += sent
        self.metric_bytes += m["metric"]
        self.comm_seconds += m["seconds"]
        out = {
            "outer_lr": self.outer_optimizer.lr,
            "num_peers": self.cross.size,
            "outer/round": self.outer_round,
            "outer/pseudo_grad_norm": norm,
            "outer/local_pseudo_grad_norm": m["local_norm"],
            "comm/bytes": sent,
            f"comm/bytes_{self.averager.dtype}": m["payload"],
            "comm/scale_bytes": m["scales"],
            "comm/metric_bytes": m["metric"],
            "comm/bytes_per_inner_step": sent / self.inner_steps,
            "comm/intra_worker_total_bytes": self._intra_bytes(),
            "comm/seconds": m["seconds"],
            "comm/total_bytes": self.total_bytes,
        }
        if m["cosine"] is not None:
            out["outer/cosine_similarity"] = m["cosine"]
        if self.averager.wire != torch.float32:
            out.update(m["cast"])
        return out

    # ---------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "global_params": [t.cpu() for t in self.global_params],
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "outer_round": self.outer_round,
            "total_bytes": self.total_bytes,
            "metric_bytes": self.metric_bytes,
            "seconds": [self.comm_seconds, self.outer_seconds, self.inner_seconds],
            "intra_ddp_bytes": self._ddp_bytes(),
            "averager": self.averager.state_dict(),  # int8/int4: the error-feedback residuals
        }

    def load_state_dict(self, state: dict) -> None:
        shapes = [t.shape for t in state["global_params"]]
        if shapes != [t.shape for t in self.global_params]:
            raise CheckpointError(
                "the checkpoint's DiLoCo buckets do not match this run's (bucket_size_mb changed?)"
            )
        torch._foreach_copy_(self.global_params, state["global_params"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.averager.load_state_dict(state.get("averager", {}), self.device)
        self.outer_round, self.total_bytes = int(state["outer_round"]), int(state["total_bytes"])
        self.metric_bytes = int(state["metric_bytes"])
        self.comm_seconds, self.outer_seconds, self.inner_seconds = (float(s) for s in state["seconds"])
        if self.inner_strategy is not None:
            self.inner_strategy.total_bytes = int(state["intra_ddp_bytes"])

    def summary(self) -> dict[str, float]:
        wall = self.inner_seconds + self.outer_seconds + self.comm_seconds
        return {
            "comm/total_bytes": self.total_bytes,
            "comm/metric_bytes": self.metric_bytes,
            "comm/seconds": self.comm_seconds,
            "comm/intra_worker_total_bytes": self._intra_bytes(),
            "outer/rounds": self.outer_round,
            "outer/seconds": self.outer_seconds,
            "outer/compute_utilization": self.inner_seconds / wall if wall > 0 else None,
            "num_peers": self.cross.size,
        }

    def close(self) -> None:
        pass

    def _ddp_bytes(self) -> int:
        return getattr(self.inner_strategy, "total_bytes", 0)

    def _intra_bytes(self) -> int:  # this rank, inside its worker: DDP gradients + mean broadcasts
        return self.intra.sent.get("intra_worker", 0) + self._ddp_bytes()


def _views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters' shapes over consecutive slices of one flat tensor."""
    return [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in params]), params)]

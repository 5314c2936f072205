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
averaging goes through `diloco.comm.Averager` (pseudo_grad_dtype float32/float16/bfloat16, all-reduced),
`diloco.quant.QuantizedAverager` (int8/int4 codes with error feedback, all-gathered) or
`diloco.sparse.TopKAverager` (topk2: top-k 2-bit values and indices with error feedback). A worker
of G > 1 ranks trains with DDP inside; its ranks split the buckets, each all-reduces its share with
its counterparts in the other workers and broadcasts the mean to its worker, so a worker sends every
byte of the pseudo-gradient once. OpenDiLoCo keeps the AdamW state across rounds; the DumbDiLoCo
spec resets it (`reset_inner_optimizer`).

Streaming DiLoCo (Douillard et al., arXiv 2501.18512, Sec. 2): with `fragments` P > 1 the decoder blocks
are grouped into P fragments, by default the paper's strided pattern (fragment f holds blocks f, f+P,
f+2P, ...; `fragment_layout: sequential` takes P runs of consecutive blocks), the embeddings going with
fragment 0 and the final norm and head with fragment P-1, as torchtitan's fragmenting of a Llama does;
`fragment_layout: flat` is the cut this repository used before issue 55 (P equal runs of the flattened
weights, tensors split at the boundaries). Fragment f is synchronised every H steps at offset (f+1)H/P, so one
sync sends about 1/P of the model; with `overlap_steps` tau > 0 its outer step is applied tau inner steps after
its pseudo-gradient was taken, merged as local <- alpha local + (1 - alpha) global (`fragment_alpha`).
P=1, tau=0, alpha=0 is the algorithm above, bit for bit. With one rank per worker the averaging runs on
a transfer thread during those tau steps.

Eager updates (Kale et al., arXiv 2502.12996, `eager_updates` with tau = H): the whole exchange of a
fragment overlaps its next inner phase, and its outer step does not wait for it. Worker i steps with
its own fresh pseudo-gradient standing in for its share of the mean, and the others' shares one round
late, from the mean that arrived meanwhile:

        eager_grad_i = mean_{t-1} - pseudo_grad_i,{t-1} / W + pseudo_grad_i,t / W
        theta_t,i <- SGD_nesterov(theta_{t-1},i, eager_grad_i)     # then the fragment restarts from it

so every contribution is applied once (the worker's own at once, the others' a round later; the first
round has no mean yet: pseudo_grad_i,1 / W). The workers' global weights then differ by their own
fresh shares; the last round's mean is never applied (it arrives after the run).
"""

from __future__ import annotations

import math
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from diloco import comm, quant, sparse
from diloco.checkpoint import CheckpointError
from diloco.distributed import DataParallel, FullyShardedData, local
from diloco.outer import OuterOptimizer
from diloco.schema import DiLoCoConfig


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


Pieces = list[list[tuple[torch.Tensor, torch.Tensor]]]  # per fragment, its (piece, parameter) pairs
_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder block's parameter: model.layers.<i>.


def fragment_pieces(named: list[tuple[str, torch.Tensor]], fragments: int, layout: str) -> Pieces:
    """Per fragment, its (piece, parameter) pairs: whole parameters grouped by decoder block (strided,
    sequential), or P equal runs of the flattened parameters (flat), a piece being the whole parameter or,
    across a boundary, its flat view in the fragment."""
    params = [p for _, p in named]
    if layout == "flat" or fragments == 1:
        return _flat_pieces(params, fragments)
    blocks = [int(m.group(1)) if (m := _BLOCK.search(name)) else None for name, _ in named]
    layers = sorted({b for b in blocks if b is not None})
    if len(layers) < fragments:
        raise ValueError(
            f"fragment_layout={layout} groups decoder blocks (`layers.<i>.` parameters) and this model has "
            f"{len(layers)} for {fragments} fragments: use fragment_layout=flat"
        )
    pieces: Pieces = [[] for _ in range(fragments)]
    seen_block = False
    for p, b in zip(params, blocks, strict=True):
        seen_block = seen_block or b is not None
        pieces[_fragment_of(b, seen_block, layers, fragments, layout)].append((local(p), p))
    return pieces


def _fragment_of(
    block: int | None, after_blocks: bool, layers: list[int], fragments: int, layout: str
) -> int:
    """The fragment of a parameter of decoder block `block` (None: before the blocks, the embeddings, ->
    0; after them, the final norm and head, -> P-1)."""
    if block is None:
        return fragments - 1 if after_blocks else 0
    i = layers.index(block)
    return i % fragments if layout == "strided" else i * fragments // len(layers)


def _flat_pieces(params: list[torch.Tensor], fragments: int) -> Pieces:
    """P consecutive runs of equal size of the flattened parameters (`fragment_layout: flat`)."""
    total, start = sum(local(p).numel() for p in params), 0
    if fragments > total:
        raise ValueError(f"fragments={fragments} is more than this model's {total} parameters")
    bounds = [f * total // fragments for f in range(fragments + 1)]
    pieces: Pieces = [[] for _ in range(fragments)]
    for p in params:
        t = local(p)  # a sharded parameter's own shard (P = 1 only: flat fragments refuse shards)
        end = start + t.numel()
        for f in range(fragments):
            lo, hi = max(start, bounds[f]), min(end, bounds[f + 1])
            if lo < hi:  # the whole tensor, or its part in fragment f
                pieces[f].append((t if (lo, hi) == (start, end) else t.view(-1)[lo - start : hi - start], p))
        start = end
    return pieces


def fragment_buckets(
    pieces_of: Pieces, bucket_size_mb: float
) -> tuple[list[list[torch.Tensor]], list[list[int]]]:
    """Streaming DiLoCo's fragments (`fragment_pieces`), each cut into buckets; returns the buckets
    and, per fragment, its bucket indices. P=1: make_buckets(params)."""
    buckets, ids = [], []
    for pieces in pieces_of:
        part = make_buckets([piece for piece, _ in pieces], bucket_size_mb)
        ids.append(list(range(len(buckets), len(buckets) + len(part))))
        buckets += part
    return buckets, ids


def fragment_parameters(pieces_of: Pieces) -> list[list[torch.Tensor]]:
    """Per fragment, the parameters with elements in it (a split tensor is in two): whose inner
    optimizer state a restart from the fragment's global weights resets."""
    return [[p for _, p in pieces] for pieces in pieces_of]


def make_averager(
    cross: comm.Collective,
    dtype: str,
    fp16_scaling: bool,
    error_feedback: bool | None,
    quant_block_size: int,
    topk: tuple[float, int, str, float],
):
    """The averaging of `pseudo_grad_dtype`: float32/float16/bfloat16 all-reduced (comm.Averager), int8/int4
    codes (quant.QuantizedAverager) or topk2 values and indices (sparse.TopKAverager, `topk`: density,
    chunk, normalize, error-feedback decay) all-gathered, with error feedback unless it is false."""
    ef = error_feedback is None or error_feedback
    if dtype in quant.QUANT_BITS:
        return quant.QuantizedAverager(cross, dtype, quant_block_size, ef)
    if dtype == sparse.TOPK_DTYPE:
        density, chunk, normalize, decay = topk
        return sparse.TopKAverager(cross, density, chunk, ef, normalize, decay)
    return comm.Averager(cross, dtype, fp16_scaling)


@dataclass
class _InFlight:
    """A fragment's averaged pseudo-gradients, applied `overlap_steps` after they were sent; while the
    transfer thread still averages them, `future` gives (grads, round metrics)."""

    apply_at: int  # the inner step after which they are applied
    fragment: int
    grads: dict[int, torch.Tensor] | None = None  # bucket index -> mean pseudo-gradient [n], float32
    metrics: dict = field(default_factory=dict)
    future: Future | None = None
    own: dict[int, torch.Tensor] | None = None  # eager updates: this worker's pseudo-gradient in the mean

    def wait(self) -> dict[int, torch.Tensor]:
        if self.future is not None:
            self.grads, self.metrics = self.future.result()
            self.future = None
        return self.grads


class DiLoCo:
    name = "diloco"

    @classmethod
    def from_config(
        cls, dcfg: DiLoCoConfig, ctx, model, optimizer, *, collective: comm.Collective | None = None
    ) -> DiLoCo:
        """`dcfg`: the typed block `diloco.config.validate` (or `check_distributed`) returned, not checked
        again here. `collective`: the cross-worker averaging's Collective (default: over ctx.cross_group);
        a script or test injects its own, e.g. one that simulates a slow link."""
        timeout = dcfg.timeout_seconds
        if ctx.sharded:  # FSDP2 inside the worker (train.run sharded the model): each rank averages its own
            # shard with the ranks holding the same one in the other workers, so no intra-worker exchange
            inner, intra = FullyShardedData(ctx, model, group=ctx.worker_group), None
            peers = comm.group_collective(ctx.worker_group, timeout)
            cross = collective if collective is not None else comm.group_collective(ctx.cross_group, timeout)
            return cls(model, optimizer, cross, dcfg, inner_strategy=inner, shard_peers=peers)
        else:  # DDP inside the worker; also checks that every rank holds the same shapes and initial weights
            inner = DataParallel(ctx, model, group=ctx.worker_group, bucket_cap_mb=dcfg.ddp_bucket_cap_mb)
            intra = comm.group_collective(ctx.worker_group, timeout)
        cross = collective if collective is not None else comm.group_collective(ctx.cross_group, timeout)
        return cls(model, optimizer, cross, dcfg, intra=intra, inner_strategy=inner)

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        cross: comm.Collective,
        config: DiLoCoConfig,
        *,
        intra: comm.Collective | None = None,
        inner_strategy: DataParallel | FullyShardedData | None = None,  # DDP or FSDP among the worker's ranks
        shard_peers: comm.Collective | None = None,  # FSDP: the worker's ranks, holding the other shards
    ):
        """`config`: the typed `distributed:` block (checked by `diloco.config`, not here); `cross`: the
        averaging across workers; `intra`: the worker's own ranks (None: one rank)."""
        c = config
        inner_steps, overlap_steps = c.inner_steps, c.overlap_steps
        self.inner_optimizer, self.inner_steps = inner_optimizer, inner_steps
        self.reset_inner_optimizer = c.reset_inner_optimizer
        self.cross, self.intra = cross, intra or comm.SoloCollective()
        self.num_workers = cross.size
        self.inner_strategy = inner_strategy
        topk = (c.topk_density, c.topk_chunk, c.topk_normalize, c.topk_ef_decay)
        self.averager = make_averager(
            cross, c.pseudo_grad_dtype, c.fp16_scaling, c.error_feedback, c.quant_block_size, topk
        )
        pieces = fragment_pieces(list(model.named_parameters()), c.fragments, c.fragment_layout)
        self.buckets, self.fragments = fragment_buckets(pieces, c.bucket_size_mb)
        self._fragment_params = fragment_parameters(pieces)
        # sharded workers: which of the fragment's parameters each bucket's pieces are (whole shards)
        self.shard_peers = shard_peers
        position = {id(p): i for params in self._fragment_params for i, p in enumerate(params)}
        self._piece_params = [[position[id(p)] for _, p in frag] for frag in pieces]
        # fragment f is synchronised at inner steps (f + 1) * H / P modulo H (P=1: every H steps)
        self._schedule = {(f + 1) * inner_steps // c.fragments % inner_steps: f for f in range(c.fragments)}
        self.overlap_steps, self.fragment_alpha = overlap_steps, c.fragment_alpha
        if c.eager_updates and overlap_steps != inner_steps:
            raise ValueError(
                f"eager_updates needs overlap_steps = inner_steps ({inner_steps}), got {overlap_steps}"
            )
        self.eager_updates = c.eager_updates
        self._in_flight: list[_InFlight] = []
        # tau > 0, one rank per worker: the averaging runs on this thread during the next tau inner steps
        # (with G > 1 ranks it would race DDP's collectives on the worker's group: it blocks instead)
        self._transfer = None
        if overlap_steps and (intra is None or intra.size == 1):
            self._transfer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-transfer")
        self.sizes = [[p.numel() for p in b] for b in self.buckets]
        self.device = next(model.parameters()).device
        home = torch.device("cpu") if c.global_copy_device == "cpu" else self.device
        with torch.no_grad():  # theta_0, float32
            self.global_params = [
                torch.cat([p.reshape(-1).float() for p in b]).to(home) for b in self.buckets
            ]
        self.outer_optimizer = OuterOptimizer(
            self.global_params, lr=c.outer_lr, momentum=c.outer_momentum, nesterov=c.nesterov
        )
        # On the CPU a fresh 128 MB buffer costs page faults every round (several times a copy): reuse them.
        self._pseudo_grads = (
            [torch.empty(t.numel(), device=self.device) for t in self.global_params]
            if self.device.type == "cpu"
            else None
        )
        positions = comm.sample_positions(
            [sum(s) for s in self.sizes], c.cosine_sample_size, c.cosine_sample_seed, self.device
        )
        self.meter = comm.RoundMeter(self.averager, self.intra, positions)
        self.outer_round, self.total_bytes, self.metric_bytes, self.peak_bytes = 0, 0, 0, 0
        self.comm_seconds, self.outer_seconds, self.inner_seconds = 0.0, 0.0, 0.0
        self.blocked_seconds = 0.0  # the training thread's time in outer steps (comm included unless hidden)
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
        start = time.perf_counter()
        # synced overlap_steps ago (eager updates: taken by the fragment's next outer step instead)
        due = [] if self.eager_updates else [j for j in self._in_flight if j.apply_at == step]
        fragment = self._schedule.get(step % self.inner_steps)
        if not due and fragment is None:
            return {}
        metrics = {}
        for job in due:
            self._in_flight.remove(job)
            self._apply(job.fragment, job.wait())
            metrics = job.metrics
        inner = 0.0
        if fragment is not None:  # a round of inner compute ends here
            inner = start - (self._round_start or start)
            self.inner_seconds += inner
            self._round_start = None
            metrics = self.outer_step(fragment, step) or metrics
        blocked = time.perf_counter() - start  # the training thread's wait, hidden transfers excluded
        self.blocked_seconds += blocked
        if not metrics:
            return {}
        # with overlap the transfer ran on the transfer thread, or (G > 1) inside an earlier call's wait
        outer = blocked - (0.0 if self.overlap_steps else metrics.get("comm/seconds", 0.0))
        self.outer_seconds += outer
        metrics = {**metrics, "outer/seconds": outer, "outer/blocked_seconds": blocked}
        if fragment is not None:  # this round's share of compute (the run's is in summary())
            metrics |= {
                "outer/inner_seconds": inner,
                "outer/compute_utilization": inner / max(inner + blocked, 1e-9),
            }
        return metrics

    def progress(self, step: int) -> float:
        return step  # every worker steps together: the run's step is the local one

    @contextmanager
    def eval_weights(self, step: int):
        """Inside: the model holds the last averaged (global) weights, the ones an evaluation must see.
        Mid-round (a run ending, or interrupted, between two outer steps) the live weights are one
        worker's local ones: they are set aside on the CPU and put back afterwards (always with
        fragments, overlap or mixing: the live weights are then never exactly the global ones)."""
        plain = len(self.fragments) == 1 and self.overlap_steps == 0 and self.fragment_alpha == 0
        if plain and step % self.inner_steps == 0:
            yield
            return
        with torch.no_grad():
            local = [[p.detach().to("cpu", copy=True) for p in params] for params in self.buckets]
            for params, theta in zip(self.buckets, self.global_params):
                _copy_(params, _views(theta.to(self.device), params))
        try:
            yield
        finally:
            with torch.no_grad():
                for params, saved in zip(self.buckets, local):
                    for p, t in zip(params, saved):
                        p.copy_(t)

    # ---------------------------------------------------------------------------- the outer step
    @torch.no_grad()
    def outer_step(self, fragment: int = 0, step: int = 0) -> dict[str, float]:
        """Average the fragment's pseudo-gradients; step the outer optimizer and restart from the new
        global weights now, or `overlap_steps` inner steps later (Streaming DiLoCo's overlap), the
        averaging itself then running on the transfer thread meanwhile (its metrics come with the apply)."""
        self.outer_round += 1
        if self.eager_updates:
            return self._eager_step(fragment, step)
        if self._transfer is not None:  # snapshot theta_{t-1} - theta_i now; the training goes on
            snapshot = {b: self._pseudo_grad(b, own=True) for b in self.fragments[fragment]}
            future = self._transfer.submit(self._average, fragment, snapshot)
            self._in_flight.append(_InFlight(step + self.overlap_steps, fragment, future=future))
            return {}
        grads, metrics = self._average(fragment)
        if self.overlap_steps:
            self._in_flight.append(_InFlight(step + self.overlap_steps, fragment, grads, metrics))
            return {}
        self._apply(fragment, grads)
        return metrics

    def _eager_step(self, fragment: int, step: int) -> dict[str, float]:
        """Eager updates (module docstring): send this round's pseudo-gradients, and step now with them
        standing in for this worker's share of the mean and the last round's mean for the others'."""
        last = next((j for j in self._in_flight if j.fragment == fragment), None)
        if last is not None:
            self._in_flight.remove(last)
            mean = last.wait()  # sent H steps ago: the whole inner phase to arrive
        w = self.num_workers
        eager, own, snapshot = {}, {}, {}
        for b in self.fragments[fragment]:
            # the others' shares of the last mean first: the mean may live in the buffer refilled below
            others = mean[b] - last.own[b] / w if last is not None else None
            snapshot[b] = self._pseudo_grad(b, own=True)  # theta_{t-1} - theta_i, on every rank
            own[b] = snapshot[b].to(self.global_params[b].device, copy=True)
            eager[b] = own[b] / w if others is None else others.add_(own[b], alpha=1 / w)
        if self._transfer is not None:
            future = self._transfer.submit(self._average, fragment, snapshot)
            job = _InFlight(step + self.overlap_steps, fragment, future=future, own=own)
        else:  # G > 1 ranks per worker: averaged now (module docstring), used next round all the same
            job = _InFlight(step + self.overlap_steps, fragment, *self._average(fragment, snapshot), own=own)
        self._in_flight.append(job)
        self._apply(fragment, eager)
        return {**(last.metrics if last is not None else {}), "outer/eager": 1.0}

    def _pseudo_grad(self, b: int, own: bool) -> torch.Tensor:
        """Bucket b's buffer ([n] float32); with own, filled with theta_{t-1} - theta_i."""
        params, theta = self.buckets[b], self.global_params[b]
        buf = self._pseudo_grads[b] if self._pseudo_grads else torch.empty(theta.numel(), device=self.device)
        if own:
            _copy_(_views(buf, params), params)  # theta_i
            torch.sub(theta.to(self.device), buf, out=buf)  # theta_{t-1} - theta_i
        return buf

    @torch.no_grad()
    def _average(self, fragment: int, snapshot: dict[int, torch.Tensor] | None = None):
        """The mean pseudo-gradient of the fragment's buckets over the workers, and the round's metrics."""
        self.meter.begin()
        mean_sq, grads = [], {}
        if snapshot is None and self._needs_worker_absmax():
            snapshot = {b: self._pseudo_grad(b, own=True) for b in self.fragments[fragment]}
        absmax = self._worker_absmax(fragment, snapshot) if self._needs_worker_absmax() else {}
        for b in self.fragments[fragment]:
            owner = b % self.intra.size  # the rank of this worker that all-reduces bucket b
            pseudo_grad = snapshot[b] if snapshot else self._pseudo_grad(b, own=owner == self.intra.rank)
            if owner == self.intra.rank:
                self.meter.observe(b, pseudo_grad)
                extra = {"absmax": absmax[b]} if b in absmax else {}
                self.averager.average_(pseudo_grad, self.sizes[b], key=b, **extra)  # 1/W sum_i
                self.meter.observe_mean(b, pseudo_grad)
            self.intra.broadcast_(pseudo_grad, src=owner, tag="intra_worker")
            mean_sq.append(torch.linalg.vector_norm(pseudo_grad).double().square())  # one pass, no copy
            grads[b] = pseudo_grad.to(self.global_params[b].device)
        norm = math.sqrt(torch.stack(mean_sq).sum().item())
        if not math.isfinite(norm):  # the same on every rank: all fail together, nothing is applied
            raise FloatingPointError(
                f"outer step {self.outer_round}: the averaged pseudo-gradient is not finite (training "
                f"diverged, or the {self.averager.dtype} sum overflowed: try fp16_scaling=true or float32)"
            )
        numel = sum(sum(self.sizes[b]) for b in self.fragments[fragment])
        return grads, {**self._round_metrics(norm, numel), "outer/fragment": fragment}

    def _needs_worker_absmax(self) -> bool:
        return self.shard_peers is not None and getattr(self.averager, "scaled", False)

    def _worker_absmax(self, fragment: int, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Per bucket of the fragment, its tensors' largest magnitudes over the whole worker (a MAX over
        its ranks, each of which holds a shard of every tensor): float16's per-tensor scale is then the
        whole tensor's, as with unsharded workers. One small all-reduce per outer step and fragment."""
        frag = self._fragment_params[fragment]
        per_param = torch.zeros(len(frag))
        for k, b in enumerate(self.fragments[fragment]):
            parts = grads[b].split(self.sizes[b])
            for i, t in zip(self._piece_params[fragment][self._bucket_offset(fragment, k) :], parts):
                if t.numel():  # a rank may hold no rows of a small tensor
                    per_param[i] = max(per_param[i], float(t.abs().max()))
        self.shard_peers.all_reduce_(per_param, op="max", tag="fp16_scales_worker")
        out, start = {}, 0
        for b in self.fragments[fragment]:
            ids = self._piece_params[fragment][start : start + len(self.sizes[b])]
            out[b], start = per_param[ids].clone(), start + len(self.sizes[b])
        return out

    def _bucket_offset(self, fragment: int, k: int) -> int:
        """The index, in the fragment's pieces, of the first piece of its k-th bucket."""
        return sum(len(self.sizes[b]) for b in self.fragments[fragment][:k])

    @torch.no_grad()
    def _apply(self, fragment: int, grads: dict[int, torch.Tensor]) -> None:
        """theta_t <- outer step on the fragment's mean pseudo-gradient; every rank restarts from it
        (fragment_alpha > 0: local <- alpha * local + (1 - alpha) * theta_t)."""
        self.outer_optimizer.step([grads.get(b) for b in range(len(self.buckets))])
        for b in self.fragments[fragment]:
            params, theta = self.buckets[b], _views(self.global_params[b].to(self.device), self.buckets[b])
            if self.fragment_alpha:
                for p, t in zip(params, theta):
                    p.lerp_(t, 1.0 - self.fragment_alpha)
            else:
                _copy_(params, theta)
        if self.reset_inner_optimizer:  # a split tensor's state is its whole parameter's
            for p in self._fragment_params[fragment]:
                self.inner_optimizer.state.pop(p, None)

    def _round_metrics(self, norm: float, numel: int) -> dict[str, float]:
        """The round's metrics; numel: the parameters it synchronised (all of them, or a fragment's)."""
        m = self.meter.finish(self.device)
        sent = m["payload"] + m["scales"]  # what this worker sent to the others (per worker, all ranks)
        self.total_bytes += sent
        self.peak_bytes = max(self.peak_bytes, sent)
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
            "comm/bits_per_param": 8 * sent / numel,  # codes, indices and scales: what left this worker
            "comm/metric_bytes": m["metric"],
            "comm/bytes_per_inner_step": sent * len(self.fragments) / self.inner_steps,
            "comm/intra_worker_total_bytes": self._intra_bytes(),
            "comm/seconds": m["seconds"],
            "comm/total_bytes": self.total_bytes,
        }
        if m["cosine"] is not None:
            out["outer/cosine_similarity"] = m["cosine"]
        if m["mean_error"] is not None:  # what the wire dtype cost the average, on the sampled coordinates
            out["comm/mean_rel_error"] = m["mean_error"]
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
            "seconds": [self.comm_seconds, self.outer_seconds, self.inner_seconds, self.blocked_seconds],
            "intra_ddp_bytes": self._ddp_bytes(),
            "averager": self.averager.state_dict(),  # int8/int4/topk2: the error-feedback residuals
            "peak_bytes": self.peak_bytes,
            "in_flight": [
                [j.apply_at, j.fragment, _cpu(j.wait()), j.metrics, _cpu(j.own) if j.own else None]
                for j in self._in_flight
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        shapes = [t.shape for t in state["global_params"]]
        if shapes != [t.shape for t in self.global_params]:
            raise CheckpointError(
                "the checkpoint's DiLoCo buckets do not match this run's (bucket_size_mb changed?)"
            )
        _copy_(self.global_params, state["global_params"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.averager.load_state_dict(state.get("averager", {}), self.device)
        self.peak_bytes = int(state.get("peak_bytes", 0))
        home = self.global_params[0].device
        self._in_flight = [_job_from_state(job, home) for job in state.get("in_flight", [])]
        self.outer_round, self.total_bytes = int(state["outer_round"]), int(state["total_bytes"])
        self.metric_bytes = int(state["metric_bytes"])
        seconds = [float(s) for s in state["seconds"]]
        self.comm_seconds, self.outer_seconds, self.inner_seconds = seconds[:3]
        self.blocked_seconds = seconds[3] if len(seconds) > 3 else self.outer_seconds + self.comm_seconds
        if self.inner_strategy is not None:
            self.inner_strategy.total_bytes = int(state["intra_ddp_bytes"])

    def summary(self) -> dict[str, float]:
        for job in self._in_flight:  # the counters are final once the transfers are done
            job.wait()
        wall = self.inner_seconds + self.blocked_seconds
        return {
            "comm/total_bytes": self.total_bytes,
            "comm/metric_bytes": self.metric_bytes,
            "comm/seconds": self.comm_seconds,
            "comm/intra_worker_total_bytes": self._intra_bytes(),
            "comm/peak_bytes_per_sync": self.peak_bytes,
            "outer/rounds": self.outer_round,
            "outer/seconds": self.outer_seconds,
            "outer/compute_utilization": self.inner_seconds / wall if wall > 0 else None,
            "num_peers": self.cross.size,
        }

    def close(self) -> None:
        """Finish the exchanges already submitted, then stop the transfer thread. Every worker submitted
        the same exchanges in the same order, so cancelling a queued one here while a peer's thread has
        started it would leave that peer waiting out its whole timeout; after one exchange fails (a dead
        peer) the rest are cancelled."""
        if self._transfer is None:
            return
        for job in self._in_flight:
            try:
                job.wait()
            except Exception:  # the run already failed or is failing: do not wait on the others
                break
        self._transfer.shutdown(wait=True, cancel_futures=True)

    def _ddp_bytes(self) -> int:
        return self.inner_strategy.total_bytes if self.inner_strategy is not None else 0

    def _intra_bytes(self) -> int:  # this rank, inside its worker: DDP gradients + mean broadcasts
        return self.intra.sent.get("intra_worker", 0) + self._ddp_bytes()


def _job_from_state(job: list, home: torch.device) -> _InFlight:
    """An in-flight job as state_dict saved it: [apply_at, fragment, mean, metrics, own] (own: eager
    updates only; checkpoints before eager updates have four fields)."""
    apply_at, fragment, grads, metrics, *rest = job
    own = rest[0] if rest else None
    return _InFlight(
        int(apply_at),
        int(fragment),
        _to(grads, home),
        dict(metrics),
        own=None if own is None else _to(own, home),
    )


def _cpu(tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    return {b: t.cpu() for b, t in tensors.items()}


def _to(tensors: dict, device: torch.device) -> dict[int, torch.Tensor]:
    """A checkpoint's bucket -> tensor map on `device`, copied (never the checkpoint's own tensors)."""
    return {int(b): t.to(device, copy=True) for b, t in tensors.items()}


def _copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


def _views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters' shapes over consecutive slices of one flat tensor."""
    return [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in params]), params)]

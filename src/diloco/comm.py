"""Averaging tensors across DiLoCo workers: the narrow seam between the algorithm and the network.

`Collective` is the seam: in-place sum/max, all-gather, all-to-all and broadcast of one tensor among the
members of one group. `TorchCollective` implements it with torch.distributed (gloo on CPU, nccl on
GPU), `InProcessCollective` with threads of one process (tests, and W simulated workers in one
process), `SoloCollective` for a group of one. Everything above the seam is shared, so a test that
swaps the implementation checks the same code that runs on a cluster.

`Averager` is what the algorithm calls: `average_(flat, sizes)` replaces a flat float32 bucket (the
concatenation of tensors of `sizes` elements) by its mean over workers, sent in the configured wire
dtype, and records what it cost and what it lost:

- bytes: the payload actually handed to the all-reduce (numel x element size of the wire tensor),
  plus the per-tensor FP16 scales; this is what one worker contributes, not ring-algorithm traffic;
- seconds spent inside collectives (the CUDA stream is synchronised, so NCCL time is real time);
- for FP16/BF16, the cast error of this worker's contribution against FP32: relative L2 error and
  the number of non-zero elements that underflow to zero or overflow (saturate) in the cast.

FP16 comes in two variants. Unscaled (`fp16_scaling=false`) casts the pseudo-gradient as it is, as
OpenDiLoCo's Hivemind Float16Compression did (clamped to the FP16 range). Scaled gives every tensor
one power-of-two scale, agreed by a MAX all-reduce of per-tensor absolute maxima, so the sum over W
workers uses the top of the FP16 range and cannot overflow; powers of two keep the scaling exact.
BF16 has FP32's exponent range and is never scaled.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class CommError(RuntimeError):
    """A collective that failed or timed out (a peer died, hung or lost its connection)."""


# ---------------------------------------------------------------------------------------------------
# the seam


class Collective:
    """In-place collectives over one group of `size` members; this member is `rank` (0..size-1).

    Every call adds its wall time to `seconds` and the bytes this member handed to it to
    `sent[tag]`, so what is reported is measured where the tensors leave, not computed elsewhere.
    """

    size: int = 1
    rank: int = 0

    def __init__(self):
        self.seconds = 0.0
        self.sent: dict[str, int] = {}

    def _count(self, tag: str, t: torch.Tensor, start: float) -> None:
        self.seconds += time.perf_counter() - start
        self.sent[tag] = self.sent.get(tag, 0) + t.numel() * t.element_size()

    def all_reduce_(self, t: torch.Tensor, op: str = "sum", tag: str = "other") -> None:
        """t <- sum (op="sum") or elementwise max (op="max") of every member's t."""
        start = time.perf_counter()
        self._all_reduce(t, op)
        self._count(tag, t, start)

    def all_gather(self, t: torch.Tensor, tag: str = "other") -> torch.Tensor:
        """[n] -> [size, n], row r from member r."""
        start = time.perf_counter()
        out = self._all_gather(t)
        self._count(tag, t, start)
        return out

    def all_to_all(self, t: torch.Tensor, tag: str = "other") -> torch.Tensor:
        """[size, n] -> [size, n]: row r of the result is member r's row `rank`. Counts the rows that
        leave this member (its own row stays)."""
        start = time.perf_counter()
        out = self._all_to_all(t)
        self._count(tag, t[: t.shape[0] - 1], start)
        return out

    def broadcast_(self, t: torch.Tensor, src: int, tag: str = "other") -> None:
        start = time.perf_counter()
        self._broadcast(t, src)
        self._count(tag, t if self.rank == src else t[:0], start)

    def _all_reduce(self, t, op):
        raise NotImplementedError

    def _all_gather(self, t):
        raise NotImplementedError

    def _all_to_all(self, t):
        raise NotImplementedError

    def _broadcast(self, t, src):
        raise NotImplementedError


class SoloCollective(Collective):
    """A group of one: every collective is the identity and sends nothing."""

    def _count(self, tag, t, start):
        pass

    def _all_reduce(self, t, op):
        pass

    def _all_gather(self, t):
        return t.unsqueeze(0)

    def _all_to_all(self, t):
        return t

    def _broadcast(self, t, src):
        pass


class TorchCollective(Collective):
    """torch.distributed over `group`; a failure or timeout becomes one readable CommError."""

    _OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def __init__(self, group, timeout_seconds: float):
        super().__init__()
        self.group, self.timeout = group, timeout_seconds
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def _run(self, what: str, fn, t: torch.Tensor):
        start = time.perf_counter()
        try:
            out = fn()
            if t.is_cuda:  # NCCL returns once the kernel is queued; the clock must see it finish
                torch.cuda.synchronize(t.device)
            return out
        except (RuntimeError, ValueError) as e:
            last = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
            raise CommError(
                f"{what} across {self.size} ranks failed after {time.perf_counter() - start:.1f} s "
                f"(timeout {self.timeout:g} s): a peer rank died, hung or lost its connection [{last}]"
            ) from None

    def _all_reduce(self, t, op):
        self._run("all-reduce", lambda: dist.all_reduce(t, op=self._OPS[op], group=self.group), t)

    def _all_gather(self, t):
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._run("all-gather", lambda: dist.all_gather(out, t, group=self.group), t)
        return torch.stack(out)

    def _all_to_all(self, t):
        out = torch.empty_like(t)
        self._run("all-to-all", lambda: dist.all_to_all_single(out, t.contiguous(), group=self.group), t)
        return out

    def _broadcast(self, t, src):
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        self._run("broadcast", lambda: dist.broadcast(t, src=src_global, group=self.group), t)


class InProcessGroup:
    """Shared meeting point of `size` threads that simulate `size` workers in one process."""

    def __init__(self, size: int, timeout_seconds: float):
        self.size, self.timeout = size, timeout_seconds
        self._slots: list[torch.Tensor | None] = [None] * size
        self._barrier = threading.Barrier(size, timeout=timeout_seconds)

    def member(self, rank: int) -> InProcessCollective:
        return InProcessCollective(self, rank)


class InProcessCollective(Collective):
    """One thread's view of an InProcessGroup. Sums run in rank order, in the tensor's own dtype."""

    def __init__(self, group: InProcessGroup, rank: int):
        super().__init__()
        self.group, self.size, self.rank = group, group.size, rank

    def _wait(self) -> None:
        g = self.group
        try:
            g._barrier.wait()
        except threading.BrokenBarrierError:
            g._barrier.abort()
            raise CommError(
                f"in-process collective across {self.size} workers broke or timed out "
                f"(timeout {g.timeout:g} s): a worker thread died or hung"
            ) from None

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.group._slots[self.rank] = t.detach().clone()
        self._wait()
        slots = list(self.group._slots)
        self._wait()  # nobody overwrites a slot before everyone has read them all
        return slots

    def _all_reduce(self, t, op):
        if op != "sum" or not t.is_contiguous():
            slots = self._exchange(t)
            out = slots[0].clone()
            for s in slots[1:]:
                out = out + s if op == "sum" else torch.maximum(out, s)
            t.copy_(out)
            return
        # In place, no temporaries (the simulated outer step is memory-bound): member r sums chunk r of
        # every member's tensor, in rank order, into member 0's (only member r touches chunk r), then
        # every other member copies the whole sum from member 0.
        g, r = self.group, self.rank
        g._slots[r] = t.detach().view(-1)
        self._wait()
        chunks = [s.tensor_split(self.size) for s in g._slots]  # [member][chunk]
        for s in range(1, self.size):
            chunks[0][r].add_(chunks[s][r])
        self._wait()
        if r:
            g._slots[r].copy_(g._slots[0])
        self._wait()  # member 0 changes its tensor only after everyone has copied the sum

    def _all_gather(self, t):
        return torch.stack(self._exchange(t))

    def _all_to_all(self, t):
        return torch.stack([row[self.rank] for row in self._exchange(t)])

    def _broadcast(self, t, src):
        t.copy_(self._exchange(t)[src])


def group_collective(group, timeout_seconds: float) -> Collective:
    """The Collective of a torch.distributed group (a group of one needs no network)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:  # group None: all ranks
        return SoloCollective()
    return TorchCollective(group, timeout_seconds)


# ---------------------------------------------------------------------------------------------------
# averaging with a wire dtype


@dataclass
class CastStats:
    """What this worker's FP32 -> wire-dtype casts lost (sums, so buckets and ranks add up)."""

    sq_norm: float = 0.0  # ||x||^2 of the FP32 contributions
    sq_error: float = 0.0  # ||decode(encode(x)) - x||^2
    underflow: int = 0  # non-zero elements sent as zero
    overflow: int = 0  # elements beyond the wire dtype's range (saturated at its max)
    numel: int = 0

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(
            [self.sq_norm, self.sq_error, self.underflow, self.overflow, self.numel], dtype=torch.float64
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> CastStats:
        a, b, c, d, e = t.tolist()
        return cls(a, b, int(c), int(d), int(e))

    def metrics(self) -> dict[str, float]:
        n = max(self.numel, 1)
        return {
            "comm/cast_rel_error": (self.sq_error / self.sq_norm) ** 0.5 if self.sq_norm > 0 else 0.0,
            "comm/cast_underflow_frac": self.underflow / n,
            "comm/cast_overflow_frac": self.overflow / n,
        }


def power_of_two_scales(absmax: torch.Tensor, num_workers: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor scales 2^k, the largest with num_workers * absmax * 2^k <= finfo(dtype).max."""
    limit = torch.finfo(dtype).max / num_workers
    scales = torch.exp2(torch.floor(torch.log2(limit / absmax)))
    return torch.where(absmax > 0, scales, torch.ones_like(absmax))  # an all-zero tensor keeps scale 1


class Averager:
    """Mean over the members of `coll` of flat FP32 buckets, sent as `dtype` (module docstring)."""

    def __init__(self, coll: Collective, dtype: str = "float32", fp16_scaling: bool = True):
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"pseudo_grad_dtype must be one of {sorted(WIRE_DTYPES)}, got {dtype!r}")
        self.coll, self.dtype, self.wire = coll, dtype, WIRE_DTYPES[dtype]
        self.scaled = self.wire == torch.float16 and fp16_scaling
        self.cast = CastStats()

    def encode(
        self, flat: torch.Tensor, sizes: list[int], absmax: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """FP32 [n] -> (wire tensor [n], per-tensor scales agreed by all members, or None). `absmax`: each
        tensor's largest magnitude where this rank holds only a shard of it (the worker's, already agreed
        among its ranks), so the scale is the whole tensor's, as with unsharded workers."""
        if self.wire == torch.float32:
            return flat.clone(), None
        x, scales = flat, None
        if self.scaled:
            pieces = flat.split(sizes)
            if absmax is None:
                absmax = torch.stack([torch.linalg.vector_norm(t, ord=float("inf")) for t in pieces]).float()
            self.coll.all_reduce_(absmax, op="max", tag="fp16_scales")
            scales = list(power_of_two_scales(absmax, self.coll.size, self.wire).unbind())
            x = flat.clone()
            for t, scale in zip(x.split(sizes), scales):
                t.mul_(scale)
        fmax = torch.finfo(self.wire).max
        wire = x.clamp(-fmax, fmax).to(self.wire)
        self._measure(flat, x, wire, sizes, scales)
        return wire, scales

    def decode_(self, out: torch.Tensor, wire: torch.Tensor, sizes: list[int], scales) -> torch.Tensor:
        out.copy_(wire)  # -> float32
        if scales is not None:
            for t, scale in zip(out.split(sizes), scales):
                t.div_(scale)  # exact: powers of two
        return out

    def _measure(self, flat, scaled, wire, sizes, scales) -> None:
        """Cast error of this member's contribution against its FP32 value (one host sync)."""
        back = self.decode_(torch.empty_like(flat), wire, sizes, scales)
        flat64 = flat.double()
        vals = torch.stack(
            [
                flat64.square().sum(),
                (back.double() - flat64).square().sum(),
                ((flat != 0) & (wire == 0)).sum().double(),
                (scaled.abs() > torch.finfo(self.wire).max).sum().double(),
            ]
        ).tolist()
        c = self.cast
        c.sq_norm, c.sq_error = c.sq_norm + vals[0], c.sq_error + vals[1]
        c.underflow, c.overflow = c.underflow + int(vals[2]), c.overflow + int(vals[3])
        c.numel += flat.numel()

    def average_(
        self, flat: torch.Tensor, sizes: list[int], key: int = 0, absmax: torch.Tensor | None = None
    ) -> torch.Tensor:
        """flat (FP32 [n], tensors of `sizes` elements end to end) <- its mean over all members.
        `key` names the bucket (quant.QuantizedAverager keeps a residual per bucket; nothing here);
        `absmax`: the tensors' magnitudes across a sharded worker (encode)."""
        if self.wire == torch.float32:  # nothing to encode: reduce in place
            self.coll.all_reduce_(flat, op="sum", tag="pseudo_grad_float32")
            return flat.div_(self.coll.size)
        wire, scales = self.encode(flat, sizes, absmax)
        self.coll.all_reduce_(wire, op="sum", tag=f"pseudo_grad_{self.dtype}")
        self.decode_(flat, wire, sizes, scales)
        return flat.div_(self.coll.size)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        pass


def mean_pairwise_cosine(gram: torch.Tensor) -> float:
    """Mean over pairs i<j of cos(g_i, g_j), from the Gram matrix gram[i, j] = <g_i, g_j> ([W, W])."""
    w = gram.shape[0]
    norms = gram.diagonal().clamp_min(torch.finfo(gram.dtype).tiny).sqrt()
    cos = gram / (norms[:, None] * norms[None, :])
    i, j = torch.triu_indices(w, w, offset=1)
    return float(cos[i, j].mean())


# ---------------------------------------------------------------------------------------------------
# per-round measurements


def sample_positions(counts: list[int], k: int, seed: int, device) -> list[torch.Tensor] | None:
    """k fixed coordinates (the same on every rank) of buckets of `counts` elements, as per-bucket
    index tensors; every coordinate when k >= sum(counts); None when k == 0."""
    if k == 0:
        return None
    n = sum(counts)
    gen = torch.Generator().manual_seed(seed)
    picks = torch.arange(n) if k >= n else torch.randint(n, (k,), generator=gen)
    edges = torch.tensor([0, *counts]).cumsum(0).tolist()
    return [(picks[(picks >= lo) & (picks < hi)] - lo).to(device) for lo, hi in zip(edges, edges[1:])]


class RoundMeter:
    """What one outer round cost, what the casts lost and how the workers' pseudo-gradients agreed.

    Each rank records the buckets it all-reduced itself (`observe`, before averaging); `finish` sums
    the records of the ranks of one worker (one small all-reduce) and estimates the mean pairwise
    cosine between workers from the coordinates of `positions` (all-gathered, tagged "metrics" so
    they are reported apart from the algorithm's own bytes).
    """

    def __init__(self, averager: Averager, intra: Collective, positions: list[torch.Tensor] | None):
        self.averager, self.cross, self.intra, self.positions = averager, averager.coll, intra, positions

    def begin(self) -> None:
        self._seconds0 = self.cross.seconds + self.intra.seconds
        self._sent0 = dict(self.cross.sent)
        self.averager.cast = CastStats()
        self._sq: list[torch.Tensor] = []
        self._sketch: list[torch.Tensor] = []
        self._mean_sketch: list[torch.Tensor] = []

    def observe(self, bucket: int, pseudo_grad: torch.Tensor) -> None:
        self._sq.append(torch.linalg.vector_norm(pseudo_grad).double().square())  # one pass, no copy
        if self.positions is not None:
            self._sketch.append(pseudo_grad[self.positions[bucket]])

    def observe_mean(self, bucket: int, mean: torch.Tensor) -> None:
        """The bucket's mean as it arrived (after `observe` and the averaging): on the sampled coordinates
        its relative L2 error against the float32 mean of the workers' sketches is `mean_error`."""
        if self.positions is not None:
            self._mean_sketch.append(mean[self.positions[bucket]])

    def finish(self, device) -> dict:
        w = self.cross.size
        gram = torch.zeros(w, w, dtype=torch.float64)
        error = torch.zeros(2, dtype=torch.float64)  # ||arrived - float32 mean||^2, ||float32 mean||^2
        if self.positions is not None and w > 1:
            mine = torch.cat(self._sketch) if self._sketch else torch.zeros(0, device=device)
            rows = self.cross.all_gather(mine, tag="metrics").double().cpu()  # [W, k]
            gram = rows @ rows.T
            if self._mean_sketch:
                exact, arrived = rows.mean(0), torch.cat(self._mean_sketch).double().cpu()
                error = torch.stack([(arrived - exact).square().sum(), exact.square().sum()])
        sent = {k: v - self._sent0.get(k, 0) for k, v in self.cross.sent.items()}
        payload = sum(v for k, v in sent.items() if k.startswith("pseudo_grad_"))
        sq = torch.stack(self._sq).sum().cpu() if self._sq else torch.zeros((), dtype=torch.float64)
        sizes = torch.tensor(
            [payload, sent.get("fp16_scales", 0), sent.get("metrics", 0)], dtype=torch.float64
        )
        cast = self.averager.cast.as_tensor()
        totals = torch.cat([sq.view(1), cast, sizes, error, gram.flatten()]).to(device)
        self.intra.all_reduce_(totals, tag="metrics")  # the sums over this worker's ranks
        totals = totals.cpu()
        payload, scales, metric = (int(v) for v in totals[6:9].tolist())
        err_sq, exact_sq = totals[9:11].tolist()
        return {
            "payload": payload,
            "scales": scales,
            "metric": metric,
            "seconds": self.cross.seconds + self.intra.seconds - self._seconds0,
            "local_norm": float(totals[0]) ** 0.5,
            "cast": CastStats.from_tensor(totals[1:6]).metrics(),
            "cosine": mean_pairwise_cosine(totals[11:].view(w, w)) if self.positions and w > 1 else None,
            "mean_error": (err_sq / exact_sq) ** 0.5 if exact_sq > 0 else None,
        }

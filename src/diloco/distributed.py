"""Process topology: ranks, devices, process groups. The only module (with the entry point) that knows
about ranks; the model and the data pipeline are given a shard index and nothing else.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import os
import signal
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from diloco.errors import ConfigError
from diloco.layout import ranks_per_worker

log = logging.getLogger("diloco")


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # DiLoCo topology: W workers of G ranks each (G ranks share one worker's batch through DDP).
    num_workers: int = 1
    worker_id: int = 0
    ranks_per_worker: int = 1
    worker_group: object = None  # process group of this worker's G ranks (None: all ranks / single)
    cross_group: object = None  # process group of the ranks with this local index in every worker
    # a DumbDiLoCo node: its ranks split the node's one shard (data.shard) instead of reading one each
    shard_per_node: bool = False
    # worker_parallel=fsdp: the model is sharded over the worker's ranks (`shard_model`), so every rank of
    # worker 0 takes part in an evaluation's forward passes, not rank 0 alone
    sharded: bool = False

    @property
    def evaluates(self) -> bool:
        """Whether this rank runs the evaluations (rank 0; with sharded workers, every rank of worker 0)."""
        return self.is_main or (self.sharded and self.worker_id == 0)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.initialized:
            try:
                dist.barrier()
            except RuntimeError as err:  # e.g. at a checkpoint: the same line as anywhere else
                raise peer_lost(err) from None


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> None:
    """torchrun starts each rank in a session of its own, so a node's launcher killed with its process
    group (a lost node, `kill -9 -<pgid>`) would leave the rank training on as an orphan, its peers none
    the wiser. Under scripts/launch_ranks.py (it names itself in DILOCO_LAUNCHER_PID and starts the ranks
    from its main thread, which the kernel's parent-death signal is tied to), Linux kills the rank when
    its launcher dies, or at once if the launcher died while the rank was starting."""
    launcher = os.environ.get("DILOCO_LAUNCHER_PID")
    if sys.platform != "linux" or not launcher:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGKILL)


def pick_device(device: str, index: int) -> torch.device:
    """The device of this rank: CPU, or GPU `index` (the local rank, or local rank // ranks_per_gpu)."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but CUDA is not available on this machine")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


class LocalTraining:
    """The strategy of a single process (distributed=none): no communication at all."""

    name = "none"
    num_workers = 1

    def __init__(self, ctx: DistContext):
        self.ctx = ctx

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def start(self) -> None:
        pass

    def finish(self) -> bool:
        return False

    def grad_sync(self, last_micro_step: bool):
        return nullcontext()

    def after_inner_step(self, step: int) -> dict[str, float]:
        return {}

    def eval_weights(self, step: int):
        """The weights to evaluate are the live ones (every rank holds the same)."""
        return nullcontext()

    def progress(self, step: int) -> float:
        return step  # the run's step is the local one

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def summary(self) -> dict[str, float]:
        return {"comm/total_bytes": 0}

    def close(self) -> None:
        pass


class DistributedError(RuntimeError):
    """Ranks that cannot train together (different models, a dead peer); one readable line."""


def peer_lost(err: RuntimeError) -> DistributedError:
    return DistributedError(
        f"a peer rank died, hung or lost its connection ({str(err).splitlines()[0][:200]})"
    )


def init_distributed(dcfg, device: str = "auto", ranks_per_gpu: int = 1) -> DistContext:
    """Join the process group torchrun describes and build the DiLoCo topology. `dcfg`: the typed
    `distributed:` block `diloco.config.validate` returned (checked there, not here); `device` and
    `ranks_per_gpu`: the config's `device` and `launch.ranks_per_gpu`.

    W workers of G consecutive ranks: worker w is ranks [w*G, (w+1)*G). Inside a worker the G ranks
    share one batch through DDP (`worker_group`); the ranks with the same index j in every worker form
    `cross_group` j, over which pseudo-gradients are averaged. DDP is one worker of all ranks.
    Every rank creates every group, in the same order, as torch.distributed requires.
    """
    per_node = dcfg.mode == "dumb_diloco"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if launched_by_torchrun():
        die_with_launcher()
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        return DistContext(
            local_rank=local_rank, device=pick_device(device, local_rank), shard_per_node=per_node
        )
    if dcfg.mode == "none":
        raise ConfigError(
            f"launched with {os.environ['WORLD_SIZE']} ranks but distributed=none; choose distributed=ddp or diloco"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    configured = dcfg.ranks_per_worker if dcfg.mode == "diloco" else None  # only DiLoCo's block has it
    g = ranks_per_worker(dcfg.mode, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), configured)
    shared = int(ranks_per_gpu)  # ranks per GPU: consecutive local ranks share one
    torch_device = pick_device(device, local_rank // shared)
    timeout = timedelta(seconds=float(dcfg.timeout_seconds)) if dcfg.timeout_seconds else None
    nccl = (
        torch_device.type == "cuda" and shared == 1
    )  # NCCL refuses two ranks on one GPU; gloo takes CUDA tensors
    dist.init_process_group("nccl" if nccl else "gloo", timeout=timeout)
    ctx = DistContext(
        rank,
        world,
        local_rank,
        torch_device,
        world // g,
        rank // g,
        g,
        shard_per_node=per_node,
        sharded=getattr(dcfg, "worker_parallel", "ddp") == "fsdp",
    )
    if dcfg.mode in ("ddp", "dumb_diloco"):  # one worker of all ranks (the default group)
        return ctx
    for w in range(ctx.num_workers):
        group = dist.new_group(list(range(w * g, (w + 1) * g)), timeout=timeout)
        if w == ctx.worker_id:
            ctx.worker_group = group
    for j in range(g):
        group = dist.new_group(list(range(j, world, g)), timeout=timeout)
        if j == rank % g:
            ctx.cross_group = group
    return ctx


def check_same_model(ctx: DistContext, model: torch.nn.Module) -> None:
    """Refuse to start when ranks hold different initial weights (another seed, another transformers
    version, another model config): shapes first, then a SHA-256 of the weights."""
    if not ctx.initialized:
        return
    from diloco.model import shape_fingerprint, weights_sha256

    for what, fingerprint in (("model shapes", shape_fingerprint), ("initial weights", weights_sha256)):
        prints: list = [None] * ctx.world_size
        dist.all_gather_object(prints, fingerprint(model))
        if len(set(prints)) > 1:
            by_print: dict[str, list[int]] = {}
            for r, p in enumerate(prints):
                by_print.setdefault(p, []).append(r)
            groups = "; ".join(f"ranks {ranks} have {p}" for p, ranks in by_print.items())
            raise DistributedError(f"{what} differ across ranks ({groups})")


def check_same_start(ctx: DistContext, step: int) -> None:
    """Refuse to train when ranks resumed from different steps: nodes that keep the run folder on disks
    of their own (rank 0 alone writes a checkpoint's meta.json) would otherwise mix a resumed model
    with a fresh one in the same all-reduces and report the result."""
    if not ctx.initialized:
        return
    steps: list = [None] * ctx.world_size
    dist.all_gather_object(steps, step)
    if len(set(steps)) > 1:
        by_step: dict[int, list[int]] = {}
        for r, s in enumerate(steps):
            by_step.setdefault(s, []).append(r)
        starts = "; ".join(f"ranks {ranks} at step {s}" for s, ranks in sorted(by_step.items()))
        raise DistributedError(
            f"the ranks start at different steps ({starts}): every node must see the same run folder "
            "(out_dir on a shared filesystem) to resume"
        )


class DataParallel:
    """DDP over `group` (all ranks for distributed=ddp; one worker's ranks inside DiLoCo).

    The gradient all-reduce runs through a comm hook that counts the bytes of every bucket it sends,
    so the reported communication is measured, not computed from the parameter count.
    """

    name = "ddp"
    num_workers = 1  # one worker of world_size ranks: train.batch_size is the global batch

    def __init__(
        self,
        ctx: DistContext,
        model: torch.nn.Module,
        group=None,
        *,
        bucket_cap_mb: float | None = None,  # distributed.ddp_bucket_cap_mb; None: DDP's default
        log_every: int = 0,  # distributed.comm_log_every (distributed=ddp); 0: no comm metrics
    ):
        check_same_model(ctx, model)  # every rank of the run starts from bit-identical weights
        self.ctx, self.group = ctx, group
        self.size = dist.get_world_size(group) if ctx.initialized else 1
        self.bucket_cap_mb = bucket_cap_mb
        self.log_every = int(log_every or 0)
        self.ddp = None
        self.lost: RuntimeError | None = None  # a gradient all-reduce's failure (_peer_failure_named)
        self.total_bytes = 0  # bytes this rank handed to gradient all-reduces
        self._logged_bytes, self._logged_step = 0, 0

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.size == 1:
            return model
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # buffers (rotary frequencies) are computed identically on every rank: never re-broadcast them
        no_sync = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
        self.ddp = DDP(
            model,
            device_ids=device_ids,
            process_group=self.group,
            bucket_cap_mb=self.bucket_cap_mb,
            **{no_sync: False},
        )
        self.ddp.register_comm_hook(self, _counting_allreduce_hook)
        return self.ddp

    def start(self) -> None:
        pass

    def finish(self) -> bool:
        return False

    def grad_sync(self, last_micro_step: bool):
        if self.ddp is None:
            return nullcontext()
        return self._peer_failure_named() if last_micro_step else self.ddp.no_sync()

    @contextmanager
    def _peer_failure_named(self):
        """A gradient all-reduce that failed (a peer died) comes out of backward() as the autograd
        engine's RuntimeError: it ends the run with the line a failed collective gives anywhere else."""
        try:
            yield
        except RuntimeError:
            if self.lost is None:
                raise
            raise peer_lost(self.lost) from None

    def _note_failure(self, fut):
        try:
            return fut.value()
        except RuntimeError as err:
            self.lost = err
            raise

    def after_inner_step(self, step: int) -> dict[str, float]:
        if not self.log_every or step % self.log_every:
            return {}
        per_step = (self.total_bytes - self._logged_bytes) / max(step - self._logged_step, 1)
        self._logged_bytes, self._logged_step = self.total_bytes, step
        return {"comm/bytes_per_step": per_step, "comm/total_bytes": self.total_bytes}

    def eval_weights(self, step: int):
        """The weights to evaluate are the live ones (every rank holds the same)."""
        return nullcontext()

    def progress(self, step: int) -> float:
        return step  # the run's step is the local one

    def state_dict(self) -> dict:
        return {
            "total_bytes": self.total_bytes,
            "logged_bytes": self._logged_bytes,
            "logged_step": self._logged_step,
        }

    def load_state_dict(self, state: dict) -> None:
        self.total_bytes = int(state["total_bytes"])
        self._logged_bytes, self._logged_step = int(state["logged_bytes"]), int(state["logged_step"])

    def summary(self) -> dict[str, float]:
        return {"comm/total_bytes": self.total_bytes}

    def close(self) -> None:
        pass


_DDP_ARGS = inspect.signature(DDP).parameters


def _counting_allreduce_hook(state: DataParallel, bucket):
    buf = bucket.buffer()
    state.total_bytes += buf.numel() * buf.element_size()
    return default_hooks.allreduce_hook(state.group, bucket).then(state._note_failure)


class StopFlag:
    """Ctrl+C / SIGTERM finish the current step, checkpoint, and exit; a second Ctrl+C aborts."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def install(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("stop requested: finishing this step, then writing a checkpoint")

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class StopAgreement:
    """Every rank stops after the same step. Each call posts this rank's stop request (a one-element MAX
    all-reduce, asynchronous) and returns the previous call's result, so its latency hides behind a step
    and all ranks, which call it once per step, decide alike one step after the first request."""

    def __init__(self, ctx: DistContext):
        self.ctx, self._pending = ctx, None

    def __call__(self, requested: bool) -> bool:
        if not self.ctx.initialized:
            return requested
        agreed = self.finish()
        flag = torch.tensor([float(requested)], device=self.ctx.device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return agreed

    def finish(self) -> bool:
        """Wait for the last posted request (every rank posted as many)."""
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        try:
            work.wait()
        except RuntimeError as err:  # a peer rank died: one readable line, not a gloo traceback
            raise peer_lost(err) from None
        return bool(flag.item())


def shutdown_distributed(ctx: DistContext, clean: bool = True) -> None:
    """Leave the job. After a clean finish, wait at a barrier first: a gloo rank that tears down its
    pairs while a peer still sends on them aborts that peer ("terminate called without an active
    exception"). After a failure the peers may be gone, so do not wait for them."""
    if ctx.initialized:
        if clean:
            ctx.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- FSDP2 (worker_parallel: fsdp)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder blocks (a transformers Llama's `model.layers`): FSDP's units."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ConfigError(
            "worker_parallel=fsdp shards a Llama's decoder blocks (model.layers): this model has none"
        )
    return list(layers)


def shard_model(ctx: DistContext, model: torch.nn.Module, group=None) -> None:
    """FSDP2 (`fully_shard`) over `group`'s ranks (None: all), in place: each decoder layer, then the root.
    Its parameters become DTensors holding this rank's shard of dim 0, so build the optimizer after it.
    On CUDA the forward and backward run in bfloat16 with float32 gradient reductions; on CPU in float32.
    Every rank of the run must start from the same weights (checked first, as for DDP)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    check_same_model(ctx, model)
    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, ctx.device.type)
    if ctx.device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: its FSDP shard (a view sharing the storage), or the tensor itself."""
    return t.to_local() if is_sharded(t) else t


class FullyShardedData:
    """distributed=ddp with worker_parallel=fsdp (the model sharded over all ranks, shard_model), and the
    inside of a DiLoCo worker with it (over the worker's ranks). FSDP2 all-gathers the parameters for
    the forward and the backward and reduce-scatters the gradients itself; gradient accumulation skips
    the reduce-scatter until the last micro-step. `comm/bytes_per_step` is computed from the parameters'
    bytes (two all-gathers and a reduce-scatter of (G-1)/G of them per step), not measured: FSDP2 has no
    hook that sees its collectives' buffers."""

    name = "fsdp"
    num_workers = 1  # one worker of all its ranks: train.batch_size is the worker's batch

    def __init__(self, ctx: DistContext, model: torch.nn.Module, group=None, *, log_every: int = 0):
        self.ctx, self.model, self.group = ctx, model, group
        self.size = dist.get_world_size(group) if ctx.initialized else 1
        self.log_every = int(log_every or 0)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        self.bytes_per_step = 3 * full * (self.size - 1) // max(self.size, 1)
        self.total_bytes = 0  # this rank's, counted at each step's last micro-step (DiLoCo reads it too)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # sharded in place by shard_model before the optimizer was built

    def start(self) -> None:
        pass

    def finish(self) -> bool:
        return False

    @contextmanager
    def grad_sync(self, last_micro_step: bool):
        self.model.set_requires_gradient_sync(last_micro_step)
        try:
            yield
        except RuntimeError as err:  # a collective that failed: a peer died or hung
            raise peer_lost(err) from None
        if last_micro_step:
            self.total_bytes += self.bytes_per_step

    def after_inner_step(self, step: int) -> dict[str, float]:
        if not self.log_every or step % self.log_every:
            return {}
        return {"comm/bytes_per_step": self.bytes_per_step, "comm/total_bytes": self.total_bytes}

    def eval_weights(self, step: int):
        return nullcontext()  # every rank of the group evaluates with its shards (train.run_eval)

    def progress(self, step: int) -> float:
        return step

    def state_dict(self) -> dict:
        return {"total_bytes": self.total_bytes}

    def load_state_dict(self, state: dict) -> None:
        self.total_bytes = int(state["total_bytes"])

    def summary(self) -> dict[str, float]:
        return {"comm/total_bytes": self.total_bytes}

    def close(self) -> None:
        pass


class LocalShards:
    """The state_dict of a sharded module or optimizer as this rank's local shards (plain tensors, which
    checkpoint.load reads with weights_only=True), restored into the same topology exactly. Hand-written
    rather than torch.distributed.checkpoint for the one rank file per rank the checkpoints keep."""

    def __init__(self, obj, params: list[torch.nn.Parameter] | None = None):
        self.obj, self.params = obj, params

    def state_dict(self) -> dict:
        return _to_local(self.obj.state_dict())

    def load_state_dict(self, state: dict) -> None:
        if isinstance(self.obj, torch.nn.Module):
            with torch.no_grad():
                for k, t in self.obj.state_dict().items():
                    local(t).copy_(state[k])
            return
        state = dict(state)
        index = {i: p for i, p in enumerate(p for g in self.obj.param_groups for p in g["params"])}
        state["state"] = {
            i: {k: _as_param_shard(v, index[int(i)]) for k, v in s.items()} for i, s in state["state"].items()
        }
        self.obj.load_state_dict(state)


def _to_local(obj):
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_local(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return local(obj).detach().clone()
    return obj


def _as_param_shard(value, param: torch.Tensor):
    """An optimizer state tensor saved as a local shard, back as a DTensor laid out as its parameter."""
    if not (isinstance(value, torch.Tensor) and is_sharded(param) and value.shape == param.to_local().shape):
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        value.to(param.device),
        param.device_mesh,
        param.placements,
        shape=param.shape,
        stride=param.stride(),
        run_check=False,
    )

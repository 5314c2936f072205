"""Process topology: ranks, devices, process groups. The only module (with the entry point) that knows
about ranks; the model and the data pipeline are given a shard index and nothing else.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.initialized:
            dist.barrier()


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def pick_device(device: str, local_rank: int) -> torch.device:
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but CUDA is not available on this machine")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class LocalTraining:
    """The strategy of a single process (distributed=none): no communication at all."""

    name = "none"

    def __init__(self, ctx: DistContext):
        self.ctx = ctx

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def grad_sync(self, last_micro_step: bool):
        return nullcontext()

    def after_inner_step(self, step: int) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def summary(self) -> dict[str, float]:
        return {"comm/total_bytes": 0}

    def close(self) -> None:
        pass


def init_distributed(cfg) -> DistContext:
    """Single process unless launched by torchrun; the multi-rank topologies come with their modes."""
    mode = cfg.distributed.mode
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        return DistContext(device=pick_device(cfg.device, local_rank))
    raise NotImplementedError(f"distributed.mode={mode} under torchrun")


def shutdown_distributed(ctx: DistContext) -> None:
    if ctx.initialized:
        dist.destroy_process_group()

"""How a run's ranks form DiLoCo workers: the one rule the launch plan (`experiments.plan.topology`)
and the process groups (`distributed.init_distributed`) both follow.

DDP is one worker of every rank, and so is a DumbDiLoCo node (one torchrun per node; the run's workers
are its nodes). A synchronous DiLoCo run has W workers of G consecutive ranks each, G being
`distributed.ranks_per_worker` or, when that is unset, the ranks of one node.
"""

from __future__ import annotations

from diloco.errors import ConfigError


def ranks_per_worker(mode: str, world_size: int, ranks_per_node: int, configured: int | None = None) -> int:
    """G, the ranks of one worker, of a torchrun world of `world_size` ranks, `ranks_per_node` per node;
    ConfigError when the ranks do not split into equal workers."""
    if mode in ("ddp", "dumb_diloco"):
        return world_size
    g = configured or ranks_per_node
    if world_size % g:
        raise ConfigError(
            f"world size {world_size} is not divisible by distributed.ranks_per_worker={g}: "
            f"every DiLoCo worker needs the same number of ranks"
        )
    return g

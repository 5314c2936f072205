"""The inner learning-rate schedule: linear warmup, then a cosine to 0 at optim.total_steps (transformers'
`get_cosine_schedule_with_warmup`, the same arithmetic), evaluated at the run's step as the strategy
reports it (`Strategy.progress`): the local step for every strategy but a DumbDiLoCo node under
`budget: global`, whose step is its estimate of the whole run's (dumb_diloco/node/progress.py).

Invariant: the step is clamped to [0, total_steps], since transformers' cosine rises again past its end
(a DumbDiLoCo node may train past total_steps of its own); with the local step, which train.max_steps <=
optim.total_steps keeps inside, the factors equal transformers' bit for bit (tests/dumb_diloco/node/test_dumb_progress.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR


def cosine_with_warmup(step: float, warmup_steps: int, total_steps: int) -> float:
    """The lr factor at `step` (clamped to [0, total_steps]): transformers' formula, half a cosine cycle."""
    step = min(max(step, 0), total_steps)
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_schedule(cfg, optimizer: torch.optim.Optimizer, progress: Callable[[int], float]) -> LambdaLR:
    """The scheduler the trainer steps once per optimizer step; `progress` maps its step count to the run's
    step. A plain function (not a callable object), so LambdaLR's state_dict holds only the step count."""
    warmup, total = cfg.optim.warmup_steps, cfg.optim.total_steps
    return LambdaLR(optimizer, lambda step: cosine_with_warmup(progress(step), warmup, total))

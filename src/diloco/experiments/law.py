"""The CPU family's scaling-law regime (issue 33) as the law studies share it (scripts/tune_law.py,
tune_eager.py, ladder_law.py): the regime Charles et al. 2025 (arXiv 2503.09799) measured their law in,
scaled to 2 CPU cores. M=4 workers, H=30, 1,560 inner steps (52 outer rounds), warmup 100 steps then
cosine to the end, packed fresh data, every run judged on the tuning half of the held-out split
(`data.eval_subset=tune`; the family reports `report`)."""

from __future__ import annotations

from pathlib import Path

from diloco.experiments.sweep import Setting, Sweep, past_the_edge

STEPS = 1560  # 52 outer rounds at H=30
REGIME = (
    "model=2m",
    "data.packing=true",
    "data.eval_subset=tune",
    f"optim.total_steps={STEPS}",
    f"train.max_steps={STEPS}",
    "optim.warmup_steps=100",
    "train.eval_every=120",
    "train.log_every=30",
    "launch.reference=null",
    "launch.family=tiny-law-tune",
)
BATCH = {  # sequences of 128 tokens per step (per worker for DiLoCo), and per micro-batch
    "tiny/ddp_1x": ("train.batch_size=4", "train.micro_batch_size=4"),
    "tiny/ddp_mx": ("train.batch_size=16", "train.micro_batch_size=8"),
    "tiny/diloco_fp32": ("train.batch_size=4", "train.micro_batch_size=4"),
}
LRS = (2e-3, 4e-3, 8e-3)
STUDY_OUTER = (0.6, 0.9)  # the study's best constant outer lr for M=4, with Nesterov momentum 0.9
OUTER = [(0.5, 0.8), (1.0, 0.0)]  # stage 2: the earlier tuning's outer optimizer, and plain averaging
SWEEP = Sweep("law", STEPS, REGIME, BATCH)


def diloco(lr: float, outer_lr: float, momentum: float) -> Setting:
    keys = {"inner_steps": 30, "outer_lr": outer_lr, "outer_momentum": momentum}
    name = f"lr{lr:g}-h30-o{outer_lr}-m{momentum}"
    return name, [f"optim.lr={lr}", *(f"distributed.{k}={v}" for k, v in keys.items())]


def inner_setting(experiment: str, lr: float) -> Setting:
    """A method's setting at inner lr `lr`: DiLoCo's with the study's outer optimizer."""
    if experiment == "tiny/diloco_fp32":
        return diloco(lr, *STUDY_OUTER)
    return f"lr{lr:g}", [f"optim.lr={lr}"]


def inner_lrs(runs: Path, experiment: str, seed: int) -> list[float]:
    """The grid of one method: LRS, plus one point past an edge that wins at `seed` (the first seed)."""
    lrs = list(LRS)
    got = {lr: SWEEP.read(runs, experiment, inner_setting(experiment, lr)[0], seed) for lr in lrs}
    if any(g is None for g in got.values()):
        return lrs
    best = min(lrs, key=lambda lr: got[lr]["final_eval_loss"])
    edge = past_the_edge(best, lrs)
    return lrs if edge is None else sorted([*lrs, edge])


def best_diloco_lr(rows: list[dict]) -> float | None:
    """DiLoCo's inner lr with the lowest mean loss, once every point of its grid has every seed."""
    mine = [r for r in rows if r["experiment"] == "tiny/diloco_fp32"]
    if not mine or any(r["mean_loss"] is None for r in mine):
        return None
    best = min(mine, key=lambda r: r["mean_loss"])
    return float(best["setting"].split("-")[0].removeprefix("lr"))

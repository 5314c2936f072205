"""The grid runner the tuning and ladder studies share: named settings per experiment, each run at every
seed on this machine (`run.run_local`, which skips a run already complete) and read back from its
summary, then ranked by the mean over seeds.

A grid maps an experiment (`tiny/ddp_mx`) to its settings, each a (name, overrides) pair. A run is named
`<prefix>-<experiment's leaf>-<setting>-s<seed>`; its overrides are the sweep's own, the experiment's,
the setting's, then its name and seed. The studies that read this: scripts/tune_law.py, tune_eager.py,
tune_tiny.py and ladder_law.py (which names its rungs' runs after tune_law's).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from diloco.experiments import records
from diloco.experiments.plan import compose_experiment
from diloco.experiments.plan import unique_train_tokens as plan_unique_tokens
from diloco.experiments.run import run_local

Setting = tuple[str, list[str]]  # (name, overrides)
Grid = Mapping[str, list[Setting]]  # experiment -> its settings
FINAL_KEYS = ("final_eval_perplexity", "final_eval_loss", "tokens_seen", "wall_seconds", "git_commit")
NAN_KEYS = (
    "final_eval_perplexity",
    "final_eval_loss",
)  # a summary's null there is a NaN (metrics.finite_json)


def read_final(path: Path, steps: int | None, keys=FINAL_KEYS) -> dict | None:
    """`keys` of the run summary at `path` (refused when dirty or short of `steps`), None before it ends."""
    if not path.exists():
        return None
    s = records.clean_summary(path, steps)
    return {k: math.nan if s[k] is None and k in NAN_KEYS else s[k] for k in keys}  # null: not finite


def past_the_edge(best: float, grid: list[float]) -> float | None:
    """The point one step past `grid`'s edge when `best` sits on it (twice the top, half the bottom)."""
    if best == max(grid):
        return best * 2
    return best / 2 if best == min(grid) else None


@functools.cache
def _experiment(experiment: str) -> tuple[bool, int]:
    """Whether `experiment` is a DumbDiLoCo one, and its own steps."""
    cfg = compose_experiment(experiment, [])
    return cfg.distributed.mode == "dumb_diloco", cfg.train.max_steps


def unique_tokens_of(model: str) -> int:
    """The sample's unique training tokens as the studies pack them (`data.packing=true`) for `model`."""
    overrides = [f"model={model}", "seed=0", "data.packing=true"]
    return plan_unique_tokens(compose_experiment("tiny/ddp_mx", overrides).data)


@dataclass(frozen=True)
class Sweep:
    prefix: str
    steps: int | None  # every run's steps (its summary must say so); None: each experiment's own
    common: tuple[str, ...]  # every run's overrides
    per_experiment: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    keys: tuple[str, ...] = FINAL_KEYS  # what a row keeps of each run's summary

    def run_name(self, experiment: str, setting: str, seed: int) -> str:
        return f"{self.prefix}-{experiment.split('/')[1]}-{setting}-s{seed}"

    def overrides(self, experiment: str, setting: Setting, seed: int) -> list[str]:
        name = self.run_name(experiment, setting[0], seed)
        own = self.per_experiment.get(experiment, ())
        return [*self.common, *own, *setting[1], f"run_name={name}", f"seed={seed}"]

    def run(self, runs: Path, grid: Grid, seeds: list[int]) -> None:
        """Every setting at the first seed, then at the next seed."""
        for seed in seeds:
            for experiment, settings in grid.items():
                for setting in settings:
                    run_local(experiment, runs, self.overrides(experiment, setting, seed))

    def read(self, runs: Path, experiment: str, setting: str, seed: int) -> dict | None:
        """One run's final figures; a DumbDiLoCo run's are its master's (the final global's evaluation)."""
        dumb, own_steps = _experiment(experiment)
        master = "-node-0" if dumb else ""
        path = runs / f"{self.run_name(experiment, setting, seed)}{master}" / "summary.json"
        return read_final(path, self.steps or own_steps, self.keys)

    def rows(self, runs: Path, grid: Grid, seeds: list[int]) -> list[dict]:
        """One row per setting (`loss_row`), in the grid's order."""
        rows = []
        for experiment, settings in grid.items():
            for setting, _ in settings:
                got = [self.read(runs, experiment, setting, s) for s in seeds]
                rows.append({"experiment": experiment, "setting": setting, **loss_row(got)})
        return rows

    def restore(self, runs: Path, record: Path) -> int:
        """For every finished run of a committed record (its `summary.json`) whose folder is not in `runs`,
        a summary.json with what the record kept of it, so that the sweep goes on where the record
        stopped (run folders are not committed). Returns how many were written."""
        d, written = json.loads(record.read_text()), 0
        for row in d["rows"]:
            for seed, run in zip(d["seeds"], row["runs"]):
                folder = runs / self.run_name(row["experiment"], row["setting"], seed)
                if run is None or (folder / "summary.json").exists():
                    continue
                folder.mkdir(parents=True, exist_ok=True)
                kept = {**run, "step": self.steps, "status": "completed", "restored_from": str(record)}
                records.write_json(folder / "summary.json", kept)
                written += 1
        return written


def loss_row(got: list[dict | None]) -> dict:
    """A setting's runs at each seed: the loss and perplexity per seed, the mean loss and its range
    (`spread_loss`, max - min), both None until every seed has run."""
    done = all(g is not None for g in got)
    loss = [g["final_eval_loss"] if g else None for g in got]
    return {
        "loss_per_seed": loss,
        "ppl_per_seed": [g["final_eval_perplexity"] if g else None for g in got],
        "mean_loss": sum(loss) / len(loss) if done else None,
        "spread_loss": max(loss) - min(loss) if done else None,
        "runs": got,
    }


def table(rows: list[dict], seeds: list[int]) -> str:
    """Each experiment's settings ranked by mean loss (incomplete ones last)."""
    lines = []
    for experiment in dict.fromkeys(r["experiment"] for r in rows):
        mine = [r for r in rows if r["experiment"] == experiment]
        mine.sort(key=lambda r: math.inf if r["mean_loss"] is None else r["mean_loss"])
        cols = " | ".join(f"seed {s} loss (ppl)" for s in seeds)
        lines += [f"\n### {experiment}\n", f"| rank | setting | {cols} | mean loss | range (max - min) |"]
        lines.append("|---" * (len(seeds) + 4) + "|")
        lines += [_ranked_line(i, r) for i, r in enumerate(mine, 1)]
    return "\n".join(lines) + "\n"


def _ranked_line(rank: int, r: dict) -> str:
    per = " | ".join(
        "-" if x is None else f"{x:.4f} ({p:.2f})" for x, p in zip(r["loss_per_seed"], r["ppl_per_seed"])
    )
    mean = "-" if r["mean_loss"] is None else f"{r['mean_loss']:.4f}"
    spread = "-" if r["spread_loss"] is None else f"{r['spread_loss']:.4f}"
    return f"| {'-' if r['mean_loss'] is None else rank} | {r['setting']} | {per} | {mean} | {spread} |"

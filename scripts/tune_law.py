"""Fair tuning of the CPU family in the scaling-law regime (issue 33): each method's inner learning rate,
then DiLoCo's outer optimizer, every setting at 2 seeds, judged on the tuning half of the held-out split.

    python scripts/tune_law.py --runs runs/tune-law                 # stage 1 and 2 (skips complete runs)
    python scripts/tune_law.py --runs runs/tune-law --stage inner   # stage 1 only: the inner lr sweeps
    python scripts/tune_law.py --runs runs/tune-law --report-only   # results/tiny-law-tuning from the runs
    python scripts/tune_law.py --runs runs/tune-law --restore       # the record's finished runs, then go on

The regime (`REGIME` below) is the one Charles et al. 2025 (arXiv 2503.09799) measured their scaling law
in, scaled to 2 CPU cores: M=4 workers, H=30, more than 50 outer rounds (1,560 inner steps = 52 rounds),
about 12 tokens per parameter (the `2m` model: 262,464 parameters; 3.2M tokens for the M-worker runs,
0.42 epochs of the sample, every token read once), warmup 100 steps then cosine to the end. The 4x-batch
DDP baseline reads the same tokens as DiLoCo (16 sequences per step on 2 ranks); the 1x baseline reads a
quarter of them (4 sequences per step, as one DiLoCo worker).

Stage 1 sweeps the inner learning rate of each method separately (1x DDP, 4x DDP, DiLoCo with the study's
outer lr 0.6 and Nesterov momentum 0.9) over 2e-3, 4e-3 and 8e-3 at the first seed; where the best is
at an edge, one more point past it joins the grid; then every point runs at every seed, ranked by mean
loss. Stage 2 takes DiLoCo's best inner learning rate and tries the outer optimizers of the earlier
tuning (0.5 / 0.8) and plain averaging (1.0 / 0). Every run is evaluated
on `data.eval_subset=tune` (odd-numbered validation documents); the family reports `report`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from ladder import unique_train_tokens

from diloco.experiments import records
from diloco.experiments.run import run_local

ROOT = Path(__file__).resolve().parents[1]
STEPS = 1560  # 52 outer rounds at H=30
REGIME = [
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
]
BATCH = {  # sequences of 128 tokens per step (per worker for DiLoCo), and per micro-batch
    "tiny/ddp_1x": ["train.batch_size=4", "train.micro_batch_size=4"],
    "tiny/ddp_mx": ["train.batch_size=16", "train.micro_batch_size=8"],
    "tiny/diloco_fp32": ["train.batch_size=4", "train.micro_batch_size=4"],
}
LRS = (2e-3, 4e-3, 8e-3)
STUDY_OUTER = (0.6, 0.9)  # the study's best constant outer lr for M=4, with Nesterov momentum 0.9
OUTER = [(0.5, 0.8), (1.0, 0.0)]


def diloco(lr: float, outer_lr: float, momentum: float) -> tuple[str, list[str]]:
    keys = {"inner_steps": 30, "outer_lr": outer_lr, "outer_momentum": momentum}
    name = f"lr{lr:g}-h30-o{outer_lr}-m{momentum}"
    return name, [f"optim.lr={lr}", *(f"distributed.{k}={v}" for k, v in keys.items())]


def inner_setting(experiment: str, lr: float) -> tuple[str, list[str]]:
    if experiment == "tiny/diloco_fp32":
        return diloco(lr, *STUDY_OUTER)
    return f"lr{lr:g}", [f"optim.lr={lr}"]


def inner_lrs(runs: Path, experiment: str, seed: int) -> list[float]:
    """The grid of one method: LRS, plus one point past an edge that wins at `seed` (the first seed)."""
    lrs = list(LRS)
    got = {
        lr: read(runs, experiment, run_name(experiment, inner_setting(experiment, lr)[0], seed)) for lr in lrs
    }
    if any(g is None for g in got.values()):
        return lrs
    best = min(lrs, key=lambda lr: got[lr]["final_eval_loss"])
    if best == max(lrs):
        lrs.append(best * 2)
    elif best == min(lrs):
        lrs.insert(0, best / 2)
    return lrs


def run_name(experiment: str, setting: str, seed: int) -> str:
    return f"law-{experiment.split('/')[1]}-{setting}-s{seed}"


def overrides(experiment: str, setting: list[str], seed: int) -> list[str]:
    name = run_name(experiment, setting[0], seed)
    return [*REGIME, *BATCH[experiment], *setting[1], f"run_name={name}", f"seed={seed}"]


def read(runs: Path, experiment: str, name: str) -> dict | None:
    path = runs / name / "summary.json"
    if not path.exists():
        return None
    s = records.clean_summary(path, STEPS)
    return {
        k: s[k]
        for k in ("final_eval_perplexity", "final_eval_loss", "tokens_seen", "wall_seconds", "git_commit")
    }


def rows_of(runs: Path, grid: dict, seeds: list[int]) -> list[dict]:
    """One row per setting: each seed's final loss and perplexity on the tuning half, the mean and the
    spread (max - min) of the loss; None until every seed has run."""
    rows = []
    for experiment, settings in grid.items():
        for setting, _ in settings:
            got = [read(runs, experiment, run_name(experiment, setting, s)) for s in seeds]
            done = all(g is not None for g in got)
            loss = [g["final_eval_loss"] if g else None for g in got]
            rows.append(
                {
                    "experiment": experiment,
                    "setting": setting,
                    "loss_per_seed": loss,
                    "ppl_per_seed": [g["final_eval_perplexity"] if g else None for g in got],
                    "mean_loss": sum(loss) / len(loss) if done else None,
                    "spread_loss": max(loss) - min(loss) if done else None,
                    "runs": got,
                }
            )
    return rows


def table(rows: list[dict], seeds: list[int]) -> str:
    """Each method's settings ranked by mean loss (incomplete ones last)."""
    lines = []
    for experiment in dict.fromkeys(r["experiment"] for r in rows):
        mine = [r for r in rows if r["experiment"] == experiment]
        mine.sort(key=lambda r: math.inf if r["mean_loss"] is None else r["mean_loss"])
        cols = " | ".join(f"seed {s} loss (ppl)" for s in seeds)
        lines += [f"\n### {experiment}\n", f"| rank | setting | {cols} | mean loss | spread |"]
        lines.append("|---" * (len(seeds) + 4) + "|")
        for i, r in enumerate(mine, 1):
            per = " | ".join(
                "-" if x is None else f"{x:.4f} ({p:.2f})"
                for x, p in zip(r["loss_per_seed"], r["ppl_per_seed"])
            )
            mean = "-" if r["mean_loss"] is None else f"{r['mean_loss']:.4f}"
            spread = "-" if r["spread_loss"] is None else f"{r['spread_loss']:.4f}"
            rank = "-" if r["mean_loss"] is None else str(i)
            lines.append(f"| {rank} | {r['setting']} | {per} | {mean} | {spread} |")
    return "\n".join(lines) + "\n"


def best_diloco_lr(rows: list[dict]) -> float | None:
    """DiLoCo's inner lr with the lowest mean loss, once every point of its grid has every seed."""
    mine = [r for r in rows if r["experiment"] == "tiny/diloco_fp32"]
    if not mine or any(r["mean_loss"] is None for r in mine):
        return None
    best = min(mine, key=lambda r: r["mean_loss"])
    return float(best["setting"].split("-")[0].removeprefix("lr"))


def restore(runs: Path, record: Path) -> int:
    """For every finished run of a committed record (`summary.json` of results/tiny-law-tuning) whose folder
    is not in `runs`, a summary.json with what the record kept of it, so that the tuning goes on where the
    record stopped (run folders are not committed). Returns how many were written."""
    d, written = json.loads(record.read_text()), 0
    for row in d["rows"]:
        for seed, run in zip(d["seeds"], row["runs"]):
            folder = runs / run_name(row["experiment"], row["setting"], seed)
            if run is None or (folder / "summary.json").exists():
                continue
            folder.mkdir(parents=True, exist_ok=True)
            kept = {**run, "step": STEPS, "status": "completed", "restored_from": str(record)}
            (folder / "summary.json").write_text(json.dumps(kept, indent=1) + "\n")
            written += 1
    return written


def run_grid(runs: Path, grid: dict, seeds: list[int]) -> None:
    for seed in seeds:  # every setting at the first seed, then the next seed
        for experiment, settings in grid.items():
            for setting in settings:
                run_local(experiment, runs, overrides(experiment, setting, seed))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("runs/tune-law"))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "tiny-law-tuning")
    p.add_argument("--seeds", nargs="*", type=int, default=[1337, 1])
    p.add_argument("--stage", choices=["inner", "all"], default="all")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--restore", action="store_true", help="first restore the finished runs of --out's record")
    args = p.parse_args(argv)
    if args.restore:
        print(
            f"restored {restore(args.runs, args.out / 'summary.json')} runs from {args.out / 'summary.json'}"
        )
    if not args.report_only:  # the first seed's sweep, its extension, then the other seeds
        run_grid(args.runs, {e: [inner_setting(e, lr) for lr in LRS] for e in BATCH}, args.seeds[:1])
        grid = {e: [inner_setting(e, lr) for lr in inner_lrs(args.runs, e, args.seeds[0])] for e in BATCH}
        run_grid(args.runs, grid, args.seeds)
    grid = {e: [inner_setting(e, lr) for lr in inner_lrs(args.runs, e, args.seeds[0])] for e in BATCH}
    rows = rows_of(args.runs, grid, args.seeds)
    lr = best_diloco_lr(rows)
    outer = {"tiny/diloco_fp32": [diloco(lr, *o) for o in OUTER]} if lr is not None else {}
    if outer and args.stage == "all" and not args.report_only:
        run_grid(args.runs, outer, args.seeds)
    rows += rows_of(args.runs, outer, args.seeds)
    unique = unique_train_tokens("2m")
    detail = f"{STEPS} steps (DiLoCo: {STEPS // 30} outer rounds at H=30); "
    regime = records.tuning_regime(rows, unique, detail)
    record = {
        **records.provenance(f"python scripts/tune_law.py --runs {args.runs} --stage {args.stage}"),
        "regime_overrides": REGIME,
        "batch_overrides": BATCH,
        "seeds": args.seeds,
        "unique_train_tokens": unique,
        "diloco_best_inner_lr": lr,
        "rows": rows,
    }
    records.write_tuning_record(args.out, record, regime + table(rows, args.seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

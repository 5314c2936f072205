"""Fair tuning of the CPU family in the scaling-law regime (issue 33): each method's inner learning rate,
then DiLoCo's outer optimizer, every setting at 2 seeds, judged on the tuning half of the held-out split.

    python scripts/tune_law.py --runs runs/tune-law                 # stage 1 and 2 (skips complete runs)
    python scripts/tune_law.py --runs runs/tune-law --stage inner   # stage 1 only: the inner lr sweeps
    python scripts/tune_law.py --runs runs/tune-law --report-only   # results/tiny-law-tuning from the runs

The regime (`REGIME` below) is the one Charles et al. 2025 (arXiv 2503.09799) measured their scaling law
in, scaled to 2 CPU cores: M=4 workers, H=30, more than 50 outer rounds (1,560 inner steps = 52 rounds),
about 12 tokens per parameter (the `2m` model: 262,464 parameters; 3.2M tokens for the M-worker runs,
0.42 epochs of the sample, every token read once), warmup 100 steps then cosine to the end. The 4x-batch
DDP baseline reads the same tokens as DiLoCo (16 sequences per step on 2 ranks); the 1x baseline reads a
quarter of them (4 sequences per step, as one DiLoCo worker).

Stage 1 sweeps the inner learning rate of each method separately (1x DDP, 4x DDP, DiLoCo with the study's
outer lr 0.6 and Nesterov momentum 0.9). Stage 2 takes DiLoCo's best inner learning rate and tries the
outer optimizers of the earlier tuning (0.5 / 0.8) and plain averaging (1.0 / 0). Every run is evaluated
on `data.eval_subset=tune` (odd-numbered validation documents); the family reports `report`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import bench_common as bc
from ladder import unique_train_tokens
from replicate import run_local
from tune_tiny import table

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


INNER = {
    "tiny/ddp_1x": [(f"lr{lr:g}", [f"optim.lr={lr}"]) for lr in LRS],
    "tiny/ddp_mx": [(f"lr{lr:g}", [f"optim.lr={lr}"]) for lr in LRS],
    "tiny/diloco_fp32": [diloco(lr, *STUDY_OUTER) for lr in LRS],
}


def run_name(experiment: str, setting: str, seed: int) -> str:
    return f"law-{experiment.split('/')[1]}-{setting}-s{seed}"


def overrides(experiment: str, setting: list[str], seed: int) -> list[str]:
    name = run_name(experiment, setting[0], seed)
    return [*REGIME, *BATCH[experiment], *setting[1], f"run_name={name}", f"seed={seed}"]


def read(runs: Path, experiment: str, name: str) -> dict | None:
    path = runs / name / "summary.json"
    if not path.exists():
        return None
    s = bc.clean_summary(path, STEPS)
    return {
        k: s[k]
        for k in ("final_eval_perplexity", "final_eval_loss", "tokens_seen", "wall_seconds", "git_commit")
    }


def rows_of(runs: Path, grid: dict, seeds: list[int]) -> list[dict]:
    rows = []
    for experiment, settings in grid.items():
        for setting, _ in settings:
            got = [read(runs, experiment, run_name(experiment, setting, s)) for s in seeds]
            ppl = [None if g is None else g["final_eval_perplexity"] for g in got]
            done = len([x for x in ppl if x is not None]) == len(ppl)
            rows.append(
                {
                    "experiment": experiment,
                    "setting": setting,
                    "per_seed": ppl,
                    "mean": sum(ppl) / len(ppl) if done else None,
                    "spread": max(ppl) - min(ppl) if done else None,
                    "runs": got,
                }
            )
    return rows


def best_diloco_lr(rows: list[dict]) -> float | None:
    mine = [r for r in rows if r["experiment"] == "tiny/diloco_fp32" and r["mean"] is not None]
    if len(mine) < len(LRS):
        return None
    best = min(mine, key=lambda r: r["mean"])
    return float(best["setting"].split("-")[0].removeprefix("lr"))


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
    args = p.parse_args(argv)
    if not args.report_only:
        run_grid(args.runs, INNER, args.seeds)
    rows = rows_of(args.runs, INNER, args.seeds)
    lr = best_diloco_lr(rows)
    outer = {"tiny/diloco_fp32": [diloco(lr, *o) for o in OUTER]} if lr is not None else {}
    if outer and args.stage == "all" and not args.report_only:
        run_grid(args.runs, outer, args.seeds)
    rows += rows_of(args.runs, outer, args.seeds)
    unique = unique_train_tokens("2m")
    tokens = {r["experiment"]: g["tokens_seen"] for r in rows for g in r["runs"] if g}
    per_run = "; ".join(f"{e} {t:,} ({t / unique:.2f} epochs)" for e, t in tokens.items())
    regime = (
        f"Data regime: packing, {unique:,} unique training tokens; tokens trained per run: {per_run}; "
        f"{STEPS} steps (DiLoCo: {STEPS // 30} outer rounds at H=30); evaluated on data.eval_subset=tune.\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        **bc.provenance(f"python scripts/tune_law.py --runs {args.runs} --stage {args.stage}"),
        "regime_overrides": REGIME,
        "batch_overrides": BATCH,
        "seeds": args.seeds,
        "unique_train_tokens": unique,
        "diloco_best_inner_lr": lr,
        "rows": rows,
    }
    (args.out / "summary.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "table.md").write_text(regime + table(rows, args.seeds))
    print(regime + table(rows, args.seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

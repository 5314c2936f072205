"""Fair tuning for the CPU-scale family (issue 15): DiLoCo's outer optimizer and H, and the DDP baselines'
learning rate, each setting at 2 seeds, judged on the tuning half of the held-out documents.

    python scripts/tune_tiny.py --runs runs/tune                # every setting and seed (skips complete runs)
    python scripts/tune_tiny.py --runs runs/tune --report-only  # results/tiny-tuning from the summaries
    python scripts/tune_tiny.py --runs runs/tune-async --experiments tiny/dumb_diloco \
        --out results/tiny-tuning-async                         # DumbDiLoCo's own H and outer optimizer

Every run is the family's own experiment (`tiny/ddp_1x`, `tiny/ddp_mx`, `tiny/diloco_fp32`, 400 steps,
micro model, 4 workers) on fresh data (`data.packing=true`: about a fifth of the sample's training tokens,
read once) and evaluated on `data.eval_subset=tune` (the odd-numbered validation documents); the
family's reports use the other half (`report`), so nothing is selected on the numbers it reports. The
grid puts plain averaging (outer lr 1, momentum 0) beside the paper's outer optimizer (0.7 / 0.9) and the
earlier sweep's choice (0.5 / 0.8), at H = 10, 25 and 50, and gives the baselines three learning rates
around the family's 2e-3 (DiLoCo's inner learning rate stays 2e-3). The record ranks the settings of each
method by their mean over seeds and shows each seed's perplexity and the spread (the range, max - min).
Runs go through `diloco.experiments.sweep`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diloco.experiments import records, sweep

ROOT = records.ROOT
COMMON = ("data.packing=true", "data.eval_subset=tune", "launch.reference=null", "launch.family=tiny-tune")
LRS = (1e-3, 2e-3, 4e-3)
KEYS = ("final_eval_perplexity", "tokens_seen", "wall_seconds", "git_commit")
SWEEP = sweep.Sweep("tune", None, COMMON, keys=KEYS)  # each experiment's own steps (400)


def outer(h: int, lr: float, m: float) -> sweep.Setting:
    """One DiLoCo / DumbDiLoCo setting: its name and its overrides."""
    keys = {"inner_steps": h, "outer_lr": lr, "outer_momentum": m}
    return f"h{h}-lr{lr}-m{m}", [f"distributed.{k}={v}" for k, v in keys.items()]


GRID = {  # experiment -> settings (name, overrides)
    "tiny/diloco_fp32": [
        outer(h, lr, m) for h in (10, 25, 50) for lr, m in ((1.0, 0.0), (0.5, 0.8), (0.7, 0.9))
    ],
    # DumbDiLoCo (master + 3 workers): the synchronous best, plain averaging at H=10 (its second) and a
    # longer H, tuned on its own rather than assumed to share synchronous DiLoCo's best
    "tiny/dumb_diloco": [outer(25, 0.5, 0.8), outer(10, 1.0, 0.0), outer(50, 0.5, 0.8)],
    "tiny/ddp_mx": [(f"lr{lr:g}", [f"optim.lr={lr}"]) for lr in LRS],
    "tiny/ddp_1x": [(f"lr{lr:g}", [f"optim.lr={lr}"]) for lr in LRS],
}


def ppl_row(experiment: str, setting: str, got: list[dict | None]) -> dict:
    """A setting's perplexity per seed, their mean and range (max - min), None until every seed ran."""
    ppl = [None if g is None else g["final_eval_perplexity"] for g in got]
    done = None not in ppl
    return {
        "experiment": experiment,
        "setting": setting,
        "per_seed": ppl,
        "mean": sum(ppl) / len(ppl) if done else None,
        "spread": max(ppl) - min(ppl) if done else None,
        "runs": got,
    }


def table(rows: list[dict], seeds: list[int]) -> str:
    lines = []
    for experiment in dict.fromkeys(r["experiment"] for r in rows):
        mine = sorted((r for r in rows if r["experiment"] == experiment), key=lambda r: r["mean"] or 1e9)
        lines += [
            f"\n### {experiment}\n",
            "| rank | setting | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | spread |",
        ]
        lines.append("|---" * (len(seeds) + 4) + "|")
        for i, r in enumerate(mine, 1):
            per = " | ".join("-" if p is None else f"{p:.2f}" for p in r["per_seed"])
            mean = "-" if r["mean"] is None else f"{r['mean']:.2f}"
            spread = "-" if r["spread"] is None else f"{r['spread']:.2f}"
            lines.append(f"| {i} | {r['setting']} | {per} | {mean} | {spread} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("runs/tune"))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "tiny-tuning")
    p.add_argument("--seeds", nargs="*", type=int, default=[1337, 1])
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--experiments", nargs="*", default=list(GRID), choices=list(GRID))
    args = p.parse_args(argv)
    grid = {e: GRID[e] for e in args.experiments}
    if not args.report_only:
        SWEEP.run(args.runs, grid, args.seeds)
    rows = [
        ppl_row(e, name, [SWEEP.read(args.runs, e, name, s) for s in args.seeds])
        for e, settings in grid.items()
        for name, _ in settings
    ]
    unique = sweep.unique_tokens_of("micro")
    regime = records.tuning_regime(rows, unique)
    record = {
        **records.provenance(
            f"python scripts/tune_tiny.py --runs {args.runs} --experiments {' '.join(grid)}"
        ),
        "common_overrides": list(COMMON),
        "seeds": args.seeds,
        "unique_train_tokens": unique,
        "rows": rows,
    }
    records.write_tuning_record(args.out, record, regime + table(rows, args.seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

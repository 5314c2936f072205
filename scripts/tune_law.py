"""Fair tuning of the CPU family in the scaling-law regime (issue 33): each method's inner learning rate,
then DiLoCo's outer optimizer, every setting at 2 seeds, judged on the tuning half of the held-out split.

    python scripts/tune_law.py --runs runs/tune-law                 # stage 1 and 2 (skips complete runs)
    python scripts/tune_law.py --runs runs/tune-law --stage inner   # stage 1 only: the inner lr sweeps
    python scripts/tune_law.py --runs runs/tune-law --report-only   # results/tiny-law-tuning from the runs
    python scripts/tune_law.py --runs runs/tune-law --restore       # the record's finished runs, then go on

The regime (`diloco.experiments.law`) is the one Charles et al. 2025 (arXiv 2503.09799) measured their scaling law
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
from pathlib import Path

from diloco.experiments import law, records, sweep

ROOT = records.ROOT


def inner_grid(runs: Path, seed: int | None) -> dict:
    """Stage 1's grid: each method's inner lrs (extended past a winning edge at `seed` once it has run)."""
    return {
        e: [law.inner_setting(e, lr) for lr in (law.LRS if seed is None else law.inner_lrs(runs, e, seed))]
        for e in law.BATCH
    }


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
        restored = law.SWEEP.restore(args.runs, args.out / "summary.json")
        print(f"restored {restored} runs from {args.out / 'summary.json'}")
    if not args.report_only:  # the first seed's sweep, its extension, then the other seeds
        law.SWEEP.run(args.runs, inner_grid(args.runs, None), args.seeds[:1])
        law.SWEEP.run(args.runs, inner_grid(args.runs, args.seeds[0]), args.seeds)
    rows = law.SWEEP.rows(args.runs, inner_grid(args.runs, args.seeds[0]), args.seeds)
    lr = law.best_diloco_lr(rows)
    outer = {"tiny/diloco_fp32": [law.diloco(lr, *o) for o in law.OUTER]} if lr is not None else {}
    if outer and args.stage == "all" and not args.report_only:
        law.SWEEP.run(args.runs, outer, args.seeds)
    rows += law.SWEEP.rows(args.runs, outer, args.seeds)
    unique = sweep.unique_tokens_of("2m")
    detail = f"{law.STEPS} steps (DiLoCo: {law.STEPS // 30} outer rounds at H=30); "
    record = {
        **records.provenance(f"python scripts/tune_law.py --runs {args.runs} --stage {args.stage}"),
        "regime_overrides": list(law.REGIME),
        "batch_overrides": {e: list(b) for e, b in law.BATCH.items()},
        "seeds": args.seeds,
        "unique_train_tokens": unique,
        "diloco_best_inner_lr": lr,
        "rows": rows,
    }
    text = records.tuning_regime(rows, unique, detail) + sweep.table(rows, args.seeds)
    records.write_tuning_record(args.out, record, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

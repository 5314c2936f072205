"""The outer optimizer of eager updates, tuned on its own (issue 32): eager updates were judged at the
outer optimizer tuned for synchronous DiLoCo (0.5 / Nesterov 0.8), and came out 33% behind non-overlapped
Streaming P=4 (results/tiny-law-frontier). Part of every eager outer step applies the other workers'
shares one round late, and a stale gradient under heavy momentum is what the naive delayed step shows at
its worst (+329%), so the outer lr and momentum are the first thing to tune for it.

    python scripts/tune_eager.py --runs runs/tune-eager                # every setting at 2 seeds
    python scripts/tune_eager.py --runs runs/tune-eager --report-only  # results/tiny-law-eager-tuning

`tiny_law/diloco_stream_p4_eager` (the scaling-law regime of results/tiny-law: 262k parameters, 4 workers,
H=30, 52 rounds, inner lr 2e-3) at the outer optimizers of `OUTER`, and non-overlapped Streaming P=4 at
the family's 0.5 / 0.8 as the reference, every run at 2 seeds and evaluated on `data.eval_subset=tune`
(the family reports `report`). Where the best outer lr is an edge of the grid at its momentum, one more
point past it joins. Runs are named and read like scripts/tune_law.py's (`diloco.experiments.sweep`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diloco.experiments import law, records, sweep

ROOT = records.ROOT
EAGER, STREAM = "tiny_law/diloco_stream_p4_eager", "tiny_law/diloco_stream_p4"
REGIME = ("data.eval_subset=tune", "launch.reference=null", "launch.family=tiny-law-eager-tune")
OUTER = [(0.5, 0.8), (0.25, 0.8), (0.5, 0.5), (0.5, 0.0), (1.0, 0.0)]  # (outer lr, Nesterov momentum)
SWEEP = sweep.Sweep("law", law.STEPS, REGIME)


def setting(outer_lr: float, momentum: float) -> sweep.Setting:
    keys = {"outer_lr": outer_lr, "outer_momentum": momentum}
    return f"o{outer_lr:g}-m{momentum:g}", [f"distributed.{k}={v}" for k, v in keys.items()]


def extended(rows: list[dict]) -> list[tuple[float, float]]:
    """OUTER, plus the next outer lr past the best one when it is the edge of its momentum's grid (half the
    lowest, or twice the highest); the rows must be complete."""
    done = [r for r in rows if r["experiment"] == EAGER and r["mean_loss"] is not None]
    if len(done) < len(OUTER):
        return list(OUTER)
    best = min(done, key=lambda r: r["mean_loss"])["setting"]
    lr, m = (float(part[1:]) for part in best.split("-"))
    lrs = [o for o, mo in OUTER if mo == m]
    extra = lr / 2 if lr == min(lrs) else lr * 2 if lr == max(lrs) and len(lrs) > 1 else None
    return list(OUTER) + ([(extra, m)] if extra is not None and extra <= 2 else [])


def grid(outers: list[tuple[float, float]]) -> dict:
    return {EAGER: [setting(*o) for o in outers], STREAM: [setting(0.5, 0.8)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("runs/tune-eager"))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "tiny-law-eager-tuning")
    p.add_argument("--seeds", nargs="*", type=int, default=[1337, 1])
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    if not args.report_only:
        SWEEP.run(args.runs, grid(OUTER), args.seeds)
        more = extended(SWEEP.rows(args.runs, grid(OUTER), args.seeds))[len(OUTER) :]
        SWEEP.run(args.runs, {EAGER: [setting(*o) for o in more]}, args.seeds)
    rows = SWEEP.rows(args.runs, grid(extended(SWEEP.rows(args.runs, grid(OUTER), args.seeds))), args.seeds)
    unique = sweep.unique_tokens_of("2m")
    regime = records.tuning_regime(
        rows, unique, f"{law.STEPS} steps ({law.STEPS // 30} outer rounds at H=30); "
    )
    record = {
        **records.provenance(f"python scripts/tune_eager.py --runs {args.runs}"),
        "regime_overrides": list(REGIME),
        "seeds": args.seeds,
        "unique_train_tokens": unique,
        "rows": rows,
    }
    records.write_tuning_record(args.out, record, regime + sweep.table(rows, args.seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The first sweep behind the CPU-scale family's DiLoCo settings (results/tiny/sweep.md; one seed, repeated data,
evaluated on the reported split: superseded by scripts/tune_tiny.py, results/tiny-tuning).

    python scripts/sweep_tiny.py [--runs runs/sweep] [--quick]

At this scale (0.7M-parameter model, 400 steps, 4 workers) the paper's outer lr 0.7 / momentum 0.9
is not guaranteed to be best (the paper tuned it for 150M and 88k steps), so the family's
`tiny/diloco_fp32` settings are chosen from this grid of outer lr, outer momentum and H, each run being
the real thing: `scripts/launch_node.sh --experiment tiny/diloco_fp32 --cpu` with overrides. The table
records every run, the chosen one included, with the command and commit.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

GRID = [  # (outer_lr, outer_momentum, H)
    (0.7, 0.9, 25),  # the paper's outer optimizer
    (0.7, 0.9, 50),
    (1.0, 0.5, 25),
    (1.0, 0.0, 25),  # plain averaging of the workers (outer SGD lr 1, no momentum)
    (0.5, 0.8, 25),
    (1.0, 0.9, 25),
    (0.5, 0.8, 50),  # added after the first six: the best of them had the lowest outer lr
    (0.3, 0.8, 25),
    (0.5, 0.8, 10),  # added next: every H=25 run was still ~25% behind 4x-batch DDP (42.2) at 400 steps,
    (0.7, 0.9, 10),  # so more frequent outer steps (40 instead of 16)
]


def run_one(runs: Path, lr: float, mom: float, h: int, quick: bool) -> dict:
    name = f"tiny-sweep-lr{lr}-m{mom}-h{h}"
    overrides = [
        f"out_dir={runs}",
        f"run_name={name}",
        f"distributed.outer_lr={lr}",
        f"distributed.outer_momentum={mom}",
        f"distributed.inner_steps={h}",
        "launch.reference=null",
        "launch.family=tiny-sweep",
        "train.progress=false",
    ]
    if quick:
        overrides += ["train.max_steps=50", "eval.tokens=4096"]
    summary = runs / name / "summary.json"
    if not summary.exists():
        cmd = ["scripts/launch_node.sh", "--experiment", "tiny/diloco_fp32", "--cpu", "--", *overrides]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    s = json.loads(summary.read_text())
    return {
        "outer_lr": lr,
        "outer_momentum": mom,
        "H": h,
        "final_eval_perplexity": s["final_eval_perplexity"],
        "wall_seconds": round(s["wall_seconds"]),
        "run": name,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("runs/sweep"))
    p.add_argument("--out", type=Path, default=Path("results/tiny"))
    p.add_argument("--quick", action="store_true", help="50 steps per run (tests)")
    args = p.parse_args(argv)
    rows = [run_one(args.runs, lr, m, h, args.quick) for lr, m, h in (GRID[:2] if args.quick else GRID)]
    rows.sort(key=lambda r: r["final_eval_perplexity"])
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Sweep: DiLoCo outer optimizer and H for the CPU-scale family",
        "",
        f"`python scripts/sweep_tiny.py` at commit {commit}, {dt.date.today()}, on {platform.node()} "
        f"({os.cpu_count()} CPU cores, shared). Each row is `tiny/diloco_fp32` (micro model, 4 workers, "
        "8 x 128-token sequences per worker per step, 400 steps, inner AdamW lr 2e-3) with the outer settings "
        "below; lower is better. The best row is what `configs/experiment/tiny/diloco_fp32.yaml` uses.",
        "",
        "| outer lr | outer momentum | H | final eval perplexity | wall s |",
        "|---|---|---|---|---|",
        *[
            f"| {r['outer_lr']} | {r['outer_momentum']} | {r['H']} | {r['final_eval_perplexity']:.2f} | "
            f"{r['wall_seconds']} |"
            for r in rows
        ],
        "",
    ]
    if not args.quick:
        (args.out / "sweep.md").write_text("\n".join(lines))
        (args.out / "sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

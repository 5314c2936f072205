"""`make budget-law` (issue 42): does DiLoCo close its gap to 4x DDP with more tokens? Separate
full-schedule runs at 0.25x, 0.5x, 1x and 2x the tiny_law family's token budget, 2 seeds each.

    python scripts/budget_law.py --runs runs/budget-law              # the runs (skips done ones), then the record
    python scripts/budget_law.py --runs runs/budget-law --report-only

Each run is the family's own setting (tiny_law/diloco_fp32: inner lr 2e-3, outer 0.5 / 0.8, M=4, H=30;
tiny_law/ddp_mx: lr 8e-3, the 4 workers' 16 sequences per step) with max_steps, the cosine's total_steps
and the warmup (100 of 1,560 steps, 6.4%) scaled together: a shorter run, not a point inside a longer
one. 4x DDP runs as one process with the 4x batch (the 2-rank gloo DDP is an order of magnitude slower
on 2 cores and computes the same mean gradient). Evaluation: the `report` half, once at the end.
C4 is judged from the final gaps: PASS when the gap at the largest budget is smaller than at the smallest
judged one on every seed, FAIL when it is smaller on none, UNCERTAIN (seeds on both sides: not supported)
otherwise. The smallest judged budget is 0.5x: at 0.25x one 4x-DDP seed (lr 8e-3 tuned at 1x, 390 steps)
ends 0.36 nats above the other, so that point is reported, not judged (issue 55; the record first judged
from it, FAIL). Writes results/budget-law/{summary.json, table.md, gap_vs_tokens.png}; `--rejudge` writes
them again from the committed summary.json's runs (run folders are not committed).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from diloco.experiments import records
from diloco.experiments.run import run_local

ROOT = records.ROOT
STEPS, WARMUP = 1560, 100  # the family's budget: 52 outer rounds at H=30
BUDGETS = (0.25, 0.5, 1.0, 2.0)
JUDGED_FROM = 0.5  # the smallest budget C4 is judged from (0.25x: reported; the module docstring)
SEEDS = (1337, 1)
METHODS = {
    "ddp": ("tiny_law/ddp_mx", ["launch.gpus_per_node=1", "train.micro_batch_size=16"]),
    "diloco": ("tiny_law/diloco_fp32", []),
}


def run_name(method: str, budget: float, seed: int) -> str:
    return f"budget-{method}-x{budget:g}-s{seed}"


def overrides(method: str, budget: float, seed: int, base_steps: int = STEPS) -> list[str]:
    steps = round(base_steps * budget)
    return [
        *METHODS[method][1],
        f"train.max_steps={steps}",
        f"optim.total_steps={steps}",
        f"optim.warmup_steps={max(1, round(WARMUP * steps / STEPS))}",
        "data.eval_subset=report",
        "train.eval_every=0",
        "launch.reference=null",
        "launch.family=budget-law",
        f"seed={seed}",
        f"run_name={run_name(method, budget, seed)}",
    ]


def final(runs: Path, method: str, budget: float, seed: int, base_steps: int) -> dict:
    steps = round(base_steps * budget)
    s = records.clean_summary(runs / run_name(method, budget, seed) / "summary.json", steps)
    return {k: s[k] for k in ("final_eval_loss", "tokens_seen", "wall_seconds", "git_commit", "parameters")}


def point(runs: Path, budget: float, seeds, base_steps: int) -> dict:
    runs_of = {m: [final(runs, m, budget, s, base_steps) for s in seeds] for m in METHODS}
    gaps = [
        d["final_eval_loss"] / b["final_eval_loss"] - 1 for d, b in zip(runs_of["diloco"], runs_of["ddp"])
    ]
    sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
    tokens = runs_of["diloco"][0]["tokens_seen"]
    return {
        "budget": budget,
        "tokens": tokens,
        "runs": runs_of,
        "gap": gaps,
        "mean": statistics.fmean(gaps),
        "sd": sd,
    }


def verdict(points: list[dict]) -> str:
    """C4 over the judged budgets (from JUDGED_FROM to the largest): does the gap close on every seed?"""
    judged = [p for p in points if p["budget"] >= JUDGED_FROM]
    first, last = judged[0]["gap"], judged[-1]["gap"]
    closes = [b < a for a, b in zip(first, last)]
    return (
        "PASS"
        if all(closes)
        else "FAIL"
        if not any(closes)
        else "UNCERTAIN (seeds on both sides: not supported)"
    )


def table(points: list[dict], c4: str, params: dict) -> str:
    rows = [
        "| budget | tokens | tokens / parameter (total, non-embedding) | DDP 4x loss per seed | DiLoCo loss per seed | gap per seed | gap mean ± sd |"
    ]
    rows.append("|---|---|---|---|---|---|---|")
    for p in points:
        loss = {m: ", ".join(f"{r['final_eval_loss']:.4f}" for r in p["runs"][m]) for m in METHODS}
        per = ", ".join(f"{g:+.2%}" for g in p["gap"])
        rows.append(
            f"| {p['budget']:g}x | {p['tokens']:,} | {p['tokens'] / params['total']:.1f}, {p['tokens'] / params['non_embedding']:.1f} | {loss['ddp']} | {loss['diloco']} "
            f"| {per} | {p['mean']:+.2%} ± {p['sd']:.2%} |"
        )
    largest = points[-1]["budget"]
    reported = ", ".join(f"{p['budget']:g}x" for p in points if p["budget"] < JUDGED_FROM)
    rows.append(f"\nC4 (the gap at {largest:g}x smaller than at {JUDGED_FROM:g}x on every seed): {c4}")
    if reported:
        rows.append(f"({reported}: reported, not judged: one 4x-DDP seed is 0.36 nats off the other there)")
    return "\n".join(rows) + "\n"


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p["tokens"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [100 * p["mean"] for p in points], "o-", label="mean over seeds")
    ax.fill_between(
        x,
        [100 * min(p["gap"]) for p in points],
        [100 * max(p["gap"]) for p in points],
        alpha=0.3,
        label="seed range",
    )
    ax.set(
        xscale="log",
        xlabel="tokens per run (each its own full schedule)",
        ylabel="final loss gap DiLoCo vs 4x DDP (%)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("runs/budget-law"))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "budget-law")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--rejudge", action="store_true", help="the record again from the committed summary.json")
    p.add_argument(
        "--base-steps", type=int, default=STEPS, help="the 1x budget's steps (a smaller one for a smoke test)"
    )
    args = p.parse_args(argv)
    if args.rejudge:
        points = json.loads((args.out / "summary.json").read_text())["points"]
    else:
        for seed in SEEDS:
            for budget in BUDGETS:
                for method, (experiment, _) in METHODS.items():
                    if not args.report_only:
                        run_local(experiment, args.runs, overrides(method, budget, seed, args.base_steps))
        points = [point(args.runs, b, SEEDS, args.base_steps) for b in BUDGETS]
    n = points[0]["runs"]["diloco"][0]["parameters"]  # total and non-embedding
    c4 = verdict(points)
    text = table(points, c4, n)
    record = {
        **records.provenance(records.command_line()),
        "parameters": n,
        "seeds": list(SEEDS),
        "points": points,
        "judged_from": JUDGED_FROM,
        "c4": c4,
    }
    records.write_tuning_record(args.out, record, text)
    plot(points, args.out / "gap_vs_tokens.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The model-size ladder in the scaling-law regime (issue 33): 4x-batch DDP against 4-worker DiLoCo at
three sizes spanning 5x in parameters, each method's inner lr tuned per size, the gap in loss and in
perplexity beside what the DiLoCo scaling-law fit predicts at each size.

    python scripts/ladder_law.py --runs runs/tune-law                 # sweeps, then the finals (skips done runs)
    python scripts/ladder_law.py --runs runs/tune-law --report-only   # results/ladder-law from the runs

Every rung trains in `diloco.experiments.law.REGIME` (1,560 steps = 52 outer rounds at H=30, warmup 100 + cosine, fresh
packed data) with the per-worker batch scaled so each size reads 10-12 tokens per parameter where 2 idle CPU cores allow
it, and 5.8 at the largest rung (9 sequences per worker, for 10.4, would take about 3 of the issue's hours
alone: its sweep and finals are 12 runs of about 12 minutes each; 5 sequences halve that):

| rung | parameters | sequences per worker step | tokens (M-worker runs) | tokens / parameter |
|---|---|---|---|---|
| ladder_0_13m | 133,320 | 2 | 1,597,440 | 12.0 |
| 2m (the family's size) | 262,464 | 4 | 3,194,880 | 12.2 |
| micro | 688,768 | 5 | 3,993,600 | 5.8 (0.52 epochs) |

Per size and method, the sweep runs three inner learning rates at seed 1337 on the tuning half
(`data.eval_subset=tune`); when the best is at an edge of the grid one more point past it is run. The
best lr of each method then runs at every seed on the reported half (`report`). DiLoCo uses the study's
outer optimizer (lr 0.6, Nesterov 0.9) at every size: the study swept it per worker count, not per size.
At the family's size the sweep's runs are scripts/tune_law.py's stage 1 (same names, same folder: not rerun), and
the finals are `make replicate-tiny-law`'s runs (`--family-runs`, one folder per seed) where the family's
config is the ladder's setting (the same lr, the study's outer optimizer); otherwise they run here.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import yaml

from diloco.experiments import law as law_regime
from diloco.experiments import records, sweep
from diloco.experiments.plan import compose_experiment, num_parameters
from diloco.experiments.run import run_local
from diloco.scaling_law import LossGapLaw, from_reference

ROOT = records.ROOT
SIZES = {"ladder_0_13m": 2, "2m": 4, "micro": 5}  # model -> sequences per worker per step
METHODS = {"ddp": "tiny/ddp_mx", "diloco": "tiny/diloco_fp32"}
LRS = law_regime.LRS
WORKERS = 4
FAMILY = {"ddp": "tiny_law/ddp_mx", "diloco": "tiny_law/diloco_fp32"}  # the 2m rung's finals, when the same


def batch(method: str, per_worker: int) -> list[str]:
    if method == "ddp":  # the M workers' batch on 2 ranks
        return [f"train.batch_size={WORKERS * per_worker}", f"train.micro_batch_size={2 * per_worker}"]
    return [f"train.batch_size={per_worker}", f"train.micro_batch_size={per_worker}"]


def setting(method: str, lr: float) -> tuple[str, list[str]]:
    if method == "diloco":
        return law_regime.diloco(lr, *law_regime.STUDY_OUTER)
    return f"lr{lr:g}", [f"optim.lr={lr}"]


def run_name(size: str, method: str, lr: float, seed: int, subset: str) -> str:
    name = law_regime.SWEEP.run_name(METHODS[method], setting(method, lr)[0], seed)
    if size != "2m":
        name = name.replace("law-", f"law-{size}-", 1)
    return name if subset == "tune" else f"{name}-{subset}"


def overrides(size: str, method: str, lr: float, seed: int, subset: str) -> list[str]:
    regime = [o for o in law_regime.REGIME if not o.startswith(("model=", "data.eval_subset="))]
    return [
        *regime,
        f"model={size}",
        f"data.eval_subset={subset}",
        *batch(method, SIZES[size]),
        *setting(method, lr)[1],
        f"run_name={run_name(size, method, lr, seed, subset)}",
        f"seed={seed}",
    ]


def read(runs: Path, name: str) -> dict | None:
    return sweep.read_final(runs / name / "summary.json", law_regime.STEPS)


def ensure(runs: Path, size: str, method: str, lr: float, seed: int, subset: str, dry: bool) -> dict | None:
    if not dry:
        run_local(METHODS[method], runs, overrides(size, method, lr, seed, subset))
    return read(runs, run_name(size, method, lr, seed, subset))


def family_final(family_runs: Path | None, method: str, lr: float, seed: int) -> dict | None:
    """The family's run of `method` at `seed` when it is the ladder's 2m final (same lr and outer
    optimizer: tests/scripts/test_law_scripts.py checks the rest of the config is the same), else None."""
    if family_runs is None:
        return None
    cfg = compose_experiment(FAMILY[method], [f"seed={seed}"])
    if cfg.optim.lr != lr:
        return None
    outer = (cfg.distributed.get("outer_lr"), cfg.distributed.get("outer_momentum"))
    if method == "diloco" and outer != law_regime.STUDY_OUTER:
        return None
    return read(family_runs / f"s{seed}", cfg.run_name)


def final(runs: Path, size: str, method: str, lr: float, seed: int, dry: bool, family_runs: Path | None):
    """A rung's final run on the reported half: the family's own at its size when it is the same run."""
    if size == "2m" and (got := family_final(family_runs, method, lr, seed)) is not None:
        return got
    return ensure(runs, size, method, lr, seed, "report", dry)


def lr_sweep(runs: Path, size: str, method: str, seed: int, dry: bool) -> dict:
    """lr -> the tuning half's final loss; extended one point past an edge that wins."""
    lrs = list(LRS)
    losses = {}
    while True:
        for lr in lrs:
            if lr not in losses:
                got = ensure(runs, size, method, lr, seed, "tune", dry)
                losses[lr] = None if got is None else got["final_eval_loss"]
        done = {lr: x for lr, x in losses.items() if x is not None and math.isfinite(x)}
        if len(done) < len(losses):
            return {"losses": losses, "best": None}
        best = min(done, key=done.get)
        edge = sweep.past_the_edge(best, lrs)
        if edge is None or len(lrs) > len(LRS):  # at most one extension
            return {"losses": losses, "best": best}
        lrs.append(edge)


def regime(size: str) -> dict:
    """A rung's data regime: the tokens each method's run reads, per parameter and in epochs of the sample."""
    cfg = compose_experiment(METHODS["ddp"], overrides(size, "ddp", LRS[0], 0, "tune"))
    params = num_parameters(cfg.model)
    tokens = cfg.train.max_steps * cfg.train.batch_size * cfg.data.seq_len  # the M workers' tokens
    unique = sweep.unique_tokens_of(size)
    diloco = compose_experiment(METHODS["diloco"], overrides(size, "diloco", LRS[0], 0, "tune"))
    rounds = diloco.train.max_steps // diloco.distributed.inner_steps
    return {
        "parameters": params,
        "tokens": tokens,
        "tokens_per_parameter": tokens / params,
        "epochs": tokens / unique,
        "unique_train_tokens": unique,
        "outer_rounds": rounds,
    }


def rung(runs: Path, size: str, seeds: list[int], law, dry: bool, family_runs: Path | None = None) -> dict:
    data = regime(size)
    params = data["parameters"]
    out = {"size": size, "parameters": params, "regime": data, "sweeps": {}, "finals": {}}
    for method in METHODS:
        out["sweeps"][method] = lr_sweep(runs, size, method, seeds[0], dry)
        best = out["sweeps"][method]["best"]
        out["finals"][method] = [
            None if best is None else final(runs, size, method, best, s, dry, family_runs) for s in seeds
        ]
    pred = law.predict(params)
    out["prediction"] = {"gap": pred.gap, "low": pred.low, "high": pred.high, "text": pred.describe()}
    pairs = list(zip(out["finals"]["diloco"], out["finals"]["ddp"]))
    if all(a and b for a, b in pairs):
        loss = [a["final_eval_loss"] / b["final_eval_loss"] - 1 for a, b in pairs]
        ppl = [a["final_eval_perplexity"] / b["final_eval_perplexity"] - 1 for a, b in pairs]
        out["loss_gap"] = {"per_seed": loss, "mean": sum(loss) / len(loss), "spread": max(loss) - min(loss)}
        out["ppl_gap"] = {"per_seed": ppl, "mean": sum(ppl) / len(ppl), "spread": max(ppl) - min(ppl)}
    return out


def slope_of(law: LossGapLaw) -> dict:
    """A fitted line's slope in log(gap) per log(N), with its 95% confidence interval."""
    low, high = law.slope_interval()
    return {"slope": law.slope, "low": low, "high": high}


def trend(rungs: list[dict], law: LossGapLaw) -> dict | None:
    """Whether the measured gap shrinks with size: the slope of log(gap) against log(N) fitted to every
    seed's point of every finished rung (the same least squares as the study's law), beside the law's."""
    points = [(r["parameters"], 100 * g) for r in rungs if "loss_gap" in r for g in r["loss_gap"]["per_seed"]]
    sizes = {n for n, _ in points}
    if len(sizes) < 2 or len(points) < 3 or min(g for _, g in points) <= 0:
        return None
    ours = LossGapLaw.fit([n for n, _ in points], [g for _, g in points], WORKERS)
    return {"measured": slope_of(ours), "law": slope_of(law), "points": len(points)}


def trend_line(t: dict | None) -> str:
    if t is None:
        return ""
    m, w = t["measured"], t["law"]
    return (
        f"\nSlope of log(loss gap) on log(parameters), 95% interval: measured {m['slope']:+.3f} "
        f"[{m['low']:+.3f}, {m['high']:+.3f}] ({t['points']} points: every seed of every rung); the law's "
        f"{w['slope']:+.3f} [{w['low']:+.3f}, {w['high']:+.3f}] (Table 4, M={WORKERS}).\n"
    )


def table(rungs: list[dict]) -> str:
    lines = [
        "| rung | parameters | tokens / parameter (epochs) | best lr (DDP 4x, DiLoCo) | loss gap per seed "
        "| loss gap mean ± spread | the law's prediction [95%] | ppl gap mean ± spread |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rungs:
        lrs = ", ".join(f"{r['sweeps'][m]['best']}" for m in METHODS)
        p = r["prediction"]
        law = f"{p['gap']:+.1%} [{p['low']:+.1%}, {p['high']:+.1%}]"
        data = f"{r['regime']['tokens_per_parameter']:.1f} ({r['regime']['epochs']:.2f})"
        head = f"| {r['size']} | {r['parameters']:,} | {data} | {lrs}"
        if "loss_gap" not in r:
            lines.append(f"{head} | (not run) | | {law} | |")
            continue
        g, q = r["loss_gap"], r["ppl_gap"]
        per = ", ".join(f"{x:+.2%}" for x in g["per_seed"])
        lines.append(
            f"{head} | {per} | {g['mean']:+.2%} ± {g['spread']:.2%} "
            f"| {law} | {q['mean']:+.1%} ± {q['spread']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def plot(rungs: list[dict], law, reference: dict, out: Path) -> None:
    """The measured loss and perplexity gaps per size (mean, seed range) beside the study's Table 4 points
    for M=4 and its fitted line with the 95% prediction band, extended down to these sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = reference["scaling_law"]
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    study_n = [float(n) for n in table["params"]]
    study_gap = [float(g) for g in table["loss_gap_pct"][WORKERS]]
    ax.scatter(study_n, study_gap, c="k", s=14, label=f"Charles et al. 2025, Table 4 (M={WORKERS}, loss)")
    grid = [10 ** (5 + i * 0.05) for i in range(96)]  # 100k to 2.8B parameters
    preds = [law.predict(n) for n in grid]
    ax.plot(grid, [100 * p.gap for p in preds], c="grey", lw=1, label="its log-log fit")
    ax.fill_between(
        grid, [100 * p.low for p in preds], [100 * p.high for p in preds], color="grey", alpha=0.2
    )
    for key, marker, name in (("loss_gap", "o", "gap in loss"), ("ppl_gap", "s", "gap in perplexity")):
        done = [r for r in rungs if key in r]
        if not done:
            continue
        ys = [100 * r[key]["mean"] for r in done]
        lo = [y - 100 * min(r[key]["per_seed"]) for y, r in zip(ys, done)]
        hi = [100 * max(r[key]["per_seed"]) - y for y, r in zip(ys, done)]
        xs = [r["parameters"] for r in done]
        ax.errorbar(
            xs, ys, yerr=[lo, hi], marker=marker, capsize=4, ls="-", label=f"ours, {name} (seed range)"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("DiLoCo vs 4x-batch DDP, final held-out gap (%)")
    ax.set_title("DiLoCo's gap against model size (H=30, M=4, 5.8-12 tokens/parameter)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("runs/tune-law"))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "ladder-law")
    p.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--seeds", nargs="*", type=int, default=[1337, 1])
    p.add_argument(
        "--family-runs",
        type=Path,
        default=Path("runs/tiny-law"),
        help="make replicate-tiny-law's runs (s<seed>/ folders): the 2m rung's finals",
    )
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    reference = yaml.safe_load((ROOT / "results" / "reference.yaml").read_text())
    law = from_reference(reference, WORKERS)
    rungs = [
        rung(args.runs, size, args.seeds, law, args.report_only, args.family_runs) for size in args.sizes
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        **records.provenance(f"python scripts/ladder_law.py --runs {args.runs}"),
        "regime_overrides": list(law_regime.REGIME),
        "seeds": args.seeds,
        "rungs": rungs,
        "trend": trend(rungs, law),
    }
    text = table(rungs) + trend_line(record["trend"])
    records.write_json(args.out / "summary.json", record)
    (args.out / "table.md").write_text(text)
    plot(rungs, law, reference, args.out / "ladder.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

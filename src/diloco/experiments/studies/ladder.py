"""Model-size ladder (issue 15): Mx DDP against DiLoCo at equal tokens, at three model sizes, on fresh data.

Each rung runs the tiny family's `tiny/ddp_mx` (one replica, 4x the batch) and `tiny/diloco_fp32` (4
workers with the family's tuned outer settings: H=25, outer lr 0.5 / Nesterov 0.8) with `model=<size>`
and each seed, on the family's data regime: packed documents (the 400 steps read about a fifth of the
sample's training tokens once) reported on the eval split's `report` half. Same data, same tokens, same
inner optimizer settings for both; the settings were tuned at `micro` (results/tiny-tuning) and are used
at every rung (stated in the record).

    python scripts/ladder.py --runs runs/ladder                 # every rung and seed (skips complete runs)
    python scripts/ladder.py --runs runs/ladder --report-only   # results/ladder from the runs' summaries
    python scripts/ladder.py --runs runs/ladder-h10 --out results/ladder-h10 \
        --override data.eval_subset=all --diloco-override distributed.inner_steps=10   # the first, untuned one

The record (results/ladder: summary.json, table.md, ladder.png) gives each rung's parameters, both
methods' final held-out perplexity per seed, and the relative gap DiLoCo / DDP - 1 as mean and spread
(max - min over seeds). Runs made from a dirty tree are refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diloco.experiments import records, sweep
from diloco.experiments.plan import compose_experiment, num_parameters
from diloco.experiments.run import run_local

ROOT = records.ROOT
SIZES = ["micro", "ladder_2_2m", "ladder_3_7m"]
METHODS = {"ddp": "tiny/ddp_mx", "diloco": "tiny/diloco_fp32"}
OVERRIDES = ["data.packing=true"]


def overrides(size: str, seed: int, extra: list[str] = ()) -> list[str]:
    return [f"model={size}", f"seed={seed}", *OVERRIDES, *extra]


def run_dir(runs: Path, size: str, seed: int) -> Path:
    return runs / f"{size}-s{seed}"


def read_run(runs: Path, size: str, seed: int, method: str, extra: dict | None = None) -> dict:
    cfg = compose_experiment(METHODS[method], overrides(size, seed, (extra or {}).get(method, [])))
    path = run_dir(runs, size, seed) / cfg.run_name / "summary.json"
    s = records.clean_summary(path, cfg.train.max_steps)
    keys = ("final_eval_perplexity", "tokens_seen", "wall_seconds", "git_commit", "step")
    return {"path": str(path), **{k: s[k] for k in keys}}


def rung(runs: Path, size: str, seeds: list[int], extra: dict | None = None) -> dict:
    """extra: method -> its overrides beyond the ladder's."""
    cfg = compose_experiment(METHODS["ddp"], overrides(size, seeds[0], (extra or {}).get("ddp", [])))
    runs_ = {m: [read_run(runs, size, s, m, extra) for s in seeds] for m in METHODS}
    gaps = [
        d["final_eval_perplexity"] / p["final_eval_perplexity"] - 1
        for d, p in zip(runs_["diloco"], runs_["ddp"])
    ]
    mean = {m: sum(r["final_eval_perplexity"] for r in rs) / len(rs) for m, rs in runs_.items()}
    return {
        "size": size,
        "parameters": num_parameters(cfg.model),
        "runs": runs_,
        "gap_per_seed": gaps,
        "gap_of_means": mean["diloco"] / mean["ddp"] - 1,
        "gap_mean": sum(gaps) / len(gaps),
        "gap_spread": max(gaps) - min(gaps),
        "tokens_seen": runs_["ddp"][0]["tokens_seen"],
    }


def table(rungs: list[dict], seeds: list[int]) -> str:
    head = "| parameters | DDP Mx ppl (seeds) | DiLoCo ppl (seeds) | gap per seed | gap mean ± spread |"
    lines = [head, "|---|---|---|---|---|"]
    for r in rungs:
        ppl = {m: ", ".join(f"{x['final_eval_perplexity']:.2f}" for x in r["runs"][m]) for m in METHODS}
        per_seed = ", ".join(f"{g:+.1%}" for g in r["gap_per_seed"])
        lines.append(
            f"| {r['parameters']:,} ({r['size']}) | {ppl['ddp']} | {ppl['diloco']} | {per_seed} "
            f"| {r['gap_mean']:+.1%} ± {r['gap_spread']:.1%} |"
        )
    return "\n".join(lines) + f"\n\nSeeds: {', '.join(map(str, seeds))}; spread = max - min over seeds.\n"


def diloco_label(extra: dict) -> str:
    d = compose_experiment(METHODS["diloco"], overrides(SIZES[0], 0, extra.get("diloco", []))).distributed
    return f"DiLoCo (4 workers, H={d.inner_steps}, {d.outer_lr:g} / {d.outer_momentum:g}) vs 4x-batch DDP"


# Charles et al. 2025 (arXiv 2503.09799), models of tens of millions to billions of parameters, every
# setting tuned per size: DiLoCo's loss relative to data-parallel training improves with model size.
STUDY = "Charles et al. 2025 (tuned per size, far larger models):\nDiLoCo's gap to data-parallel shrinks as models grow"


def plot(rungs: list[dict], out: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["parameters"] for r in rungs]
    ax.errorbar(
        xs,
        [100 * r["gap_mean"] for r in rungs],
        yerr=[
            [100 * (r["gap_mean"] - min(r["gap_per_seed"])) for r in rungs],
            [100 * (max(r["gap_per_seed"]) - r["gap_mean"]) for r in rungs],
        ],
        marker="o",
        capsize=4,
        label=label + ", mean and seed range",
    )
    for r in rungs:
        ax.scatter(
            [r["parameters"]] * len(r["gap_per_seed"]), [100 * g for g in r["gap_per_seed"]], s=10, c="k"
        )
    ax.axhline(0, color="grey", lw=0.8)
    ax.text(0.98, 0.04, STUDY, transform=ax.transAxes, fontsize=7, color="dimgrey", va="bottom", ha="right")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("final held-out perplexity gap (%)")
    ax.set_title("Model-size ladder at equal tokens (400 steps, fresh data)")
    top = max(100 * g for r in rungs for g in r["gap_per_seed"])
    ax.set_ylim(min(-5, ax.get_ylim()[0]), max(5, top * 1.35))  # room for the legend above the points
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("runs/ladder"))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "ladder")
    p.add_argument("--sizes", nargs="*", default=SIZES)
    p.add_argument("--seeds", nargs="*", type=int, default=[1337, 1])
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--override", action="append", default=[], help="a hydra override for every run")
    p.add_argument("--diloco-override", action="append", default=[], help="one for the DiLoCo runs only")
    args = p.parse_args(argv)
    extra = {"ddp": args.override, "diloco": [*args.override, *args.diloco_override]}
    if not args.report_only:
        for size in args.sizes:
            for seed in args.seeds:
                for m, experiment in METHODS.items():
                    run_local(experiment, run_dir(args.runs, size, seed), overrides(size, seed, extra[m]))
    rungs = [rung(args.runs, size, args.seeds, extra) for size in args.sizes]
    unique = sweep.unique_tokens_of(args.sizes[0])
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        **records.provenance("python scripts/ladder.py --runs " + str(args.runs)),
        "overrides": {m: [*OVERRIDES, *x] for m, x in extra.items()},
        "unique_train_tokens": unique,
        "epochs": rungs[0]["tokens_seen"] / unique,
        "rungs": rungs,
    }
    records.write_json(args.out / "summary.json", record)
    subset = compose_experiment(METHODS["ddp"], overrides(args.sizes[0], 0, extra["ddp"])).data.eval_subset
    regime = (
        f"Data regime: packing, {unique:,} unique training tokens, {rungs[0]['tokens_seen']:,} tokens "
        f"trained per run ({record['epochs']:.2f} epochs); evaluated on eval_subset={subset}.\n\n"
    )
    (args.out / "table.md").write_text(regime + table(rungs, args.seeds))
    plot(rungs, args.out / "ladder.png", diloco_label(extra))
    print(regime + table(rungs, args.seeds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

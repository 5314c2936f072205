"""`make ladder-controlled` (issue 42): DiLoCo's gap to 4x-batch DDP against model size, with the size
the only thing that changes between rungs.

    python scripts/ladder_controlled.py --runs runs/ladder-controlled                  # every rung
    python scripts/ladder_controlled.py --runs runs/ladder-controlled --rungs 2m       # one batch
    python scripts/ladder_controlled.py --runs runs/ladder-controlled --report-only    # the record

The grid is `configs/studies/ladder_controlled.yaml`. Every rung trains at the same tokens per
non-embedding parameter (steps = tokens / the global batch, rounded to whole outer rounds) with the
same global batch in tokens; warmup is the same fraction of each schedule. 4x DDP is one process with
the whole batch (`tiny_law/ddp_mx` on one rank); DiLoCo is `tiny_law/diloco_fp32` with the study's
outer optimizer. Per rung and method the inner lr is swept at the tuning seeds on the tuning half
(`data.eval_subset=tune`); when the best mean sits on an edge of the grid the grid grows past it. The
best lr of each method then runs at the report seeds, which took no part in tuning, on the `report`
half. The gap's slope in log(gap) per log(N) is fitted to the rung means (not to seeds as sizes), for
the non-embedding and the total count, with its 95% interval.

Runs are skipped when complete; `--restore` writes the committed record's runs back as summaries so a
later session goes on where the record stopped. Writes results/ladder-controlled/{summary.json,
table.md, ladder.png}.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from diloco.experiments import records, sweep
from diloco.experiments.plan import compose_experiment
from diloco.experiments.run import run_local
from diloco.scaling_law import LossGapLaw, from_reference

ROOT = records.ROOT
GRID = ROOT / "configs" / "studies" / "ladder_controlled.yaml"
METHODS = {"ddp": "tiny_law/ddp_mx", "diloco": "tiny_law/diloco_fp32"}
COUNTS = ("non_embedding", "total")
STUDY_TOKENIZER_MODEL = "2m"  # any rung: the data config, not the model, decides the tokens
KEYS = (*sweep.FINAL_KEYS, "parameters")


@dataclass(frozen=True)
class Study:
    """The grid of configs/studies/ladder_controlled.yaml, and the runs it names."""

    rungs: tuple[str, ...]
    tokens_per_parameter: float
    global_batch: int
    workers: int
    inner_steps: int
    warmup_fraction: float
    outer: tuple[float, float]
    lrs: tuple[float, ...]
    max_extensions: int
    tune_seeds: tuple[int, ...]
    report_seeds: tuple[int, ...]

    @classmethod
    def load(cls, path: Path = GRID) -> Study:
        d = yaml.safe_load(path.read_text())
        lists = ("rungs", "lrs", "tune_seeds", "report_seeds")
        plain = {k: v for k, v in d.items() if k not in (*lists, "outer")}
        outer = (float(d["outer"]["lr"]), float(d["outer"]["momentum"]))
        return cls(**plain, outer=outer, **{k: tuple(d[k]) for k in lists})

    def steps(self, rung: str) -> int:
        """The rung's steps: its token budget over the global batch, in whole outer rounds."""
        tokens = self.tokens_per_parameter * non_embedding(rung)
        rounds = max(1, round(tokens / (self.global_batch * seq_len()) / self.inner_steps))
        return rounds * self.inner_steps

    def run_name(self, rung: str, method: str, lr: float, seed: int, subset: str) -> str:
        return f"ladder-ctl-{rung}-{method}-lr{lr:g}-s{seed}-{subset}"

    def overrides(self, rung: str, method: str, lr: float, seed: int, subset: str) -> list[str]:
        steps = self.steps(rung)
        return [
            f"model={rung}",
            "data.packing=true",
            f"data.eval_subset={subset}",
            f"train.max_steps={steps}",
            f"optim.total_steps={steps}",
            f"optim.warmup_steps={max(1, round(self.warmup_fraction * steps))}",
            f"optim.lr={lr}",
            *self.batch(method),
            "train.eval_every=0",
            "train.log_every=30",
            "launch.reference=null",
            "launch.family=ladder-controlled",
            f"run_name={self.run_name(rung, method, lr, seed, subset)}",
            f"seed={seed}",
        ]

    def batch(self, method: str) -> list[str]:
        if method == "ddp":  # one process, the M workers' whole batch in one micro-batch
            b = self.global_batch
            return ["launch.gpus_per_node=1", f"train.batch_size={b}", f"train.micro_batch_size={b}"]
        per_worker = self.global_batch // self.workers
        outer_lr, momentum = self.outer
        return [
            f"train.batch_size={per_worker}",
            f"train.micro_batch_size={per_worker}",
            f"launch.gpus_per_node={self.workers}",
            f"distributed.inner_steps={self.inner_steps}",
            f"distributed.outer_lr={outer_lr}",
            f"distributed.outer_momentum={momentum}",
        ]


@functools.cache
def seq_len() -> int:
    return int(compose_experiment(METHODS["ddp"], []).data.seq_len)


def non_embedding(rung: str) -> int:
    return parameters(rung)["non_embedding"]


def parameters(rung: str) -> dict:
    return dict(_parameters(rung))


@functools.cache
def _parameters(rung: str) -> dict:
    import torch

    from diloco.model import build_model, count_parameters

    cfg = compose_experiment(METHODS["ddp"], [f"model={rung}"])
    with torch.device("meta"):
        return count_parameters(build_model(cfg.model, seed=0))


@functools.cache
def unique_tokens() -> int:
    """The sample's unique training tokens, packed (the same for every rung: one tokenizer)."""
    return sweep.unique_tokens_of(STUDY_TOKENIZER_MODEL)


def read(study: Study, runs: Path, rung: str, method: str, lr: float, seed: int, subset: str):
    name = study.run_name(rung, method, lr, seed, subset)
    return sweep.read_final(runs / name / "summary.json", study.steps(rung), KEYS)


def ensure(study: Study, runs: Path, key: tuple, dry: bool) -> dict | None:
    """The run `key` = (rung, method, lr, seed, subset): run unless `dry` (skipped when complete), read."""
    if not dry:
        run_local(METHODS[key[1]], runs, study.overrides(*key))
    return read(study, runs, *key)


def lr_sweep(study: Study, runs: Path, rung: str, method: str, dry: bool) -> dict:
    """lr -> the tuning seeds' runs on the tuning half, the grid grown past an edge that wins; `best` is
    the lr of the lowest mean loss, None while a run is missing or diverged."""
    lrs, got = list(study.lrs), {}
    for _ in range(study.max_extensions + 1):
        for lr in lrs:
            if lr not in got:
                got[lr] = [ensure(study, runs, (rung, method, lr, s, "tune"), dry) for s in study.tune_seeds]
        best = best_lr(got)
        edge = None if best is None else sweep.past_the_edge(best, sorted(lrs))
        if edge is None:
            break
        lrs.append(edge)
    ordered = sorted(got.items())
    losses = {
        str(lr): [None if g is None else g["final_eval_loss"] for g in runs_of] for lr, runs_of in ordered
    }
    return {"losses": losses, "runs": {str(lr): runs_of for lr, runs_of in ordered}, "best": best}


def best_lr(got: dict) -> float | None:
    """The lr of the lowest mean final loss, None while a run is missing or diverged."""
    if any(g is None for runs_of in got.values() for g in runs_of):
        return None
    means = {lr: statistics.fmean(g["final_eval_loss"] for g in runs_of) for lr, runs_of in got.items()}
    if not all(math.isfinite(m) for m in means.values()):
        return None
    return min(means, key=means.get)


def spread(xs: list[float]) -> dict:
    """Mean and sample standard deviation over seeds."""
    return {"per_seed": xs, "mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0}


def regime(study: Study, rung: str) -> dict:
    steps = study.steps(rung)
    tokens = steps * study.global_batch * seq_len()
    counts = parameters(rung)
    unique = unique_tokens()
    return {
        "parameters": counts,
        "steps": steps,
        "outer_rounds": steps // study.inner_steps,
        "global_batch_tokens": study.global_batch * seq_len(),
        "tokens": tokens,
        "tokens_per_parameter": {c: tokens / counts[c] for c in COUNTS},
        "epochs": tokens / unique,
        "unique_train_tokens": unique,
    }


def rung_record(study: Study, runs: Path, rung: str, dry: bool) -> dict:
    out = {"rung": rung, "regime": regime(study, rung), "sweeps": {}, "finals": {}}
    for method in METHODS:
        out["sweeps"][method] = sweep_of = lr_sweep(study, runs, rung, method, dry)
        best = sweep_of["best"]
        out["finals"][method] = [
            None if best is None else ensure(study, runs, (rung, method, best, s, "report"), dry)
            for s in study.report_seeds
        ]
    pairs = list(zip(out["finals"]["diloco"], out["finals"]["ddp"]))
    if pairs and all(a and b for a, b in pairs):
        out["loss_gap"] = spread([a["final_eval_loss"] / b["final_eval_loss"] - 1 for a, b in pairs])
        out["ppl_gap"] = spread(
            [a["final_eval_perplexity"] / b["final_eval_perplexity"] - 1 for a, b in pairs]
        )
    return out


def trend(rungs: list[dict], law: LossGapLaw) -> dict | None:
    """The slope of log(mean gap) on log(N) over the finished rungs, per parameter count, beside the
    law's; None until three rungs have a positive mean gap (a line through 2 points has no interval)."""
    done = [r for r in rungs if "loss_gap" in r and r["loss_gap"]["mean"] > 0]
    if len(done) < 3:
        return None
    out = {"rungs": len(done), "law": slope_of(law)}
    for count in COUNTS:
        xs = [r["regime"]["parameters"][count] for r in done]
        fit = LossGapLaw.fit(xs, [100 * r["loss_gap"]["mean"] for r in done], law.workers)
        out[count] = slope_of(fit)
    return out


def slope_of(law: LossGapLaw) -> dict:
    low, high = law.slope_interval()
    return {"slope": law.slope, "low": low, "high": high}


def predictions(rung: dict, law: LossGapLaw) -> dict:
    """The law's gap at the rung's size, read in each parameter count."""
    out = {}
    for count in COUNTS:
        p = law.predict(rung["regime"]["parameters"][count])
        out[count] = {"gap": p.gap, "low": p.low, "high": p.high}
    return out


def table(study: Study, rungs: list[dict]) -> str:
    head = (
        "| rung | parameters: non-embedding (total) | steps (rounds) | tokens / parameter: non-emb. (total) "
        "| epochs | best lr (DDP 4x, DiLoCo) | loss gap per report seed | loss gap mean ± sd "
        "| the law [95%] at non-emb. N | at total N | ppl gap mean ± sd |"
    )
    lines = [head, "|---" * 11 + "|"]
    lines += [table_line(r) for r in rungs]
    return "\n".join(lines) + "\n"


def table_line(r: dict) -> str:
    g, n = r["regime"], r["regime"]["parameters"]
    tpp = g["tokens_per_parameter"]
    lrs = ", ".join(str(r["sweeps"][m]["best"]) for m in METHODS)
    law = [f"{p['gap']:+.1%} [{p['low']:+.1%}, {p['high']:+.1%}]" for p in r["law"].values()]
    cells = [
        r["rung"],
        f"{n['non_embedding']:,} ({n['total']:,})",
        f"{g['steps']:,} ({g['outer_rounds']})",
        f"{tpp['non_embedding']:.1f} ({tpp['total']:.1f})",
        f"{g['epochs']:.2f}",
        lrs,
    ]
    if "loss_gap" not in r:
        return "| " + " | ".join([*cells, "(not run)", "", *law, ""]) + " |"
    loss, ppl = r["loss_gap"], r["ppl_gap"]
    per = ", ".join(f"{x:+.2%}" for x in loss["per_seed"])
    done = [per, f"{loss['mean']:+.2%} ± {loss['sd']:.2%}", *law, f"{ppl['mean']:+.1%} ± {ppl['sd']:.1%}"]
    return "| " + " | ".join([*cells, *done]) + " |"


def trend_text(t: dict | None) -> str:
    if t is None:
        return "\nSlope: not fitted (it needs three finished rungs with a positive mean gap).\n"
    lines = ["\nSlope of log(mean loss gap) on log(N) over the rung means, 95% interval:"]
    for count in COUNTS:
        s = t[count]
        lines.append(f"- {count.replace('_', '-')} N: {s['slope']:+.3f} [{s['low']:+.3f}, {s['high']:+.3f}]")
    w = t["law"]
    lines.append(f"- the law's (Table 4, M=4): {w['slope']:+.3f} [{w['low']:+.3f}, {w['high']:+.3f}]")
    return "\n".join(lines) + "\n"


def plot(rungs: list[dict], law: LossGapLaw, out: Path) -> None:
    """The mean loss gap per rung (± sd over the report seeds) against non-embedding parameters, with
    the law's line and its 95% prediction band extended down to these sizes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    grid = [10 ** (4 + i * 0.05) for i in range(116)]  # 10k to 6B parameters
    preds = [law.predict(n) for n in grid]
    ax.plot(
        grid, [100 * p.gap for p in preds], c="grey", lw=1, label="Charles et al. 2025, Table 4 fit (M=4)"
    )
    ax.fill_between(
        grid, [100 * p.low for p in preds], [100 * p.high for p in preds], color="grey", alpha=0.2
    )
    done = [r for r in rungs if "loss_gap" in r]
    if done:
        xs = [r["regime"]["parameters"]["non_embedding"] for r in done]
        ys = [100 * r["loss_gap"]["mean"] for r in done]
        sds = [100 * r["loss_gap"]["sd"] for r in done]
        ax.errorbar(xs, ys, yerr=sds, marker="o", capsize=4, label="ours: mean over 3 report seeds ± sd")
    ax.set(xscale="log", yscale="log", xlabel="non-embedding parameters")
    ax.set_ylabel("DiLoCo vs 4x-batch DDP, final held-out loss gap (%)")
    ax.set_title("Controlled ladder: 20 tokens per non-embedding parameter, 2,048-token batch", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def restore(study: Study, runs: Path, record: Path) -> int:
    """Summaries in `runs` for the committed record's runs whose folders are missing (run folders are
    not committed), so the study goes on where the record stopped. Returns how many were written."""
    if not record.exists():
        return 0
    written = 0
    for r in json.loads(record.read_text())["rungs"]:
        for key, run in kept_runs(study, r):
            folder = runs / study.run_name(*key)
            if run is None or (folder / "summary.json").exists():
                continue
            kept = {**run, "step": study.steps(key[0]), "status": "completed", "restored_from": str(record)}
            records.write_json(folder / "summary.json", kept)
            written += 1
    return written


def kept_runs(study: Study, r: dict):
    """(key, run) for every run a rung's record kept: the sweeps' and the finals'."""
    for method, s in r["sweeps"].items():
        for lr, runs_of in s["runs"].items():
            for seed, run in zip(study.tune_seeds, runs_of):
                yield (r["rung"], method, float(lr), seed, "tune"), run
    for method, finals in r["finals"].items():
        best = r["sweeps"][method]["best"]
        if best is None:  # not tuned yet: no finals
            continue
        for seed, run in zip(study.report_seeds, finals):
            yield (r["rung"], method, best, seed, "report"), run


def main(argv: list[str] | None = None) -> int:
    study = Study.load()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("runs/ladder-controlled"))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "ladder-controlled")
    p.add_argument(
        "--rungs", nargs="*", default=list(study.rungs), choices=list(study.rungs), help="the rungs to run"
    )
    p.add_argument("--report-only", action="store_true", help="write the record from the runs there are")
    p.add_argument("--no-restore", action="store_true", help="do not write the committed record's runs back")
    args = p.parse_args(argv)
    if not args.no_restore:
        print(f"restored {restore(study, args.runs, args.out / 'summary.json')} runs from the record")
    for rung in args.rungs:
        if not args.report_only:
            rung_record(study, args.runs, rung, dry=False)
    write_record(study, args.runs, args.out)
    return 0


def write_record(study: Study, runs: Path, out: Path) -> None:
    """The record of every rung from the runs in `runs` (a rung not run yet says so)."""
    reference = yaml.safe_load((ROOT / "results" / "reference.yaml").read_text())
    law = from_reference(reference, study.workers)
    rungs = [rung_record(study, runs, rung, dry=True) for rung in study.rungs]
    for r in rungs:
        r["law"] = predictions(r, law)
    record = {
        **records.provenance(records.command_line()),
        "grid": yaml.safe_load(GRID.read_text()),
        "rungs": rungs,
        "trend": trend(rungs, law),
    }
    records.write_tuning_record(out, record, table(study, rungs) + trend_text(record["trend"]))
    plot(rungs, law, out / "ladder.png")


if __name__ == "__main__":
    raise SystemExit(main())

"""`make report`: a family's runs as a Markdown report with PNG plots, plus a W&B report when online.

    python scripts/report.py --family tiny [--runs runs] [--out results/tiny-<date>] [--force]
    python scripts/report.py --family tiny --runs runs/tiny   # runs/tiny/s1337, runs/tiny/s1: one folder per seed

Writes <out>/report.md (the claim table of `make check`, a table of runs, the plots), <out>/*.png:
eval perplexity vs step, vs tokens and vs bytes communicated, the FP16 cast error per outer round,
and compute utilization (a plot with no data, e.g. bytes when no run communicates, is left out), and
<out>/summaries.json, the record: each run's summary and the metric records its verdicts come from,
so `make check RUNS=<out>` judges it again with the same verdicts. The default <out> is a new dated
folder, results/<family>-<UTC date>; a folder that already holds a report is never replaced unless
--force is given (committed records, e.g. results/tiny, stay as they were made). With W&B online (and
`wandb-workspaces` installed) it also builds a W&B report of the family's group and prints its URL.
With a folder per seed, the claim table judges every seed (mean and spread, `make check`), the runs
table lists each seed's runs, the plots show the first seed's, and the record keeps one summaries.json
per seed (<out>/<seed folder>/). The report states the data regime: unique training tokens, tokens
trained, epochs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import matplotlib
import yaml
from omegaconf import OmegaConf

from diloco.experiments.plan import unique_train_tokens

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from diloco.metrics import wandb_mode  # noqa: E402
from diloco.replication import (  # noqa: E402
    RECORD,
    RECORD_REFERENCE,
    REFERENCE,
    Run,
    by_reference,
    check,
    judged_records,
    load_runs,
    markdown_table,
    seed_roots,
)


def _label(run: Run) -> str:
    return (run.reference or run.path.name).split("/")[-1]


def _tokens_per_step(run: Run) -> float:
    steps = run.summary.get("step") or 1
    return run.summary.get("tokens_seen", 0) / steps


def _bytes_at(run: Run, step: int) -> float:
    """Cumulative bytes communicated by `step` (from the comm/total_bytes records)."""
    best = 0.0
    for r in run.records:
        if "comm/total_bytes" in r and r["step"] <= step:
            best = r["comm/total_bytes"]
    return best


PLOTS = (  # every file a report may draw
    "eval_vs_step.png",
    "eval_vs_tokens.png",
    "eval_loss_vs_tokens.png",
    "eval_vs_bytes.png",
    "fp16_cast_error.png",
    "compute_utilization.png",
)


def plot_eval(runs: list[Run], out: Path) -> list[str]:
    files = []
    for name, xlabel, xfun, logx in (
        ("eval_vs_step.png", "inner step", lambda r, s: s, False),
        ("eval_vs_tokens.png", "tokens processed (all workers)", lambda r, s: s * _tokens_per_step(r), False),
        ("eval_vs_bytes.png", "bytes communicated per worker", _bytes_at, True),
    ):
        series = []
        for run in runs:
            pts = [(xfun(run, s), p) for s, p in run.evals() if s > 0]
            if logx:
                pts = [(x, p) for x, p in pts if x > 0]
            if pts:
                series.append((run, pts))
        if not series:  # e.g. bytes when no run communicates: no empty plot with made-up axes
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for run, pts in series:
            ax.plot(*zip(*pts), marker=".", label=_label(run))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out perplexity")
        if logx:
            ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files


def plot_loss_bands(runs: list[Run], out: Path) -> str | None:
    """Held-out loss against tokens, one line per experiment: the mean over its seeds, with a band from
    the lowest to the highest seed at every evaluation (the curves C4 is read from)."""
    groups: dict[str, list[dict[float, float]]] = {}
    for run in runs:
        pts = {s * _tokens_per_step(run): math.log(p) for s, p in run.evals() if s > 0}
        if pts:
            groups.setdefault(_label(run), []).append(pts)
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, seeds in groups.items():
        xs = sorted(set.intersection(*(set(p) for p in seeds)))  # evaluations every seed has
        ys = [[p[x] for p in seeds] for x in xs]
        mean = [sum(y) / len(y) for y in ys]
        (line,) = ax.plot(xs, mean, marker=".", label=f"{label} ({len(seeds)} seeds)")
        ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.25)
    ax.set_xlabel("tokens processed (all workers)")
    ax.set_ylabel("held-out loss (mean, band: seed range)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    name = "eval_loss_vs_tokens.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def plot_series(
    runs: list[Run], out: Path, key: str, name: str, ylabel: str, logy: bool = False
) -> str | None:
    series = [(run, [(r["step"], r[key]) for r in run.records if r.get(key) is not None]) for run in runs]
    series = [(run, pts) for run, pts in series if pts]
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for run, pts in series:
        ax.plot(*zip(*pts), marker=".", label=_label(run))
    ax.set_xlabel("inner step")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def runs_table(runs: list[Run]) -> str:
    head = [
        "run",
        "steps",
        "workers",
        "final eval ppl",
        "tokens",
        "bytes/worker",
        "bytes/inner step",
        "compute util.",
        "wall s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        s = r.summary
        bpis = r.bytes_per_inner_step()
        lines.append(
            "| "
            + " | ".join(
                [
                    _label(r),
                    str(s.get("step")),
                    str(s.get("num_workers")),
                    f"{s['final_eval_perplexity']:.2f}" if s.get("final_eval_perplexity") else "-",
                    f"{s.get('tokens_seen', 0):,}",
                    f"{s.get('comm/total_bytes', 0):,.0f}",
                    "-" if bpis is None else f"{bpis:,.0f}",
                    f"{s.get('compute_utilization', 0):.3f}",
                    f"{s.get('wall_seconds', 0):.0f}",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def wandb_report(family: str, runs: list[Run]) -> str:
    if wandb_mode(None) != "online":
        return "W&B is offline here: no W&B report was built (the local report above is complete)."
    try:
        import wandb_workspaces.reports.v2 as wr
    except ImportError:
        return "W&B report skipped: `pip install -e .[report]` installs wandb-workspaces."
    cfg = runs[0].config.get("wandb", {})
    try:
        report = wr.Report(
            project=cfg.get("project", "opendiloco-repro"),
            entity=cfg.get("entity"),
            title=f"OpenDiLoCo reproduction: {family}",
            blocks=[
                wr.PanelGrid(
                    runsets=[
                        wr.Runset(
                            project=cfg.get("project", "opendiloco-repro"),
                            entity=cfg.get("entity"),
                            filters=f"Config('wandb.group') = '{family}'",
                        )
                    ],
                    panels=[
                        wr.LinePlot(x="step", y=["eval/perplexity"]),
                        wr.LinePlot(x="step", y=["Perplexity"]),
                        wr.LinePlot(x="comm/total_bytes", y=["eval/perplexity"]),
                        wr.LinePlot(x="step", y=["comm/cast_rel_error"]),
                    ],
                )
            ],
        )
        report.save()
        return f"W&B report: {report.url}"
    except Exception as e:  # a report is a convenience; never fail the local report over it
        return f"W&B report failed ({type(e).__name__}: {e})"


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def data_regime(runs: list[Run]) -> str:
    """How much of the data the runs read, and how often: unique training tokens, tokens trained, epochs."""
    data = OmegaConf.create(runs[0].config.get("data", {}))
    trained = max(r.summary.get("tokens_seen", 0) for r in runs)
    how = (
        "documents packed into sequences"
        if data.get("packing")
        else (f"one sequence per document, cut at {data.get('seq_len')} tokens")
    )
    try:
        unique = unique_train_tokens(data)
    except Exception as e:  # streamed C4, or files not on this machine
        return f"Data regime: {how}; {trained:,} tokens trained per run; unique tokens not counted here ({type(e).__name__})."
    return (
        f"Data regime: {how}; {unique:,} unique training tokens, {trained:,} tokens trained per run: "
        f"{trained / unique:.2f} epochs; evaluated on the eval split's `{data.get('eval_subset', 'all')}` documents."
    )


def _record(runs: list[Run], window: float) -> str:
    return (
        json.dumps(
            {
                _label(r): {k: v for k, v in r.summary.items() if k != "config"}
                | {"config": r.config, "records": judged_records(r, window)}
                for r in runs
            },
            indent=1,
            default=str,
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", required=True)
    p.add_argument("--runs", type=Path, default=Path("runs"))
    p.add_argument("--out", type=Path, default=None, help="default: results/<family>-<UTC date>")
    p.add_argument("--force", action="store_true", help="replace the report already in --out")
    p.add_argument("--reference", type=Path, default=REFERENCE)
    args = p.parse_args(argv)
    now = dt.datetime.now(dt.timezone.utc)
    out = args.out or Path("results") / f"{args.family}-{now:%Y-%m-%d}"
    if error := clear_old_report(out, args.runs, args.force):
        print(f"error: {error}", file=sys.stderr)
        return 1
    seeds = seed_roots(args.runs)  # runs/ itself, or one folder per seed (runs/s1337, runs/s1)
    by_seed = [family_runs(root, args.family) for root in seeds]
    runs = by_seed[0]
    if not runs:
        print(f"error: no runs of family {args.family!r} under {args.runs}/", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    plots = all_plots(by_seed, out)
    wb = wandb_report(args.family, runs)
    verdicts = check(args.runs, [args.family], args.reference)
    md = markdown(args, now, verdicts, seeds, by_seed, plots) + [wb, ""]
    (out / "report.md").write_text("\n".join(md))
    (out / RECORD_REFERENCE).write_text(args.reference.read_text())  # what `make check` judges it with
    window = yaml.safe_load(args.reference.read_text()).get("train_window", 0.02)
    if len(seeds) == 1:
        (out / RECORD).write_text(_record(runs, window))
    for root, seed_runs in zip(seeds, by_seed) if len(seeds) > 1 else ():  # one record per seed
        (out / root.name).mkdir(exist_ok=True)
        (out / root.name / RECORD).write_text(_record(seed_runs, window))
    print(f"wrote {out / 'report.md'} ({len(plots)} plots)")
    print(wb)
    return 0


def clear_old_report(out: Path, runs: Path, force: bool) -> str | None:
    """Why `out` cannot take the report, or None once it can (with --force, the old one's files removed:
    no plot of the old report left beside the new ones)."""
    if not ((out / "report.md").exists() or (out / RECORD).exists()):
        return None
    if not force:
        return (
            f"{out}/ already holds a report (a record is never replaced silently): "
            "choose another --out, or --force to replace it"
        )
    if out.resolve() == Path(runs).resolve():
        return f"{out}/ is the record being reported: choose another --out"
    for old in [out / "report.md", out / RECORD, *out.glob(f"*/{RECORD}"), *(out / name for name in PLOTS)]:
        old.unlink(missing_ok=True)
    return None


def family_runs(root: Path, family: str) -> list[Run]:
    """The runs of `family` under `root`, by reference name."""
    mine = (r for r in by_reference(load_runs(root)).values() if r.family == family)
    return sorted(mine, key=lambda r: r.reference or "")


def all_plots(by_seed: list[list[Run]], out: Path) -> list[str]:
    """Every plot with data: the first seed's curves, the loss bands over every seed, the per-round series."""
    runs = by_seed[0]
    plots = plot_eval(runs, out)
    if band := plot_loss_bands([r for seed in by_seed for r in seed], out):
        plots.append(band)
    for key, name, ylabel, logy in (
        ("comm/cast_rel_error", "fp16_cast_error.png", "FP16 cast rel. L2 error per round", True),
        ("outer/compute_utilization", "compute_utilization.png", "compute utilization per round", False),
    ):
        if f := plot_series(runs, out, key, name, ylabel, logy):
            plots.append(f)
    return plots


def markdown(
    args, now: dt.datetime, verdicts, seeds: list[Path], by_seed: list[list[Run]], plots
) -> list[str]:
    """The report's lines: provenance, the claims, the data regime, the runs of each seed, the plots."""
    commits = sorted({r.summary.get("git_commit", "?") for seed_runs in by_seed for r in seed_runs})
    machine = f"{platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    runs_lines = [
        line
        for root, seed_runs in zip(seeds, by_seed)
        for line in ([f"`{root.name}`:", ""] if len(seeds) > 1 else []) + [runs_table(seed_runs), ""]
    ]
    first = [f"The runs in `{seeds[0].name}` (the first of {len(seeds)} seeds)."] if len(seeds) > 1 else []
    return [
        f"# Replication report: `{args.family}`",
        "",
        f"Written {now:%Y-%m-%d %H:%M UTC} by `python scripts/report.py --family "
        f"{args.family} --runs {args.runs}` at commit {_commit()} on {machine}. "
        f"Runs were produced at commit(s): {', '.join(commits)}.",
        "",
        "## Checks against the paper (`make check`)",
        "",
        markdown_table(verdicts),
        "",
        data_regime(by_seed[0]),
        "",
        "## Runs",
        "",
        *runs_lines,
        "## Plots",
        "",
        *first,
        *[f"![{f}]({f})" for f in plots],
        "",
    ]


if __name__ == "__main__":
    sys.exit(main())

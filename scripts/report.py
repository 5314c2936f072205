"""`make report`: a family's runs as a Markdown report with PNG plots, plus a W&B report when online.

    python scripts/report.py --family tiny [--runs runs] [--out results/tiny-<date>] [--force]

Writes <out>/report.md (the claim table of `make check`, a table of runs, the plots), <out>/*.png:
eval perplexity vs step, vs tokens and vs bytes communicated, the FP16 cast error per outer round,
and compute utilization (a plot with no data, e.g. bytes when no run communicates, is left out), and
<out>/summaries.json, the record: each run's summary and the metric records its verdicts come from,
so `make check RUNS=<out>` judges it again with the same verdicts. The default <out> is a new dated
folder, results/<family>-<UTC date>; a folder that already holds a report is never replaced unless
--force is given (committed records, e.g. results/tiny, stay as they were made). With W&B online (and
`wandb-workspaces` installed) it also builds a W&B report of the family's group and prints its URL.
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

import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from diloco.metrics import wandb_mode  # noqa: E402
from diloco.replication import (  # noqa: E402
    RECORD,
    REFERENCE,
    Run,
    by_reference,
    check,
    judged_records,
    load_runs,
    markdown_table,
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
    if (out / "report.md").exists() or (out / RECORD).exists():
        if not args.force:
            print(
                f"error: {out}/ already holds a report (a record is never replaced silently): "
                "choose another --out, or --force to replace it",
                file=sys.stderr,
            )
            return 1
        if out.resolve() == Path(args.runs).resolve():
            print(f"error: {out}/ is the record being reported: choose another --out", file=sys.stderr)
            return 1
        for old in [out / "report.md", out / RECORD, *(out / name for name in PLOTS)]:
            old.unlink(missing_ok=True)  # no plot of the old report left beside the new ones
    runs = sorted(
        (r for r in by_reference(load_runs(args.runs)).values() if r.family == args.family),
        key=lambda r: r.reference or "",
    )
    if not runs:
        print(f"error: no runs of family {args.family!r} under {args.runs}/", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    window = yaml.safe_load(args.reference.read_text()).get("train_window", 0.02)
    verdicts = check(args.runs, [args.family], args.reference)
    plots = plot_eval(runs, out)
    for key, name, ylabel, logy in (
        ("comm/cast_rel_error", "fp16_cast_error.png", "FP16 cast rel. L2 error per round", True),
        ("outer/compute_utilization", "compute_utilization.png", "compute utilization per round", False),
    ):
        f = plot_series(runs, out, key, name, ylabel, logy)
        if f:
            plots.append(f)
    wb = wandb_report(args.family, runs)
    commits = sorted({r.summary.get("git_commit", "?") for r in runs})
    md = [
        f"# Replication report: `{args.family}`",
        "",
        f"Written {now:%Y-%m-%d %H:%M UTC} by `python scripts/report.py --family "
        f"{args.family} --runs {args.runs}` at commit {_commit()} on {platform.node()} ({platform.processor() or platform.machine()},"
        f" {os.cpu_count()} cores). Runs were produced at commit(s): {', '.join(commits)}.",
        "",
        "## Checks against the paper (`make check`)",
        "",
        markdown_table(verdicts),
        "",
        "## Runs",
        "",
        runs_table(runs),
        "",
        "## Plots",
        "",
        *[f"![{f}]({f})" for f in plots],
        "",
        wb,
        "",
    ]
    (out / "report.md").write_text("\n".join(md))
    (out / "summaries.json").write_text(
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
    print(f"wrote {out / 'report.md'} ({len(plots)} plots)")
    print(wb)
    return 0


if __name__ == "__main__":
    sys.exit(main())

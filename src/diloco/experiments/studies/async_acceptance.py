"""Issue 12's acceptance record: DumbDiLoCo against synchronous DiLoCo in the tiny family, per seed.

    python scripts/async_acceptance.py --out results/tiny-async \
        --horizon 400=runs/acc400 --horizon 2000=runs/acc2000 --seeds 1337 1

Each `--horizon STEPS=PREFIX` (or `STEPS=SYNC_PREFIX,DUMB_PREFIX`) reads `<PREFIX>-s<seed>/tiny-diloco-fp32/summary.json` (synchronous DiLoCo,
4 gloo workers) and `<PREFIX>-s<seed>/tiny-dumb-diloco-node-0/summary.json` (the DumbDiLoCo master's
final evaluation, of the final global after every node's last delta), as made by

    python scripts/replicate.py --family tiny --only tiny/diloco_fp32 tiny/dumb_diloco \
        --runs <PREFIX>-s<seed> --override seed=<seed> [--override optim.total_steps=2000 ...]

and writes <out>/summary.json and <out>/README.md: held-out perplexity per seed, mean and spread, the
gap of the means and each seed's gap, and PASS when the mean gap is within 3% (the issue's bar).
`--heterogeneous SYNC_RUN_DIR,DUMB_PREFIX` (runs with `--override train.slowdown=2 --override
train.slow_shards=[3]`; once per seed) adds the time DumbDiLoCo's master takes to reach synchronous DiLoCo's
final perplexity, as a fraction of synchronous DiLoCo's wall time (PASS at most 75%, on every seed). Runs
must be of a clean commit (a dirty one is refused); the record names every run's commit.
"""

from __future__ import annotations

import argparse
import platform
import re
from datetime import datetime, timezone
from pathlib import Path

from diloco.experiments import records

ROOT = records.ROOT
RUNS = {"sync": "tiny-diloco-fp32", "dumb": "tiny-dumb-diloco-node-0"}
BAR = 0.03


def read(prefix: str, seed: int, kind: str) -> dict:
    path = Path(f"{prefix}-s{seed}") / RUNS[kind] / "summary.json"
    s = records.clean_summary(path)
    keys = ("final_eval_perplexity", "wall_seconds", "git_commit", "tokens_seen", "step", "status")
    return {k: s.get(k) for k in keys} | {"path": str(path)}


def horizon(prefixes: str, seeds: list[int]) -> dict:
    """`prefixes`: one prefix for both kinds, or "SYNC_PREFIX,DUMB_PREFIX"."""
    sync, _, dumb = prefixes.partition(",")
    prefix = {"sync": sync, "dumb": dumb or sync}
    runs = {kind: [read(prefix[kind], seed, kind) for seed in seeds] for kind in RUNS}
    ppl = {kind: [r["final_eval_perplexity"] for r in rs] for kind, rs in runs.items()}
    mean = {kind: sum(v) / len(v) for kind, v in ppl.items()}
    gap = mean["dumb"] / mean["sync"] - 1
    return {
        "seeds": seeds,
        "ppl": ppl,
        "mean": mean,
        "spread": {kind: max(v) - min(v) for kind, v in ppl.items()},
        "gap_of_means": gap,
        "gap_per_seed": [d / s - 1 for d, s in zip(ppl["dumb"], ppl["sync"])],
        "verdict": "PASS" if gap <= BAR else "FAIL",
        "runs": runs,
    }


EVAL = re.compile(r"^(\S+ \S+) INFO .*?(?:step (\d+): |final )eval loss \S+, perplexity ([\d.]+)")


def curve(log: Path) -> tuple[datetime, list[tuple[float, int, float]]]:
    """(start, [(seconds since the log's first line, step, perplexity)]) of a train.log's evaluations."""
    lines = log.read_text().splitlines()
    stamp = lambda line: datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")  # noqa: E731
    start, out = stamp(lines[0]), []
    for line in lines:
        if m := EVAL.match(line):
            out.append(((stamp(line) - start).total_seconds(), int(m[2] or -1), float(m[3])))
    return start, out


def heterogeneous(dirs: str) -> dict:
    """`SYNC_RUN,DUMB_PREFIX`: time for DumbDiLoCo's master (its live model, then the final global) to
    reach synchronous DiLoCo's final perplexity, against synchronous DiLoCo's wall time, both with one
    worker slowed down (train.slowdown); from the nodes' first log line to the evaluation's."""
    sync_dir, dumb_prefix = dirs.split(",")
    _, sync = curve(Path(sync_dir) / "train.log")
    target, t_sync = sync[-1][2], sync[-1][0]
    starts = [
        curve(p)[0]
        for p in sorted(Path(dumb_prefix).parent.glob(Path(dumb_prefix).name + "-node-*/train.log"))
    ]
    master_start, dumb = curve(Path(f"{dumb_prefix}-node-0") / "train.log")
    shift = (master_start - min(starts)).total_seconds()  # from the first node's start
    dumb = [(t + shift, step, ppl) for t, step, ppl in dumb]
    reached = next(((t, step, ppl) for t, step, ppl in dumb if ppl <= target), None)
    ratio = reached[0] / t_sync if reached else None
    dirs = [Path(sync_dir), *sorted(Path(dumb_prefix).parent.glob(Path(dumb_prefix).name + "-node-*[0-9]"))]
    runs = {d.name: records.clean_summary(d / "summary.json") for d in dirs}  # a dirty tree's run is refused
    return {
        "sync_dir": sync_dir,
        "target_ppl": target,
        "sync_seconds": t_sync,
        "sync_curve": sync,
        "dumb_curve": dumb,
        "dumb_reached": reached,
        "ratio": ratio,
        "verdict": "PASS" if ratio is not None and ratio <= 0.75 else "FAIL",
        "commits": sorted({s["git_commit"] for s in runs.values()}),
        # train.step_seconds: each run's emulated step time, and its steps whose work alone took longer
        "emulated_step": {name: s.get("emulated_step") for name, s in runs.items()},
    }


def seed_mean(pairs: list[dict]) -> dict | None:
    """The pairs' mean: DumbDiLoCo's mean curve (the master's i-th evaluation, its perplexity and time
    averaged over the pairs) against the mean of synchronous DiLoCo's final perplexities and wall times."""
    if len(pairs) < 2 or len({len(p["dumb_curve"]) for p in pairs}) != 1:
        return None  # one pair, or curves of different lengths: no mean curve
    target = sum(p["target_ppl"] for p in pairs) / len(pairs)
    t_sync = sum(p["sync_seconds"] for p in pairs) / len(pairs)
    curve = [
        (sum(c[0] for c in col) / len(col), col[0][1], sum(c[2] for c in col) / len(col))
        for col in zip(*(p["dumb_curve"] for p in pairs))
    ]
    reached = next((point for point in curve if point[2] <= target), None)
    ratio = reached[0] / t_sync if reached else None
    return {
        "pairs": len(pairs),
        "target_ppl": target,
        "sync_seconds": t_sync,
        "dumb_curve": curve,
        "dumb_reached": reached,
        "ratio": ratio,
    }


def horizon_lines(rows: dict) -> list[str]:
    """The markdown table of the horizons: each method's perplexity per seed, mean and spread, the gap."""
    if not rows:
        return []
    lines = [
        "| steps | synchronous DiLoCo (per seed) | mean ± spread | DumbDiLoCo (per seed) | mean ± spread "
        "| gap of means | gap per seed | within 3% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for steps, h in rows.items():
        cells = []
        for kind in RUNS:
            cells += [
                ", ".join(f"{p:.2f}" for p in h["ppl"][kind]),
                f"{h['mean'][kind]:.2f} ± {h['spread'][kind]:.2f}",
            ]
        per = ", ".join(f"{g:+.1%}" for g in h["gap_per_seed"])
        lines.append(f"| {steps} | {' | '.join(cells)} | {h['gap_of_means']:+.1%} | {per} | {h['verdict']} |")
    return lines


def heterogeneous_lines(h: dict) -> list[str]:
    """One heterogeneous pair's paragraph: when DumbDiLoCo reaches synchronous DiLoCo's final perplexity."""
    got = h["dumb_reached"]
    line = (
        f"Heterogeneous, one of 4 workers 2x slower ({h['sync_dir']}): synchronous DiLoCo ends at "
        f"{h['target_ppl']:.2f} after {h['sync_seconds']:.0f} s; DumbDiLoCo's master "
        + (
            f"reaches it at step {got[1]} after {got[0]:.0f} s ({h['ratio']:.0%} of that)"
            if got
            else "never reaches it"
        )
        + f" (best {min(p for *_, p in h['dumb_curve']):.2f}); within 75%: {h['verdict']}"
    )
    if emulated := [e for e in h["emulated_step"].values() if e]:
        over = sum(e["steps_over"] for e in emulated) / sum(e["steps"] for e in emulated)
        line += f"; emulated step time (train.step_seconds) overrun on {over:.1%} of steps"
    return ["", line]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--horizon", action="append", default=[], help="STEPS=PREFIX")
    ap.add_argument(
        "--heterogeneous",
        action="append",
        default=[],
        help="SYNC_RUN_DIR,DUMB_PREFIX (one slowed-down worker)",
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337, 1])
    ap.add_argument("--out", default=str(ROOT / "results" / "tiny-async"))
    args = ap.parse_args()
    rows = {int(h.split("=")[0]): horizon(h.split("=", 1)[1], args.seeds) for h in args.horizon}
    record = {
        "command": "python scripts/async_acceptance.py "
        + " ".join(f"--horizon {h}" for h in args.horizon)
        + f" --seeds {' '.join(map(str, args.seeds))}",
        **records.head(),
        "machine": f"{platform.node()} {platform.machine()}",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "bar": BAR,
        "horizons": rows,
    }
    for dirs in args.heterogeneous:
        record["command"] += f" --heterogeneous {dirs}"
    if args.heterogeneous:
        record["heterogeneous"] = [heterogeneous(dirs) for dirs in args.heterogeneous]
        record["heterogeneous_mean"] = seed_mean(record["heterogeneous"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records.write_json(out / "summary.json", record)
    lines = horizon_lines(rows)
    commits = sorted({r["git_commit"][:10] for h in rows.values() for rs in h["runs"].values() for r in rs})
    for h in record.get("heterogeneous", []):
        lines += heterogeneous_lines(h)
        commits += [c[:10] for c in h["commits"] if c[:10] not in commits]
    if mean := record.get("heterogeneous_mean"):
        got = mean["dumb_reached"]
        lines += [
            "",
            f"Mean of the {mean['pairs']} pairs: synchronous DiLoCo ends at {mean['target_ppl']:.2f} after "
            f"{mean['sync_seconds']:.0f} s; DumbDiLoCo's mean curve "
            + (
                f"reaches it at its step {got[1]} after {got[0]:.0f} s ({mean['ratio']:.0%})"
                if got
                else "never does"
            )
            + f"; per pair, within 75% on {sum(h['verdict'] == 'PASS' for h in record['heterogeneous'])} of "
            f"{mean['pairs']}",
        ]
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)
    print(f"runs at commit(s) {', '.join(commits)}; record {out}/summary.json")


if __name__ == "__main__":
    main()

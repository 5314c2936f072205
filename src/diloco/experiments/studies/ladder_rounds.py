"""`make ladder-rounds` (issue 55): the controlled ladder's size trend with the number of outer rounds
separated from the size.

    python scripts/ladder_rounds.py --runs runs/ladder-rounds                   # every rung
    python scripts/ladder_rounds.py --runs runs/ladder-rounds --rungs 2m        # one batch
    python scripts/ladder_rounds.py --runs runs/ladder-rounds --report-only     # the record

In `results/ladder-controlled` H is 30 on every rung, so the rounds grow with the size (11 / 43 / 117)
and the one big drop of the gap sits on the step that also has 2.7x the rounds. Here every rung runs
DiLoCo at H = 10, 30 and 90 with the controlled ladder's tokens and tuned inner lr, each under the outer
optimizers of `configs/studies/ladder_rounds.yaml` (the line's start points, and the next point past
whichever wins), at 3 report seeds that also order the data; 4x-batch DDP runs at the same seeds and at
every step count a rung uses, so every gap compares equal tokens. Reading across rungs at about the same
rounds tells a size effect (the gap still falls with N) from a rounds effect (it does not).

The outer optimizer is chosen per (rung, H) on the report seeds themselves (there is no tuning run at
this size of grid); the record therefore also reads the cross at each fixed outer setting, which
involves no choice. Writes results/ladder-rounds/{summary.json, table.md, rounds.png}.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from diloco.experiments import records, sweep
from diloco.experiments.run import run_local
from diloco.experiments.studies import ladder_controlled as ctl

ROOT = records.ROOT
GRID = ROOT / "configs" / "studies" / "ladder_rounds.yaml"
MATCHED = (  # (smaller rung, its H), (larger rung, its H): about the same outer rounds
    (("ladder_ne33k", 10), ("2m", 30)),
    (("2m", 30), ("ladder_ne359k", 90)),
    (("2m", 10), ("ladder_ne359k", 30)),
)
Outer = tuple[float, float]


@dataclass(frozen=True)
class Cross:
    """The grid of configs/studies/ladder_rounds.yaml on top of the controlled ladder's."""

    rungs: tuple[str, ...]
    inner_steps: tuple[int, ...]
    inner_lr: dict
    outer_line: tuple[Outer, ...]
    outer_start: tuple[Outer, ...]
    report_seeds: tuple[int, ...]
    ladder: ctl.Study

    @classmethod
    def load(cls, path: Path = GRID) -> Cross:
        d = yaml.safe_load(path.read_text())
        line = tuple((float(a), float(b)) for a, b in d["outer_line"])
        start = tuple((float(a), float(b)) for a, b in d["outer_start"])
        return cls(
            tuple(d["rungs"]),
            tuple(d["inner_steps"]),
            d["inner_lr"],
            line,
            start,
            tuple(d["report_seeds"]),
            ctl.Study.load(),
        )

    def steps(self, rung: str, h: int) -> int:
        """The controlled ladder's steps for the rung, rounded to whole rounds of H."""
        return max(1, round(self.ladder.steps(rung) / h)) * h

    def run_name(self, key: tuple) -> str:
        rung, method, h, outer, seed = key
        if method == "ddp":
            return f"ladder-rounds-{rung}-ddp-n{h}-s{seed}"  # h: the step count
        return f"ladder-rounds-{rung}-diloco-H{h}-o{outer[0]:g}m{outer[1]:g}-s{seed}"

    def overrides(self, key: tuple) -> list[str]:
        """A run of (rung, method, H or DDP's steps, outer, seed): the controlled ladder's overrides
        with this H, outer optimizer and step count, and the data ordered by the seed."""
        rung, method, h, outer, seed = key
        steps = h if method == "ddp" else self.steps(rung, h)
        lr = self.inner_lr[rung][method]
        study = self.ladder if method == "ddp" else _with(self.ladder, h, outer)
        base = study.overrides(rung, method, lr, seed, "report")
        keep = [
            o for o in base if not o.startswith(("train.max_steps", "optim.", "run_name", "launch.family"))
        ]
        return [
            *keep,
            f"train.max_steps={steps}",
            f"optim.total_steps={steps}",
            f"optim.warmup_steps={max(1, round(study.warmup_fraction * steps))}",
            f"optim.lr={lr}",
            "launch.family=ladder-rounds",
            f"run_name={self.run_name(key)}",
        ]


def _with(study: ctl.Study, h: int, outer: Outer) -> ctl.Study:
    from dataclasses import replace

    return replace(study, inner_steps=h, outer=outer)


def read(cross: Cross, runs: Path, key: tuple) -> dict | None:
    steps = key[2] if key[1] == "ddp" else cross.steps(key[0], key[2])
    return sweep.read_final(runs / cross.run_name(key) / "summary.json", steps, sweep.FINAL_KEYS)


def ensure(cross: Cross, runs: Path, key: tuple, dry: bool) -> dict | None:
    if not dry:
        run_local(ctl.METHODS[key[1]], runs, cross.overrides(key))
    return read(cross, runs, key)


def outer_sweep(cross: Cross, runs: Path, rung: str, h: int, dry: bool) -> dict:
    """outer -> DiLoCo's runs at the report seeds: the start points, then the line's next point past the
    winner while the winner sits on the edge of what ran. `best`: the outer of the lowest mean loss."""
    line, got = list(cross.outer_line), {}
    tried = sorted(line.index(o) for o in cross.outer_start)
    while True:
        for i in tried:
            o = line[i]
            if o not in got:
                got[o] = [ensure(cross, runs, (rung, "diloco", h, o, s), dry) for s in cross.report_seeds]
        best = ctl.best_lr(got)  # the key of the lowest mean final loss (any key), None while incomplete
        nxt = None if best is None else _past_the_edge(line.index(best), tried, len(line))
        if nxt is None:
            return {"runs": got, "best": best}
        tried = sorted([*tried, nxt])


def _past_the_edge(best: int, tried: list[int], size: int) -> int | None:
    if best == tried[-1] and best + 1 < size:
        return best + 1
    return best - 1 if best == tried[0] and best > 0 else None


def rung_record(cross: Cross, runs: Path, rung: str, dry: bool) -> dict:
    """DDP at every step count the rung uses, then DiLoCo's outer sweep at each H, and every gap."""
    counts = sorted({cross.steps(rung, h) for h in cross.inner_steps})
    ddp = {
        n: [ensure(cross, runs, (rung, "ddp", n, None, s), dry) for s in cross.report_seeds] for n in counts
    }
    cells = []
    for h in cross.inner_steps:
        swept = outer_sweep(cross, runs, rung, h, dry)
        for outer, finals in swept["runs"].items():
            cells.append(cell(cross, rung, h, outer, finals, ddp[cross.steps(rung, h)], swept["best"]))
    return {
        "rung": rung,
        "parameters": ctl.parameters(rung),
        "ddp": {str(n): v for n, v in ddp.items()},
        "cells": cells,
    }


def cell(cross: Cross, rung: str, h: int, outer: Outer, finals: list, ddp: list, best: Outer | None) -> dict:
    steps = cross.steps(rung, h)
    out = {
        "H": h,
        "outer": list(outer),
        "best_outer": outer == best,
        "steps": steps,
        "rounds": steps // h,
        "tokens": steps * cross.ladder.global_batch * ctl.seq_len(),
        "runs": finals,
    }
    pairs = list(zip(finals, ddp))
    if pairs and all(a and b for a, b in pairs):
        out["loss_gap"] = ctl.spread([a["final_eval_loss"] / b["final_eval_loss"] - 1 for a, b in pairs])
    return out


def matched(rungs: list[dict]) -> list[dict]:
    """The rounds-matched pairs: the gap at the larger rung minus the smaller's, at each outer setting both
    ran and at each one's best, with the standard error of the difference of the two means."""
    out = []
    for small, large in MATCHED:
        a, b = _cells(rungs, *small), _cells(rungs, *large)
        if not a or not b:
            continue
        rows = []
        for label, x, y in _comparable(a, b):
            diff = y["loss_gap"]["mean"] - x["loss_gap"]["mean"]
            se = math.hypot(_se(x), _se(y))
            rows.append({"outer": label, "small": _brief(x), "large": _brief(y), "diff": diff, "se": se})
        out.append({"small": list(small), "large": list(large), "rows": rows})
    return out


def _cells(rungs: list[dict], rung: str, h: int) -> list[dict]:
    r = next((r for r in rungs if r["rung"] == rung), None)
    return [] if r is None else [c for c in r["cells"] if c["H"] == h and "loss_gap" in c]


def _comparable(a: list[dict], b: list[dict]):
    for x in a:
        y = next((y for y in b if y["outer"] == x["outer"]), None)
        if y is not None:
            yield f"{x['outer'][0]:g} / {x['outer'][1]:g}", x, y
    best_a = [x for x in a if x["best_outer"]]
    best_b = [y for y in b if y["best_outer"]]
    if best_a and best_b:
        yield "each one's best", best_a[0], best_b[0]


def _se(c: dict) -> float:
    g = c["loss_gap"]
    return g["sd"] / math.sqrt(len(g["per_seed"]))


def _brief(c: dict) -> dict:
    return {
        "H": c["H"],
        "rounds": c["rounds"],
        "outer": c["outer"],
        "gap": c["loss_gap"]["mean"],
        "sd": c["loss_gap"]["sd"],
    }


def table(rungs: list[dict]) -> str:
    head = "| rung (non-emb. N) | H | rounds | steps | outer lr / momentum | loss gap per seed | mean ± sd |"
    lines = [head, "|---" * 7 + "|"]
    for r in rungs:
        for c in sorted(r["cells"], key=lambda c: (c["H"], c["outer"])):
            lines.append(_table_line(r, c))
    return "\n".join(lines) + "\n"


def _table_line(r: dict, c: dict) -> str:
    n = f"{r['rung']} ({r['parameters']['non_embedding']:,})"
    outer = f"{c['outer'][0]:g} / {c['outer'][1]:g}" + (" (best)" if c["best_outer"] else "")
    head = [n, str(c["H"]), str(c["rounds"]), f"{c['steps']:,}", outer]
    if "loss_gap" not in c:
        return "| " + " | ".join([*head, "(not run)", ""]) + " |"
    g = c["loss_gap"]
    per = ", ".join(f"{x:+.2%}" for x in g["per_seed"])
    return "| " + " | ".join([*head, per, f"{g['mean']:+.2%} ± {g['sd']:.2%}"]) + " |"


def matched_text(pairs: list[dict]) -> str:
    lines = ["\nAbout the same outer rounds at two sizes (gap at the larger rung minus the smaller's, ± the"]
    lines.append("standard error of that difference from the seeds' sd):")
    for p in pairs:
        (sr, sh), (lr, lh) = p["small"], p["large"]
        for row in p["rows"]:
            s, g = row["small"], row["large"]
            lines.append(
                f"- {sr} H={sh} ({s['rounds']} rounds, {s['gap']:+.2%}) vs {lr} H={lh} ({g['rounds']} rounds, "
                f"{g['gap']:+.2%}), outer {row['outer']}: {row['diff']:+.2%} ± {row['se']:.2%}"
            )
    return "\n".join(lines) + "\n"


def plot(rungs: list[dict], out: Path) -> None:
    """The gap against outer rounds, one line per rung (its best outer at each H), each fixed outer
    setting as open markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for r in rungs:
        best = sorted(
            (c for c in r["cells"] if c["best_outer"] and "loss_gap" in c), key=lambda c: c["rounds"]
        )
        if not best:
            continue
        label = f"{r['rung']} ({r['parameters']['non_embedding']:,} non-emb.): best outer ± sd"
        line = ax.errorbar(
            [c["rounds"] for c in best],
            [100 * c["loss_gap"]["mean"] for c in best],
            yerr=[100 * c["loss_gap"]["sd"] for c in best],
            marker="o",
            capsize=3,
            label=label,
        )
        others = [c for c in r["cells"] if not c["best_outer"] and "loss_gap" in c]
        ax.scatter(
            [c["rounds"] for c in others],
            [100 * c["loss_gap"]["mean"] for c in others],
            facecolors="none",
            edgecolors=line[0].get_color(),
            s=25,
        )
    ax.set(xscale="log", xlabel="outer rounds (H = 10, 30, 90 at each rung's tokens)")
    ax.set_ylabel("DiLoCo vs 4x-batch DDP, final held-out loss gap (%)")
    ax.set_title("Rounds cross: open markers are the other outer settings", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def restore(cross: Cross, runs: Path, record: Path) -> int:
    """Summaries for the committed record's runs whose folders are missing (run folders are not committed)."""
    if not record.exists():
        return 0
    written = 0
    for r in json.loads(record.read_text())["rungs"]:
        keys = [
            ((r["rung"], "ddp", int(n), None, s), run)
            for n, v in r["ddp"].items()
            for s, run in zip(cross.report_seeds, v)
        ]
        keys += [
            ((r["rung"], "diloco", c["H"], tuple(c["outer"]), s), run)
            for c in r["cells"]
            for s, run in zip(cross.report_seeds, c["runs"])
        ]
        for key, run in keys:
            folder = runs / cross.run_name(key)
            if run is None or (folder / "summary.json").exists():
                continue
            steps = key[2] if key[1] == "ddp" else cross.steps(key[0], key[2])
            records.write_json(
                folder / "summary.json",
                {**run, "step": steps, "status": "completed", "restored_from": str(record)},
            )
            written += 1
    return written


def write_record(cross: Cross, runs: Path, out: Path) -> None:
    rungs = [rung_record(cross, runs, rung, dry=True) for rung in cross.rungs]
    pairs = matched(rungs)
    record = {
        **records.provenance(records.command_line()),
        "grid": yaml.safe_load(GRID.read_text()),
        "ladder_grid": yaml.safe_load(ctl.GRID.read_text()),
        "rungs": rungs,
        "matched": pairs,
    }
    records.write_tuning_record(out, record, table(rungs) + matched_text(pairs))
    plot(rungs, out / "rounds.png")


def main(argv: list[str] | None = None) -> int:
    cross = Cross.load()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("runs/ladder-rounds"))
    p.add_argument("--out", type=Path, default=ROOT / "results" / "ladder-rounds")
    p.add_argument("--rungs", nargs="*", default=list(cross.rungs), choices=list(cross.rungs))
    p.add_argument("--report-only", action="store_true", help="write the record from the runs there are")
    p.add_argument("--no-restore", action="store_true", help="do not write the committed record's runs back")
    args = p.parse_args(argv)
    if not args.no_restore:
        print(f"restored {restore(cross, args.runs, args.out / 'summary.json')} runs from the record")
    for rung in args.rungs:
        if not args.report_only:
            rung_record(cross, args.runs, rung, dry=False)
    write_record(cross, args.runs, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

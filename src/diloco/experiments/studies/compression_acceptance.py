"""Issue 13's and issue 32's acceptance records: compressed pseudo-gradients, streaming fragments, sparse
2-bit pseudo-gradients and eager updates against FP32 DiLoCo in the tiny family, per seed.

    python scripts/compression_acceptance.py --runs runs/cmp --seeds 1337 1 --out results/tiny-compress
    python scripts/compression_acceptance.py --family tiny-frontier --runs runs/frontier --dumb --out results/tiny-frontier

reads `<runs>-s<seed>/<run_name>/summary.json` and `metrics.jsonl` of every config below, as made by

    python scripts/replicate.py --family <family> --runs <runs>-s<seed> --override seed=<seed>

and writes <out>/summary.json and <out>/table.md: held-out perplexity per seed, mean and spread, the
gap of the means to FP32, bytes per round and peak bytes per sync against FP32 (measured, from the
summaries), the mean relative L2 quantization error per round, and a verdict per bar of the issue.
A perplexity bar is one-sided: a config passes when its mean is at most the bar above FP32's. Runs
must be of a clean commit (a dirty one is refused); the record names every run's commit.
With `--dumb`, DumbDiLoCo (tiny/dumb_diloco and its compressed variant, the master's final global) too.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from datetime import datetime, timezone
from pathlib import Path

from diloco.experiments import records

ROOT = records.ROOT
BASE = "tiny-diloco-fp32"
# run name: (what, perplexity bar against FP32, bytes per round at least this much fewer, peak bar)
FAMILIES = {
    "tiny-compress": {
        "tiny-diloco-int8": ("int8 + error feedback", 0.005, 3.97, None),
        "tiny-diloco-int4": ("4-bit + error feedback", 0.01, 7.88, None),
        "tiny-diloco-stream-p4": ("Streaming, P=4 (FP32)", 0.01, None, 4.0),
        "tiny-diloco-stream-p4-int4": ("Streaming, P=4, tau=1, alpha=0.5, 4-bit", None, None, None),
    },
    # issue 32: topk2 at <= 0.5 bits per parameter (>= 64x fewer bytes than FP32) within 1%; eager updates
    # (P=4, the whole phase overlapped) within 1% of non-overlapped DiLoCo at the same format (FP32)
    "tiny-frontier": {
        "tiny-diloco-topk2": (
            "topk2 (64 of 4,096, 2-bit) + error feedback, outer Nesterov 0.9",
            0.01,
            64.0,
            None,
        ),
        "tiny-diloco-sparseloco": (
            "SparseLoCo: topk2, carry decay 0.95, no outer momentum",
            0.01,
            64.0,
            None,
        ),
        "tiny-diloco-stream-p4": ("Streaming, P=4 (FP32), not overlapped", 0.01, None, 4.0),
        "tiny-diloco-stream-p4-eager": ("Streaming, P=4, eager updates (tau = H), FP32", 0.01, None, 4.0),
        # the naive delayed outer step eager updates improve on (tau = H - 1: the config allows tau = H with eager only)
        "tiny-diloco-stream-p4-delayed": (
            "Streaming, P=4, tau = H - 1, no eager updates, FP32",
            None,
            None,
            None,
        ),
        # the density sweep of SparseLoCo's recipe (bits per parameter against perplexity)
        "tiny-diloco-sparseloco-d0.0625": ("SparseLoCo at 256 of 4,096", 0.01, None, None),
        "tiny-diloco-sparseloco-d0.25": ("SparseLoCo at 1,024 of 4,096", 0.01, None, None),
    },
}
# issue 32 in issue 33's regime: the same runs and bars in the tiny_law family (262k parameters, 52 rounds)
FAMILIES["tiny-law-frontier"] = {
    name.replace("tiny-", "tiny-law-", 1): (what.replace("Nesterov 0.9", "lr 0.5 / Nesterov 0.8"), *bars)
    for name, (what, *bars) in FAMILIES["tiny-frontier"].items()
}
# eager updates at the outer optimizer tuned for them (results/tiny-law-eager-tuning, the tuning half), in
# FP32 and with 4-bit codes against non-overlapped P=4 with the same codes
FAMILIES["tiny-law-frontier"].update(
    {
        "tiny-law-diloco-stream-p4-eager-o1-m0": (
            "Streaming, P=4, eager updates, outer lr 1 / no momentum (tuned for eager), FP32",
            0.01,
            None,
            4.0,
        ),
        "tiny-law-diloco-stream-p4-int4": (
            "Streaming, P=4, not overlapped, 4-bit + error feedback",
            0.01,
            None,
            None,
        ),
        "tiny-law-diloco-stream-p4-eager-o1-m0-int4": (
            "Streaming, P=4, eager updates (lr 1, no momentum), 4-bit + error feedback",
            0.01,
            None,
            None,
        ),
    }
)
BARS = FAMILIES["tiny-compress"]
# DumbDiLoCo: the FP32 run, its compressed variant, and how many times fewer bytes a delta file must be
DUMB_FAMILIES = {
    "tiny-compress": ({"float32": "tiny-dumb-diloco-node-0", "int4": "tiny-dumb-diloco-int4-node-0"}, None),
    "tiny-frontier": ({"float32": "tiny-dumb-diloco-node-0", "topk2": "tiny-dumb-diloco-topk2-node-0"}, 60.0),
    "tiny-law-frontier": (
        {
            "float32": "tiny-law-dumb-diloco-node-0",
            "topk2": "tiny-law-dumb-diloco-topk2-node-0",
            "sparseloco": "tiny-law-dumb-diloco-sparseloco-node-0",  # topk2 with SparseLoCo's recipe
        },
        60.0,
    ),
}
# the FP32 DiLoCo run each family's configs are judged against
BASES = {"tiny-compress": BASE, "tiny-frontier": BASE, "tiny-law-frontier": "tiny-law-diloco-fp32"}
DUMB = DUMB_FAMILIES["tiny-compress"][0]


def read(run_dir: Path) -> dict:
    s = records.clean_summary(run_dir / "summary.json")
    errors = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            m = json.loads(line)
            if "comm/cast_rel_error" in m:
                errors.append(m["comm/cast_rel_error"])
    keys = ("final_eval_perplexity", "git_commit", "wall_seconds", "tokens_seen", "step", "status")
    keys += ("comm/total_bytes", "comm/peak_bytes_per_sync", "outer/rounds", "comm/delta_bytes")
    out = {k: s.get(k) for k in keys} | {"path": str(run_dir)}
    out["cast_rel_error"] = statistics.fmean(errors) if errors else None
    return out


def spread(values: list[float]) -> dict:
    return {"per_seed": values, "mean": statistics.fmean(values), "spread": max(values) - min(values)}


def judge(prefix: str, seeds: list[int], bars: dict = BARS, base_name: str = BASE) -> dict:
    runs = {
        name: [read(Path(f"{prefix}-s{seed}") / name) for seed in seeds]
        for name in [base_name, *bars]
        if all((Path(f"{prefix}-s{seed}") / name / "summary.json").exists() for seed in seeds)
    }
    base = runs[base_name]
    ppl0 = spread([r["final_eval_perplexity"] for r in base])
    rows = {base_name: {"what": "FP32 (the baseline)", "ppl": ppl0, "runs": base}}
    for name, (what, ppl_bar, bytes_bar, peak_bar) in bars.items():
        if name not in runs:
            continue
        rs = runs[name]
        ppl = spread([r["final_eval_perplexity"] for r in rs])
        gap = ppl["mean"] / ppl0["mean"] - 1
        fewer = base[0]["comm/total_bytes"] / rs[0]["comm/total_bytes"]  # same rounds: per round too
        peak = base[0]["comm/peak_bytes_per_sync"] / rs[0]["comm/peak_bytes_per_sync"]
        verdicts = {}
        if ppl_bar is not None:
            verdicts["perplexity"] = "PASS" if gap <= ppl_bar else "FAIL"
        if bytes_bar is not None:
            verdicts["bytes"] = "PASS" if fewer >= bytes_bar * 0.999 else "FAIL"
        if peak_bar is not None:
            verdicts["peak"] = "PASS" if peak >= peak_bar * 0.999 else "FAIL"
        rows[name] = {
            "what": what,
            "ppl": ppl,
            "gap_of_means": gap,
            "gap_per_seed": [
                r["final_eval_perplexity"] / b["final_eval_perplexity"] - 1 for r, b in zip(rs, base)
            ],
            "bytes_fewer": fewer,
            "bits_per_param": 32 / fewer,
            "peak_fewer": peak,
            "cast_rel_error": [r["cast_rel_error"] for r in rs],
            "bars": {"perplexity": ppl_bar, "bytes": bytes_bar, "peak": peak_bar},
            "verdicts": verdicts,
            "runs": rs,
        }
    return rows


def dumb(prefix: str, seeds: list[int], names: dict = DUMB, fewer_bar: float | None = None) -> dict:
    """DumbDiLoCo in FP32 and compressed (`names`: float32 first, then each compressed run; one whose runs
    are missing is left out): the master's final perplexity and the bytes of its node's delta file; each
    compressed run within 1% of FP32 (and, with fewer_bar, that many times fewer bytes). The first
    compressed run's verdict is also at the top level."""
    out = {}
    for kind, name in names.items():
        if not all((Path(f"{prefix}-s{seed}") / name / "summary.json").exists() for seed in seeds):
            continue
        rs = [read(Path(f"{prefix}-s{seed}") / name) for seed in seeds]
        out[kind] = {"ppl": spread([r["final_eval_perplexity"] for r in rs]), "runs": rs}
    # one delta file (the last one the master's node wrote), header included
    out["delta_bytes"] = {k: out[k]["runs"][0]["comm/delta_bytes"] for k in names if k in out}
    out["judged"] = {}
    for small in [k for k in list(names)[1:] if k in out]:
        gap = out[small]["ppl"]["mean"] / out["float32"]["ppl"]["mean"] - 1
        fewer = out["delta_bytes"]["float32"] / out["delta_bytes"][small]
        ok = gap <= 0.01 and (fewer_bar is None or fewer >= fewer_bar)
        out["judged"][small] = {
            "gap_of_means": gap,
            "delta_fewer": fewer,
            "verdict": "PASS" if ok else "FAIL",
        }
    out["fewer_bar"] = fewer_bar
    out.update(out["judged"][list(names)[1]])
    return out


def table(rows: dict, base_name: str = BASE) -> list[str]:
    lines = [
        "| config | perplexity per seed | mean ± spread | gap of means | gap per seed | bytes per round "
        "(x fewer) | bits per parameter | peak bytes per sync (x fewer) | quantization error | verdicts |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        per = ", ".join(f"{p:.2f}" for p in r["ppl"]["per_seed"])
        cells = [f"`{name}`: {r['what']}", per, f"{r['ppl']['mean']:.2f} ± {r['ppl']['spread']:.2f}"]
        if name == base_name:
            b = r["runs"][0]
            cells += [
                "-",
                "-",
                f"{b['comm/total_bytes'] / b['outer/rounds']:,.0f} B",
                "32",
                f"{b['comm/peak_bytes_per_sync']:,} B",
                "-",
                "-",
            ]
        else:
            errs = [e for e in r["cast_rel_error"] if e is not None]
            cells += [
                f"{r['gap_of_means']:+.1%}",
                ", ".join(f"{g:+.1%}" for g in r["gap_per_seed"]),
                f"{r['bytes_fewer']:.2f}x",
                f"{r['bits_per_param']:.3g}",
                f"{r['peak_fewer']:.2f}x",
                f"{statistics.fmean(errs):.3f}" if errs else "-",
                ", ".join(f"{k} {v}" for k, v in r["verdicts"].items()) or "-",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help="prefix of the run folders: <runs>-s<seed>")
    ap.add_argument("--family", choices=list(FAMILIES), default="tiny-compress")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337, 1])
    ap.add_argument("--dumb", action="store_true", help="DumbDiLoCo FP32 vs int4 too")
    ap.add_argument("--out", default=str(ROOT / "results" / "tiny-compress"))
    args = ap.parse_args()
    rows = judge(args.runs, args.seeds, FAMILIES[args.family], BASES[args.family])
    names, fewer_bar = DUMB_FAMILIES[args.family]
    record = {
        "command": f"python scripts/compression_acceptance.py --family {args.family} --runs {args.runs} --seeds "
        + " ".join(map(str, args.seeds))
        + (" --dumb" if args.dumb else ""),
        **records.head(),
        "machine": f"{platform.node()} {platform.machine()}",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "configs": rows,
    }
    lines = table(rows, BASES[args.family])
    if args.dumb:
        d = record["dumb"] = dumb(args.runs, args.seeds, names, fewer_bar)
        present = [k for k in names if k in d]  # a compressed run without its runs is left out
        per = {k: ", ".join(f"{p:.2f}" for p in d[k]["ppl"]["per_seed"]) for k in present}
        lines += [
            "",
            "| DumbDiLoCo (the master's final global) | perplexity per seed | mean ± spread | gap of means "
            "| bytes per delta file | x fewer | verdict |",
            "|---|---|---|---|---|---|---|",
        ]
        for k in present:
            p, j = d[k]["ppl"], d["judged"].get(k)
            last = (
                [
                    f"{j['gap_of_means']:+.1%}",
                    f"{d['delta_bytes'][k]:,} B",
                    f"{j['delta_fewer']:.2f}x",
                    j["verdict"],
                ]
                if j
                else ["-", f"{d['delta_bytes'][k]:,} B", "-", "-"]
            )
            lines.append(
                f"| `{names[k]}` ({k}) | {per[k]} | {p['mean']:.2f} ± {p['spread']:.2f} | "
                + " | ".join(last)
                + " |"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records.write_json(out / "summary.json", record)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    runs = [r for row in rows.values() for r in row["runs"]]
    runs += [r for k in names for r in record.get("dumb", {}).get(k, {}).get("runs", [])]
    commits = sorted({r["git_commit"][:10] for r in runs})
    print(f"runs at commit(s) {', '.join(commits)}; record {out}/summary.json")


if __name__ == "__main__":
    main()

"""Write results/bench/README.md from the benchmarks' JSON records (`make bench` runs it last).

python scripts/bench_report.py [--out results/bench]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diloco.bench import common as bc

ORDER = [
    "outer_step",
    "boundary",
    "wire",
    "trainer",
    "utilization",
    "comm_volume",
    "gpu",
    "trainer_gpu",
    "quant",
    "fsdp",
]
ISSUE_ITEM = {
    "outer_step": "1. Outer step vs memory bandwidth",
    "boundary": "2. Asynchronous boundary stall",
    "wire": "3. Wire format",
    "trainer": "4. Trainer overhead",
    "utilization": "5. Compute utilization under limited bandwidth",
    "comm_volume": "6. Communication volume",
    "gpu": "7. GPU",
    "trainer_gpu": "4. Trainer overhead on the GPU (150m)",
    "quant": "8. Int8 / 4-bit encoding with error feedback (issue #13)",
    "fsdp": "9. Sharded workers: FSDP against DDP inside a DiLoCo worker (issue 53)",
}


def load(out: Path) -> dict[str, dict]:
    records = {}
    for path in sorted(out.glob("*.json")):
        try:
            r = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict) and r.get("name") in ORDER:
            records[r["name"]] = r
    return records


def section(r: dict) -> list[str]:
    number = ISSUE_ITEM[r["name"]].split(".")[0]
    lines = [f"## {number}. {r['title']}", ""]
    lines += [f"`{r['command']}` at `{r['commit'][:12]}`, {r['date']}", ""]
    if r.get("verdicts"):
        lines += [f"- {v}" for v in r["verdicts"]] + [""]
    lines += [bc.table(r["rows"], r["columns"]), ""]
    if r.get("plot"):
        lines += [f"![{r['title']}]({r['plot']})", ""]
    for key, t in r.get("tables", {}).items():
        lines += [f"**{key}**", "", bc.table(t["rows"], t["columns"]), ""]
    if r.get("notes"):
        lines += ["Notes:", ""] + [f"- {n}" for n in r["notes"]] + [""]
    return lines


def machine_lines(records: dict[str, dict]) -> list[str]:
    machines = {
        json.dumps({k: v for k, v in r["machine"].items() if k != "load_average_1m"}, sort_keys=True)
        for r in records.values()
    }
    lines = []
    for m in machines:
        m = json.loads(m)
        gpu = f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU"
        lines.append(
            f"- {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['memory_gb']} GB, "
            f"torch {m['torch']}, Python {m['python']}{gpu}"
        )
    loads = {name: r["machine"].get("load_average_1m") for name, r in records.items()}
    lines.append(
        "- 1-minute load average when each benchmark started (2 cores; above ~2 means other work shared the "
        "machine): " + ", ".join(f"{k} {v:.1f}" for k, v in loads.items() if v is not None)
    )
    commits = sorted({r["commit"] for r in records.values()})
    lines.append(f"- commit(s): {', '.join(f'`{c}`' for c in commits)}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=bc.DEFAULT_OUT)
    p.add_argument("--findings", type=Path, default=None, help="markdown inserted after the summary")
    args = p.parse_args(argv)
    records = load(args.out)
    lines = [
        "# Benchmarks (issue #7)",
        "",
        "Written by `scripts/bench_report.py` from the JSON records beside this file. Reproduce with "
        "`make bench` (CPU benchmarks, then this report) and `make bench-gpu` on a GPU node. Every figure is a "
        "median of repeats after a warm-up; the ratios that matter (to a floor, to a baseline) are measured in "
        "the same run, because the machines are shared and noisy.",
        "",
        "Machine:",
        "",
        *machine_lines(records),
        "",
        "## Targets",
        "",
    ]
    for name in ORDER:
        if name in records:
            lines += [f"- **{ISSUE_ITEM[name]}**"] + [f"  - {v}" for v in records[name].get("verdicts", [])]
        elif name == "trainer_gpu":
            continue
        elif name == "gpu":
            lines += [
                f"- **{ISSUE_ITEM[name]}**: not measured (no GPU where `make bench` ran); "
                "`make bench-gpu` on an H100/H200 runs `scripts/bench_gpu.py` (at most 8 minutes) and writes "
                "`gpu.json`, picked up here on the next report."
            ]
        else:
            lines += [f"- **{ISSUE_ITEM[name]}**: no record yet"]
    lines.append("")
    findings = args.findings or (args.out / "FINDINGS.md")
    if findings.exists():
        lines += [findings.read_text().strip(), ""]
    for name in ORDER:
        if name in records:
            lines += section(records[name])
    (args.out / "README.md").write_text("\n".join(lines).rstrip() + "\n")
    print(f"-> {args.out / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make replicate-150m DRY_RUN=1`, measured: wall time and peak memory (the largest child's resident
set, from GNU time), and each leg's seconds and peak as the dry run prints them (issue 17).

    /usr/bin/time -v -o time.txt make replicate-150m DRY_RUN=1 | tee out.txt      # once per commit
    python scripts/bench_dry_run.py --label after --out-file out.txt --time-file time.txt --commit abc1234

Adds (or replaces) the entry `label` of results/bench/dry_run.json and rewrites results/bench/dry_run.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JSON = ROOT / "results" / "bench" / "dry_run.json"
COMMAND = "make replicate-150m DRY_RUN=1"
LEG = re.compile(r"^   (\S+): 2 real optimizer steps on CPU OK \((\d+) s(?:, peak ([\d.]+) GiB)?\)")
STARTED = re.compile(r"^   (\S+): 2 CPU steps \((\w+), ")
FAILED = re.compile(r"^error: (\S+): two CPU steps failed \(exit (-?\d+)\)")


def parse_time(text: str) -> dict:
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text).group(1)
    seconds = sum(float(x) * 60**i for i, x in enumerate(reversed(wall.split(":"))))
    kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    status = int(re.search(r"Exit status: (\d+)", text).group(1))
    return {"wall_seconds": round(seconds, 1), "peak_rss_bytes": kib * 1024, "exit_status": status}


def parse_legs(text: str) -> list[dict]:
    legs, modes = [], {}
    for line in text.splitlines():
        if m := STARTED.match(line):
            modes[m.group(1)] = m.group(2)
        elif m := LEG.match(line):
            leg = {"name": m.group(1), "mode": modes.get(m.group(1)), "seconds": int(m.group(2))}
            if m.group(3):
                leg["peak_bytes"] = int(float(m.group(3)) * 2**30)
            legs.append(leg)
        elif m := FAILED.match(line):
            legs.append({"name": m.group(1), "failed_exit": int(m.group(2))})
    return legs


def markdown(bench: dict) -> str:
    lines = [
        "# `make replicate-150m DRY_RUN=1`: wall time and peak memory",
        "",
        "Written by `scripts/bench_dry_run.py` (issue 17). Peak memory is GNU time's maximum resident set",
        "size: that of the largest single process (the legs run one after another).",
        "",
        "| run | commit | date (UTC) | machine | exit | wall | peak memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, e in bench["runs"].items():
        wall = f"{int(e['wall_seconds'] // 60)} min {e['wall_seconds'] % 60:.0f} s"
        lines.append(
            f"| {label} | {e['commit']} | {e['date']} | {e['machine']} | {e['exit_status']} | {wall} "
            f"| {e['peak_rss_bytes'] / 2**30:.2f} GiB |"
        )
    for label, e in bench["runs"].items():
        lines += ["", f"## {label}: the legs", "", "| leg | mode | seconds | peak |", "|---|---|---|---|"]
        for leg in e["legs"]:
            if "failed_exit" in leg:
                lines.append(f"| {leg['name']} | | failed, exit {leg['failed_exit']} | |")
                continue
            peak = f"{leg['peak_bytes'] / 2**30:.2f} GiB" if "peak_bytes" in leg else "(not printed)"
            lines.append(f"| {leg['name']} | {leg['mode'] or ''} | {leg['seconds']} | {peak} |")
        if e.get("note"):
            lines += ["", e["note"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", required=True, help="before | after")
    p.add_argument("--out-file", type=Path, required=True, help="the dry run's output")
    p.add_argument("--time-file", type=Path, required=True, help="GNU time -v's report")
    p.add_argument("--commit", required=True)
    p.add_argument("--date", default=f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M}")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    bench = json.loads(JSON.read_text()) if JSON.exists() else {"command": COMMAND, "runs": {}}
    entry = parse_time(args.time_file.read_text())
    entry.update(
        commit=args.commit,
        date=args.date,
        machine=f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)",
        legs=parse_legs(args.out_file.read_text()),
        note=args.note,
    )
    bench["runs"][args.label] = entry
    JSON.write_text(json.dumps(bench, indent=1) + "\n")
    (JSON.parent / "dry_run.md").write_text(markdown(bench))
    print(markdown(bench))
    return 0


if __name__ == "__main__":
    sys.exit(main())

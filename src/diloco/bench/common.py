"""Shared pieces of the benchmarks (`scripts/bench_*.py`, run by `make bench`).

Every benchmark: parses the common flags (`--tiny` for the test suite's one-shot run, `--out`,
`--repeats`, `--warmup`), times with `measure` (median of `repeats` runs after `warmup` runs),
and ends with `write`, which prints a markdown table and writes `<out>/<name>.json` holding the
machine, the commit, the command, the arguments, the rows and notes (diloco.experiments.records says
how; records are written atomically). `scripts/bench_report.py`
turns those JSON files into `results/bench/README.md`.

Machines are shared and noisy: quote ratios of figures measured in the same run, not absolute
seconds from different runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from diloco.experiments.records import GB, ROOT, command_line, commit, machine, utc_now
from diloco.files import write_atomic

DEFAULT_OUT = ROOT / "results" / "bench"

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def parser(description: str, repeats: int = 5, warmup: int = 1) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tiny", action="store_true", help="smallest sizes, one repeat: proves the script works")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the JSON result")
    p.add_argument("--repeats", type=int, default=repeats, help="timed repeats (the median is reported)")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed runs before the repeats")
    return p


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    if args.tiny:
        args.repeats, args.warmup = 1, 0
    return args


# ---------------------------------------------------------------------------------------------------
# timing


def measure(
    fn: Callable[[], object], repeats: int, warmup: int = 1, setup: Callable[[], object] | None = None
) -> dict:
    """Run `setup` (untimed) then `fn` (timed), `warmup` + `repeats` times; seconds of the repeats."""
    times = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return summarize(times)


def summarize(times: list[float]) -> dict:
    return {
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
        "repeats": len(times),
        "all": [round(t, 6) for t in times],
    }


def copy_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 7) -> dict:
    """This machine's memory bandwidth for a plain `dst.copy_(src)` of `nbytes` (float32, both
    buffers already touched, so no page faults): bytes read + bytes written per second."""
    n = max(nbytes // 4, 1)
    src = torch.ones(n)
    dst = torch.zeros(n)
    dst.copy_(src)
    m = measure(lambda: dst.copy_(src), repeats=repeats, warmup=2)
    return {
        "bytes": 4 * n,
        "seconds": m,
        "gb_per_s": 2 * 4 * n / m["median"] / GB,
        "gb_per_s_best": 2 * 4 * n / m["min"] / GB,
    }


# ---------------------------------------------------------------------------------------------------
# output


def fmt(v, digits: int = 3) -> str:
    if isinstance(v, float):
        if v != v:  # NaN
            return "-"
        if v == 0:
            return "0"
        a = abs(v)
        if a >= 1e5 or a < 1e-3:
            return f"{v:.{digits}g}"
        return f"{v:,.{digits}f}".rstrip("0").rstrip(".") if a < 100 else f"{v:,.1f}"
    if v is None:
        return "-"
    return str(v)


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A markdown table of `rows` (dicts), columns in the given order (default: first row's keys)."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def write(
    name: str,
    title: str,
    args: argparse.Namespace,
    rows: list[dict],
    columns: list[str] | None = None,
    *,
    notes: list[str] = (),
    verdicts: list[str] = (),
    extra: dict | None = None,
    tables: dict[str, tuple[list[dict], list[str] | None]] | None = None,
) -> Path:
    """Print the table(s) and notes; write `<args.out>/<name>.json`. Returns the JSON path."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "name": name,
        "title": title,
        "date": utc_now(),
        "command": command_line(),
        "commit": commit(),
        "machine": machine(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "columns": columns or (list(rows[0]) if rows else []),
        "rows": rows,
        "tables": {
            k: {"rows": r, "columns": c or (list(r[0]) if r else [])} for k, (r, c) in (tables or {}).items()
        },
        "notes": list(notes),
        "verdicts": list(verdicts),
        **(extra or {}),
    }
    path = out / f"{name}.json"
    write_atomic(path, json.dumps(record, indent=1, default=_json_default) + "\n")
    print(f"\n## {title}\n")
    print(table(rows, record["columns"]))
    for key, t in record["tables"].items():
        print(f"\n{key}:\n")
        print(table(t["rows"], t["columns"]))
    for line in [*verdicts, *notes]:
        print(f"- {line}")
    print(f"\n-> {path}")
    return path


def write_labelled(out: str | Path, name: str, label: str, record: dict, report) -> dict[str, dict]:
    """Keep `record` under `label` in `<out>/<name>.json` (the other labels stay) and rewrite
    `<out>/<name>.md` as `report(runs)`; returns every run. For before/after benchmarks whose runs come
    from different checkouts."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    runs = old.get("runs", {}) if old.get("name") == name else {}
    runs[label] = record
    write_atomic(path, json.dumps({"name": name, "runs": runs}, indent=1) + "\n")
    write_atomic(out / f"{name}.md", report(runs))
    return runs


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, torch.dtype):
        return str(o).removeprefix("torch.")
    if isinstance(o, torch.Tensor):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PB"

"""Shared pieces of the benchmarks (`scripts/bench_*.py`, run by `make bench`).

Every benchmark: parses the common flags (`--tiny` for the test suite's one-shot run, `--out`,
`--repeats`, `--warmup`), times with `measure` (median of `repeats` runs after `warmup` runs),
and ends with `write`, which prints a markdown table and writes `<out>/<name>.json` holding the
machine, the commit, the command, the arguments, the rows and notes. `scripts/bench_report.py`
turns those JSON files into `results/bench/README.md`.

Machines are shared and noisy: quote ratios of figures measured in the same run, not absolute
seconds from different runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from diloco.metrics import git_commit

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "results" / "bench"
GB = 1e9

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
# where and what


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / GB, 1)
    except OSError:
        pass
    return None


def machine() -> dict:
    """CPU model, cores, memory, torch, GPU (if any), and the load when the benchmark started."""
    info = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": _mem_total_gb(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "gpu": None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    with contextlib.suppress(OSError):
        info["load_average_1m"] = os.getloadavg()[0]
    return info


def commit() -> str:
    """HEAD's sha, with -dirty when tracked files other than the records in results/ differ from it
    (`make bench` rewrites those as it goes)."""
    return git_commit(ROOT, exclude=("results",))


def head() -> dict:
    """A record's "commit" and "dirty" by `commit`'s rule (tracked files outside results/; untracked files
    do not count, as in every run's own git_commit)."""
    sha = commit()
    return {"commit": sha.removesuffix("-dirty"), "dirty": sha.endswith("-dirty")}


def provenance(command: str) -> dict:
    """What a results record starts with: the command, when, the machine, and the commit it was written at."""
    return {
        "command": command,
        "date": utc_now(),
        "machine": machine(),
        "report_commit": commit(),
    }


def tuning_regime(rows: list[dict], unique: int, detail: str = "") -> str:
    """A tuning record's data-regime line: each method's tokens trained per run and the epochs of the
    sample's `unique` training tokens they are, then `detail` (steps, rounds), on the tuning half."""
    tokens = {r["experiment"]: g["tokens_seen"] for r in rows for g in r["runs"] if g}
    per_run = "; ".join(f"{e} {t:,} ({t / unique:.2f} epochs)" for e, t in tokens.items())
    return (
        f"Data regime: packing, {unique:,} unique training tokens; tokens trained per run: {per_run}; "
        f"{detail}evaluated on data.eval_subset=tune.\n"
    )


def write_tuning_record(out: Path, record: dict, text: str) -> None:
    """A tuning record in `out`: summary.json (`record`) and table.md (`text`, also printed)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "table.md").write_text(text)
    print(text)


def clean_summary(path: Path, completed_steps: int | None = None) -> dict:
    """A run's summary.json for a results record: refused (SystemExit, one line) when the run was made
    from a dirty tree, and, with `completed_steps`, when it did not complete them."""
    s = json.loads(Path(path).read_text())
    if str(s.get("git_commit", "")).endswith("-dirty"):
        raise SystemExit(f"{path}: made from a dirty tree; rerun it from a commit")
    if completed_steps is not None and (s.get("step") != completed_steps or s.get("status") != "completed"):
        raise SystemExit(f"{path}: not a completed run (step {s.get('step')}, status {s.get('status')})")
    return s


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
    path.write_text(json.dumps(record, indent=1, default=_json_default) + "\n")
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
    path.write_text(json.dumps({"name": name, "runs": runs}, indent=1) + "\n")
    (out / f"{name}.md").write_text(report(runs))
    return runs


def utc_now() -> str:
    """When a record was written: UTC, to the second (ISO 8601)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def command_line() -> str:
    """This process's command as a record states it: `python` and its arguments, paths in the repository
    relative to its root."""
    return " ".join(["python", *[_rel(a) for a in sys.argv]])


def _rel(a: str) -> str:
    try:
        return str(Path(a).resolve().relative_to(ROOT)) if os.path.exists(a) else a
    except ValueError:
        return a


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

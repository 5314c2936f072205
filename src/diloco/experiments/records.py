"""What a results record states about itself, and how it is written: the command, the date, the machine,
the commit (with -dirty when tracked files outside results/ differ from it), the runs it trusts (only
those made from a clean tree), and atomic writes through `diloco.files` (a stopped script leaves the old
record or the new one). Benchmarks (`diloco.bench.common`), tuning, ladder and budget scripts share it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

import torch

from diloco.files import write_atomic
from diloco.metrics import dumps, git_commit

ROOT = Path(__file__).resolve().parents[3]  # the checkout: records are written from a clone, not a wheel
GB = 1e9


def utc_now() -> str:
    """When a record was written: UTC, to the second (ISO 8601)."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def command_line() -> str:
    """This process's command as a record states it: `python` and its arguments, paths in the repository
    relative to its root."""
    return " ".join(["python", *[relative(a) for a in sys.argv]])


def relative(arg: str) -> str:
    """`arg` relative to the checkout when it names a path inside it, else as given."""
    try:
        return str(Path(arg).resolve().relative_to(ROOT)) if os.path.exists(arg) else arg
    except ValueError:
        return arg


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def memory_gb() -> float | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / GB, 1)
    return None


def machine() -> dict:
    """CPU model, cores, memory, torch, GPU (if any), and the load when the record was started."""
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": memory_gb(),
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
    return {"command": command, "date": utc_now(), "machine": machine(), "report_commit": commit()}


def clean_summary(path: Path, completed_steps: int | None = None) -> dict:
    """A run's summary.json for a results record: refused (SystemExit, one line) when the run was made
    from a dirty tree, and, with `completed_steps`, when it did not complete them."""
    s = json.loads(Path(path).read_text())
    if str(s.get("git_commit", "")).endswith("-dirty"):
        raise SystemExit(f"{path}: made from a dirty tree; rerun it from a commit")
    if completed_steps is not None and (s.get("step") != completed_steps or s.get("status") != "completed"):
        raise SystemExit(f"{path}: not a completed run (step {s.get('step')}, status {s.get('status')})")
    return s


def tuning_regime(rows: list[dict], unique: int, detail: str = "") -> str:
    """A tuning record's data-regime line: each method's tokens trained per run and the epochs of the
    sample's `unique` training tokens they are, then `detail` (steps, rounds), on the tuning half."""
    tokens = {r["experiment"]: g["tokens_seen"] for r in rows for g in r["runs"] if g}
    per_run = "; ".join(f"{e} {t:,} ({t / unique:.2f} epochs)" for e, t in tokens.items())
    return (
        f"Data regime: packing, {unique:,} unique training tokens; tokens trained per run: {per_run}; "
        f"{detail}evaluated on data.eval_subset=tune.\n"
    )


def write_json(path: Path, record: dict, default=None) -> None:
    """`record` as indented JSON at `path`, atomically (its folder is made); NaN and infinities as null
    with the reason beside (metrics.finite_json), so any JSON reader parses it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, dumps(record, indent=1, default=default) + "\n")


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)


def write_tuning_record(out: Path, record: dict, text: str) -> None:
    """A tuning record in `out`: summary.json (`record`) and table.md (`text`, also printed)."""
    write_json(out / "summary.json", record)
    write_text(out / "table.md", text)
    print(text)

"""Checkpoints that resume a run exactly: model, inner optimizer, scheduler, data position, RNG,
and the distributed strategy's own state (global weights, outer momentum, ...), one file per rank.

Layout: <run_dir>/checkpoints/step_<N>/rank<R>.pt + meta.json (written last: a directory without it
is incomplete and ignored). Files go through `files.write_atomic` (temporary name, fsync, rename), so a
crash or Ctrl+C never leaves a half-written checkpoint behind. Only this run's own files are ever `torch.load`-ed,
and then with `weights_only=True`.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from .files import write_atomic, write_atomic_with


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used for this run; the message is one readable line."""


def _step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(i) for i in x) if isinstance(x, list | tuple) else x


def save(run_dir: Path, step: int, rank: int, state: dict, meta: dict, barrier, keep: int = 2) -> Path:
    """Every rank writes its own file; rank 0 marks the directory complete after all have written."""
    d = _step_dir(run_dir, step)
    d.mkdir(parents=True, exist_ok=True)
    write_atomic_with(d / f"rank{rank}.pt", lambda f: torch.save(state, f))
    barrier()
    if rank == 0:
        write_atomic(d / "meta.json", json.dumps({"step": step, **meta}, indent=2) + "\n")
        prune(Path(run_dir) / "checkpoints", keep)
    barrier()
    return d


def prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step_*") if (p / "meta.json").exists())
    for old in complete[: max(0, len(complete) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def latest(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    complete = sorted(p for p in root.glob("step_*") if (p / "meta.json").exists())
    return complete[-1] if complete else None


def load(ckpt_dir: Path, rank: int, fingerprint: str) -> dict:
    ckpt_dir = Path(ckpt_dir)
    meta_path = ckpt_dir / "meta.json"
    if not meta_path.exists():
        raise CheckpointError(f"not a complete checkpoint (no meta.json): {ckpt_dir}")
    meta = json.loads(meta_path.read_text())
    if meta.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} was written for model {meta.get('model', '?')} "
            f"(shape fingerprint {meta.get('fingerprint')}), which does not match this run's model "
            f"(fingerprint {fingerprint}); use another run_name or resume=never"
        )
    path = ckpt_dir / f"rank{rank}.pt"
    if not path.exists():
        raise CheckpointError(f"checkpoint {ckpt_dir} has no file for rank {rank} (world size changed?)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(e).__name__})") from None
    return state

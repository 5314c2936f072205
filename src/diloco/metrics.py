"""Run records: `metrics.jsonl` (one JSON object per logged step), `summary.json`, and W&B.

Metric names follow OpenDiLoCo's W&B runs (`Loss`, `Perplexity`, `lr`, `step`, `effective_step`,
`total_samples`, `tokens_per_second`, `time_taken`, `outer_lr`, `num_peers`) so reports line up;
this project's additions use prefixes (`eval/*`, `comm/*`, `outer/*`).
W&B is online when credentials exist, offline otherwise, `WANDB_MODE` wins, and a W&B failure never
fails a run: it is reported once and the local records go on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .files import write_atomic

if TYPE_CHECKING:
    from .schema import WandbConfig

log = logging.getLogger("diloco")


def git_commit(cwd: Path | None = None, exclude: tuple[str, ...] = ()) -> str:
    """HEAD's sha of the repository at `cwd` (default: the working directory), -dirty when tracked files
    other than those under `exclude` differ from it; a copy of the tree without git (a GPU machine's
    copy) names its commit through DILOCO_GIT_COMMIT, else "unknown"."""
    paths = ["--", ".", *(f":(exclude){x}" for x in exclude)] if exclude else []
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", *paths],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return os.environ.get("DILOCO_GIT_COMMIT", "unknown")


SET_UP_FILES = ("train.log", "train.rank*.log", "config.yaml")  # what a run writes before its first step


@contextmanager
def nothing_left_on(errors: tuple[type[BaseException], ...], cfg) -> Iterator[None]:
    """On one of `errors`, remove the run directory (`out_dir/run_name`) if this process created it and
    it holds nothing but the set-up files: a run refused before it trained leaves nothing behind; a
    resumed or started run keeps everything. Rank 0 removes it; the other ranks leave it alone."""
    from diloco.config import run_dir_of

    try:
        run_dir = run_dir_of(cfg)
        existed = run_dir.exists()
    except Exception:  # a config that does not resolve: validation names it, there is no directory
        run_dir, existed = None, True
    try:
        yield
    except errors:
        if not existed and os.environ.get("RANK", "0") == "0" and run_dir.is_dir():
            metrics = run_dir / "metrics.jsonl"
            if all(
                any(e.match(p) for p in SET_UP_FILES) or (e == metrics and not e.stat().st_size)
                for e in run_dir.iterdir()
            ):
                shutil.rmtree(run_dir, ignore_errors=True)
        raise


def wandb_mode(configured: str | None) -> str:
    if configured:
        return configured
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        if "api.wandb.ai" in netrc.read_text():
            return "online"
    except OSError:
        pass
    return "offline"


def finite_json(obj):
    """`obj` with every NaN or infinite float as null and, in a dict, the reason beside it
    (`<key>_nonfinite`: "nan", "inf" or "-inf"), so any JSON reader parses the record (json.dumps would
    write the non-standard NaN and Infinity)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if isinstance(v, float) and not math.isfinite(v):
                out[k], out[f"{k}_nonfinite"] = None, "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
            else:
                out[k] = finite_json(v)
        return out
    if isinstance(obj, list | tuple):
        return [None if isinstance(v, float) and not math.isfinite(v) else finite_json(v) for v in obj]
    return obj


def dumps(record, **kwargs) -> str:
    """json.dumps of `finite_json(record)`; refuses (ValueError) a non-finite value it did not replace."""
    return json.dumps(finite_json(record), allow_nan=False, **kwargs)


class RunLogger:
    """Writes the run's metrics on the main rank; a no-op elsewhere."""

    def __init__(
        self, run_dir: Path, config: dict, wandb_cfg: WandbConfig, enabled: bool, resume_step: int | None
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._fh = open(self.path, "a", buffering=1)
        self._init_wandb(config, wandb_cfg, resume_step)

    def _truncate_after(self, step: int | None) -> None:
        """On resume, drop records past the checkpoint so the file reads as one uninterrupted run."""
        if not self.path.exists():
            return
        keep = []
        if step is not None:
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= step:
                        keep.append(line)
                except json.JSONDecodeError:
                    break  # a torn last line from a crash
        write_atomic(self.path, "".join(line + "\n" for line in keep))  # a crash here keeps the old history

    def _init_wandb(self, config: dict, wandb_cfg: WandbConfig, resume_step: int | None) -> None:
        """One W&B run per training run. After a resume from step N its history is rewound to N
        (`resume_from`, W&B's rewind), as metrics.jsonl is, so the re-sent steps N+1.. are kept
        instead of being dropped as duplicates of steps W&B has already seen."""
        mode = wandb_mode(wandb_cfg.mode)
        if mode == "disabled":
            return
        try:
            import wandb

            id_file = self.run_dir / "wandb_id.txt"
            resumed = resume_step is not None and id_file.exists()
            run_id = id_file.read_text().strip() if resumed else uuid.uuid4().hex[:12]
            write_atomic(id_file, run_id)
            kwargs = dict(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                group=wandb_cfg.group,
                tags=list(wandb_cfg.tags or []),
                name=config.get("run_name"),
                id=run_id,
                dir=str(self.run_dir),
                config=config,
                mode=mode,
                settings=wandb.Settings(init_timeout=90, silent=True),
            )
            if resumed:
                try:
                    self._wandb = wandb.init(**kwargs, resume_from=f"{run_id}?_step={resume_step}")
                except (
                    Exception
                ) as e:  # a server without rewind: continue the run; W&B drops steps <= its last
                    log.warning(
                        "W&B cannot rewind run %s to step %d (%s); resuming it as is, so W&B keeps its "
                        "first values of steps it already has (metrics.jsonl is exact)",
                        run_id,
                        resume_step,
                        str(e).splitlines()[0] if str(e) else type(e).__name__,
                    )
                    self._wandb = wandb.init(**kwargs, resume="allow")
            else:
                self._wandb = wandb.init(**kwargs, resume="allow")
            if mode == "online" and self._wandb is not None:
                log.info("W&B run: %s", self._wandb.url)
        except Exception as e:  # W&B must never take a training run down
            log.warning(
                "W&B disabled for this run (%s: %s); metrics.jsonl is still written",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            self._wandb = None

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        self._fh.write(dumps({"step": step, **metrics}) + "\n")
        if self._wandb is not None:
            try:
                self._wandb.log(metrics, step=step)
            except Exception as e:
                log.warning("W&B log failed (%s); continuing with local records only", e)
                self._wandb = None

    def write_summary(self, summary: dict) -> None:
        if not self.enabled:
            return
        write_atomic(self.run_dir / "summary.json", dumps(summary, indent=2, default=str) + "\n")
        if self._wandb is not None:
            try:
                flat = {k: v for k, v in summary.items() if isinstance(v, int | float | str)}
                self._wandb.summary.update(flat)
            except Exception as e:
                log.warning("W&B summary failed (%s)", e)

    def close(self, exit_code: int = 0) -> None:
        if not self.enabled:
            return
        self._fh.close()
        if self._wandb is not None:
            try:
                self._wandb.finish(exit_code=exit_code)
            except Exception as e:
                log.warning("W&B finish failed (%s)", e)

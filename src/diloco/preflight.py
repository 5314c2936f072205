"""What a run checks of the machine before it writes anything, each mistake one line (ConfigError): the
run folder is this run's own (one node, one role, one run: two DumbDiLoCo nodes on one machine never
share one), `out_dir` can be written, and a DumbDiLoCo repository can be one (a shared directory is a
folder or can become one; a Hub id has a token, and was not meant as a path). `diloco.config.validate`
checks the config itself and reads nothing from the machine; this reads and writes nothing but stats.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from diloco.errors import ConfigError

# What makes a run folder one run's: a run may resume with longer schedules or other logging, not as
# another node, role, mode, model, seed or data shard.
IDENTITY = (
    ("distributed", "mode"),
    ("distributed", "role"),
    ("distributed", "node_id"),
    ("model", "name"),
    ("seed",),
    ("data", "shard"),
    ("data", "num_shards"),
)


def check(cfg, run_dir: Path, hub: bool = True) -> None:
    """Every check, in the order a user would fix them; `cfg`: the validated config. `hub`: also a Hub
    repository's token and reachability (a plan made away from the nodes leaves those to the run)."""
    check_writable(Path(cfg.out_dir), run_dir)
    check_run_folder(cfg, run_dir)
    if cfg.distributed.mode == "dumb_diloco" and cfg.distributed.role != "single":
        check_repository(cfg.distributed.repo_id, hub, token=cfg.distributed.token)


def check_writable(out_dir: Path, run_dir: Path) -> None:
    """The run folder exists and is writable, or its nearest existing parent lets it be made."""
    place = run_dir
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        raise ConfigError(f"out_dir={out_dir}: {place} is a file, so the run folder {run_dir} cannot be made")
    if not os.access(place, os.W_OK | os.X_OK):
        what = "the run folder" if place == run_dir else f"{place}, where the run folder {run_dir} would go,"
        raise ConfigError(f"out_dir={out_dir}: {what} is not writable: choose a writable out_dir")


def check_run_folder(cfg, run_dir: Path) -> None:
    """A run folder written by another node, role or run (its config.yaml) is refused, not shared."""
    recorded = run_dir / "config.yaml"
    if not recorded.is_file():
        return
    try:
        theirs = yaml.safe_load(recorded.read_text()) or {}
    except (OSError, yaml.YAMLError):
        raise ConfigError(
            f"{recorded} cannot be read: the run folder is not this run's; use another run_name"
        ) from None
    ours = {
        "distributed": vars(cfg.distributed),
        "model": vars(cfg.model),
        "data": vars(cfg.data),
        "seed": cfg.seed,
    }
    for path in IDENTITY:
        a, b = _get(theirs, path), _get(ours, path)
        if a != b:
            key = ".".join(path)
            raise ConfigError(
                f"run folder {run_dir} belongs to another run ({key}={a}; this run has {key}={b}), and "
                "nothing of it is touched: give this run its own run_name (or out_dir)"
            )


def _get(tree, path: tuple[str, ...]):
    for key in path:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def check_repository(repo_id: str, hub: bool = True, token: str | None = None) -> None:
    """A shared directory that can be one, or a Hub id that was meant as one (and, with `hub`, has a
    token, `distributed.token` or huggingface_hub's, and can be reached)."""
    from diloco.dumb_diloco.store.budget import on_hub

    if not on_hub(repo_id):
        _check_directory_repository(repo_id)
        return
    local = Path(repo_id).expanduser()
    if local.exists() or Path(repo_id.split("/")[0]).is_dir():
        raise ConfigError(
            f"distributed.repo_id={repo_id} is read as a Hugging Face Hub repository id (namespace/name), "
            f"but {'it' if local.exists() else repo_id.split('/')[0]} is also a local path here: write "
            f"./{repo_id} for a shared directory"
        )
    if not hub:
        return
    from huggingface_hub import get_token

    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise ConfigError(
            f"distributed.repo_id={repo_id} is a Hugging Face Hub repository and HF_HUB_OFFLINE is set: "
            f"unset it, or use a shared directory (./{repo_id}, an absolute path, file:///...)"
        )
    from diloco.data import hub_unreachable

    if token is None and get_token() is None:
        raise ConfigError(
            f"distributed.repo_id={repo_id} is read as a Hugging Face Hub repository id and no Hub token is "
            f"set (HF_TOKEN, `hf auth login` or distributed.token): set one, or write ./{repo_id} (or an absolute path) for a "
            "shared directory"
        )
    if (why := hub_unreachable()) is not None:
        raise ConfigError(f"distributed.repo_id={repo_id} is a Hugging Face Hub repository and {why}")


def _check_directory_repository(repo_id: str) -> None:
    path = Path(repo_id.removeprefix("file://")).expanduser()
    place = path
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        what = "is a file" if place == path else f"cannot be made: {place} is a file"
        raise ConfigError(f"distributed.repo_id={repo_id} {what}; a shared-directory repository is a folder")
    if not os.access(place, os.W_OK | os.X_OK):
        raise ConfigError(
            f"distributed.repo_id={repo_id}: {place} is not writable; every node writes its deltas there"
        )

"""Run the real trainer in-process on small settings (shared by the trainer tests)."""

from __future__ import annotations

import json
from pathlib import Path

from hydra import compose, initialize_config_dir

import diloco.config  # noqa: F401  (registers the structured configs and resolvers)

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")

# micro model on the bundled sample, a handful of short sequences per step: ~0.05 s a step on CPU
SMALL = [
    "model=micro",
    "data=sample",
    "data.seq_len=64",
    "train.batch_size=4",
    "train.micro_batch_size=2",
    "train.log_every=1",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.progress=false",
    "eval.tokens=2048",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "optim.total_steps=20",
    "device=cpu",
    "wandb.mode=disabled",
]


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def train(tmp_path: Path, *overrides: str, name: str = "run", **seams) -> Path:
    """diloco.train.run of the SMALL config with `overrides`; `seams` are run's (collective, transport,
    build)."""
    from diloco.config import run_dir_of
    from diloco.train import run

    cfg = compose_cfg([*SMALL, f"out_dir={tmp_path}", f"run_name={name}", *overrides])
    code = run(cfg, **seams)
    assert code == 0, f"trainer exited with {code}"
    return run_dir_of(cfg)  # a DumbDiLoCo node's folder carries its node id: <name>-<node_id>


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict:
    """The model weights of the newest checkpoint (the trainer always checkpoints at the end)."""
    import torch

    from diloco import checkpoint

    ckpt = checkpoint.latest(run_dir)
    return torch.load(ckpt / "rank0.pt", map_location="cpu", weights_only=True)["model"]


def resumed_equals_uninterrupted(tmp_path: Path, opts: list[str], stop: int, steps: int = 6) -> dict:
    """Trains `steps` steps in one go and, in a second run, `stop` steps then resumed to `steps`; asserts
    the final weights are equal bit for bit and returns the uninterrupted run's strategy state (rank 0)."""
    import torch

    from diloco import checkpoint

    full = train(tmp_path, f"train.max_steps={steps}", *opts, name="full")
    part = train(tmp_path, f"train.max_steps={stop}", *opts, name="part")
    train(tmp_path, f"train.max_steps={steps}", *opts, name="part")
    wf, wp = final_weights(full), final_weights(part)
    assert all(torch.equal(wf[k], wp[k]) for k in wf)
    return torch.load(checkpoint.latest(full) / "rank0.pt", weights_only=True)["strategy"]

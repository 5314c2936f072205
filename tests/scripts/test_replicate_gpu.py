"""`make replicate-gpu` end to end, on CPU at a tiny size (SMOKE=1): the one-GPU family's five experiments
with their W workers (DDP ranks, DiLoCo ranks, DumbDiLoCo nodes), then its report and its check, through
the same make target the GPU run uses. It checks the pipeline, not the science: every run finishes, the
report names every run, the check judges every claim. Without CUDA the GPU run stops at once, in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from diloco.experiments.plan import compose_experiment, topology
from diloco.experiments.run import CPU_SMOKE, FAMILIES
from diloco.replication import REFERENCE

ROOT = Path(__file__).resolve().parents[2]


def make(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """`make <args>` with this interpreter, never re-running `make setup` (-o: the venv is what runs this)."""
    return subprocess.run(
        ["make", "-s", "-o", "setup", "-o", ".venv/.installed", *args, f"PY={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )


def run_dirs(runs: Path, name: str) -> list[Path]:
    """The directories an experiment's run writes a summary into: one, or one per DumbDiLoCo node."""
    cfg = compose_experiment(name, CPU_SMOKE)
    if cfg.distributed.mode != "dumb_diloco":
        return [runs / cfg.run_name]
    return [runs / f"{cfg.run_name}-node-{i}" for i in range(topology(cfg)["nodes"])]


def test_every_run_of_the_family_fits_one_gpu():
    for name in FAMILIES["gpu"]:
        cfg = compose_experiment(name)
        assert topology(cfg)["gpus_needed"] == 1 and cfg.launch.family == "gpu", name
        assert cfg.model.name == "14m" and cfg.launch.reference == name


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.slow
@pytest.mark.timeout(900)  # ~2.5 minutes on 2 cores shared with other work
def test_make_replicate_gpu_runs_end_to_end_on_cpu(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "report"
    proc = make("replicate-gpu", "SMOKE=1", f"RUNS={runs}", f"OUT={out}", timeout=840)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])

    max_steps = compose_experiment(FAMILIES["gpu"][0], CPU_SMOKE).train.max_steps
    for name in FAMILIES["gpu"]:
        for d in run_dirs(runs, name):
            summary = json.loads((d / "summary.json").read_text())
            assert summary["status"] == "completed" and summary["step"] == max_steps, (d, summary["step"])
            assert summary["config"]["device"] == "cpu"

    # DumbDiLoCo: the master evaluates mid-run (the run's curve), its workers only at their end
    dumb = next(
        n for n in FAMILIES["gpu"] if compose_experiment(n, CPU_SMOKE).distributed.mode == "dumb_diloco"
    )
    master, *workers = run_dirs(runs, dumb)
    mid_run = f"step {compose_experiment(dumb, CPU_SMOKE).train.eval_every}: eval loss"
    assert mid_run in (master / "train.log").read_text()
    assert workers and not any(mid_run in (w / "train.log").read_text() for w in workers)

    report = (out / "report.md").read_text()
    for name in FAMILIES["gpu"]:
        assert f"| {name.split('/')[-1]} |" in report, name  # a row of the runs table

    claims = yaml.safe_load(REFERENCE.read_text())["claims"]["gpu"]
    lines = proc.stdout.splitlines()
    for claim in claims:
        row = next((line for line in lines if line.startswith(f"| {claim['id']} |")), None)
        assert row is not None and row.endswith(expected_verdicts(claim)), (claim["id"], row)


def expected_verdicts(claim):
    """The verdicts a claim can get: a judged one is decided, the rest are reported or not tested."""
    if claim["kind"] == "not_tested":
        return ("| NOT TESTED |",)
    if claim["kind"] == "loss_gap_centre" or claim.get("judged") is False:
        return ("| REPORTED |",)
    return ("| PASS |", "| FAIL |", "| UNCERTAIN |")


def test_make_replicate_gpu_without_cuda_stops_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real run would start")
    proc = make("replicate-gpu", f"RUNS={tmp_path / 'runs'}", timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "needs a CUDA GPU" in errors[0], proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing started

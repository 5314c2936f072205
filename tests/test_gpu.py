"""The trainer on CUDA: bf16 eager and compiled steps agree with each other and with float32, a resume
continues the run, a DumbDiLoCo master and worker train on the GPU, W ranks share one GPU (gloo), and an
FSDP2 worker (bf16 parameters, float32 reductions) follows the unsharded bf16 run.
`make test-gpu` runs these; without CUDA they are skipped (DILOCO_GPU_TESTS_ON_CPU=1 runs them on the
CPU, to check the tests)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_utils import SMALL, read_metrics, train

ROOT = Path(__file__).resolve().parents[1]

ON_CPU = os.environ.get("DILOCO_GPU_TESTS_ON_CPU") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="needs CUDA"),
]
STEPS = 8
GPU = [f"device={DEVICE}", f"train.max_steps={STEPS}", f"optim.total_steps={STEPS}", "wandb.mode=disabled"]


def _losses(run_dir) -> list[float]:
    return [r["Loss"] for r in read_metrics(run_dir) if "Loss" in r]


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_bf16_eager_and_compiled_steps_agree_with_float32(tmp_path):
    """Same initial weights and data: bf16 autocast follows the float32 run to bf16 round-off, and
    torch.compile (the CUDA default) follows eager bf16."""
    fp32 = _losses(train(tmp_path, *GPU, "precision=fp32", "compile=false", name="fp32"))
    eager = _losses(train(tmp_path, *GPU, "precision=bf16", "compile=false", name="eager"))
    compiled_run = train(tmp_path, *GPU, "precision=bf16", "compile=true", name="compiled")
    compiled = _losses(compiled_run)
    assert len(fp32) == len(eager) == len(compiled) == STEPS
    assert eager[0] == pytest.approx(fp32[0], rel=2e-2)  # one forward pass, bf16 vs float32
    assert eager == pytest.approx(fp32, rel=5e-2)
    assert compiled == pytest.approx(eager, rel=3e-2)
    assert eager[-1] < eager[0] and compiled[-1] < compiled[0]
    assert math.isfinite(_summary(compiled_run)["final_eval_loss"])
    assert _summary(compiled_run)["device"].startswith(DEVICE)


def test_resume_on_the_device_continues_the_run(tmp_path):
    """A run stopped at step 4 and resumed equals the uninterrupted run (to bf16 kernels' round-off:
    CUDA's backward of the embedding accumulates with atomics, so bit equality is not promised)."""
    opts = [*GPU, "precision=bf16", "compile=false"]
    full = _losses(train(tmp_path, *opts, name="full"))
    train(
        tmp_path, *[o for o in opts if not o.startswith("train.max_steps")], "train.max_steps=4", name="part"
    )
    part = _losses(train(tmp_path, *opts, name="part"))
    assert len(part) == STEPS
    assert part == pytest.approx(full, rel=1e-2)


def test_dumb_diloco_master_and_worker_on_the_device(tmp_path):
    """A master and a worker (two processes) on the device exchange deltas through a directory."""
    from diloco.dumb_diloco.store.transport import DirectoryTransport
    from diloco.dumb_diloco.wire.repo_paths import GLOBAL_STEP_PATH, GLOBAL_WEIGHTS_PATH
    from diloco.dumb_diloco.wire.tensor_format import decode

    repo = tmp_path / "repo"
    common = [
        *SMALL,
        *GPU,
        "precision=bf16",
        "compile=false",
        f"out_dir={tmp_path}",
        "distributed=dumb_diloco",
        f"distributed.repo_id={repo}",
        "distributed.inner_steps=4",
        "distributed.poll_interval=0.2",
        "distributed.drain_timeout=120",
        "distributed.startup_timeout=120",
        f"distributed.state_dir={tmp_path / 'state'}",
        "data.num_shards=2",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    procs = []
    for role, shard in (("worker", 1), ("master", 0)):
        cmd = [
            sys.executable,
            "-m",
            "diloco.train",
            *common,
            f"distributed.role={role}",
            f"distributed.node_id={role}-1",
            f"data.shard={shard}",
            f"run_name={role}",
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out.decode()[-3000:]
    transport = DirectoryTransport(repo, create=False)
    info = json.loads(transport.read(GLOBAL_STEP_PATH))
    tensors, _ = decode(transport.read(GLOBAL_WEIGHTS_PATH), max_bytes=2**28)
    assert info["outer_step"] >= 1 and all(torch.isfinite(t).all() for t in tensors.values())
    worker = _summary(tmp_path / "worker")
    # v2: a boundary that finds the previous upload in flight is skipped (its steps go into the next delta),
    # so how many of the STEPS // 4 boundaries uploaded depends on the device's speed; the first always does
    assert worker["comm/boundaries"] == STEPS // 4 and worker["comm/uploads"] >= 1
    assert worker["comm/uploads"] + worker["comm/skipped_boundaries"] == STEPS // 4
    assert _summary(tmp_path / "master")["dumb_diloco/role"] == "master"


@pytest.mark.parametrize(
    ("mode", "ranks"), [("ddp", 2), ("diloco", 4)], ids=["ddp-2-ranks", "diloco-4-workers"]
)
def test_ranks_share_one_gpu_through_gloo(tmp_path, mode, ranks):
    """launch.ranks_per_gpu: W ranks on one GPU (the one-GPU family, `make replicate-gpu`), which NCCL
    refuses; the process group is gloo, on CUDA tensors, and every rank trains on cuda:0."""
    from mp_utils import run_trainer

    extra = ["distributed.inner_steps=4", "distributed.ranks_per_worker=1"] if mode == "diloco" else []
    run_trainer(
        ranks,
        [
            *SMALL,
            *GPU,
            "precision=bf16",
            "compile=false",
            f"out_dir={tmp_path}",
            "run_name=shared",
            f"distributed={mode}",
            *extra,
            f"launch.gpus_per_node={ranks}",
            f"launch.ranks_per_gpu={ranks}",
        ],
    )
    summary = _summary(tmp_path / "shared")
    assert summary["world_size"] == ranks and summary["step"] == STEPS
    assert summary["device"] == ("cuda:0" if DEVICE == "cuda" else "cpu")
    assert summary["comm/total_bytes"] > 0


def test_fsdp_bf16_follows_the_unsharded_bf16_run(tmp_path):
    """worker_parallel=fsdp on the device (issue 53): FSDP2 with its CUDA MixedPrecisionPolicy (bf16
    parameters for compute, float32 gradient reductions and float32 master weights) follows the same run
    without sharding under bf16 autocast, to bf16 round-off, and writes its checkpoint. One
    rank on the one GPU (nccl): the bf16 path of the sharded step is what is checked, the shard-wise
    reductions are checked over gloo on CPU (tests/sync/test_fsdp.py). On the CPU (DILOCO_GPU_TESTS_ON_CPU)
    the policy is float32 and so is this comparison's path."""
    from mp_utils import run_trainer

    from diloco import checkpoint

    common = [*SMALL, *GPU, "precision=bf16", "compile=false", f"out_dir={tmp_path}", "distributed=ddp"]
    run_trainer(1, [*common, "run_name=plain"])
    run_trainer(1, [*common, "run_name=fsdp", "distributed.worker_parallel=fsdp"])
    plain, fsdp = _losses(tmp_path / "plain"), _losses(tmp_path / "fsdp")
    assert len(plain) == len(fsdp) == STEPS
    assert fsdp == pytest.approx(plain, rel=5e-2)
    assert fsdp[-1] < fsdp[0] and math.isfinite(_summary(tmp_path / "fsdp")["final_eval_loss"])
    assert _summary(tmp_path / "fsdp")["device"].startswith(DEVICE)
    assert (checkpoint.latest(tmp_path / "fsdp") / "rank0.pt").exists()

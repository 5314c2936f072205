"""The README's DumbDiLoCo commands, as printed: one `scripts/launch_node.sh` per node,

    HF_TOKEN=... scripts/launch_node.sh --experiment tiny/dumb_diloco --cpu \
        --role master|worker --node-id node-<i> --repo-id <org/name | /shared/dir> --shard <i> -- <overrides>

three of them (a master and two workers, started workers first) against the loopback Hub
(src/diloco/testing/hub_server.py, the real huggingface_hub client through HF_ENDPOINT, HF_TOKEN checked by the
server) and against a shared directory. The overrides after `--` make the run a few dozen steps of the
micro model on 3 nodes; everything else (the run directories, the per-node log, the data shards, the
environment) is the launcher's.

The reference is the master's own published record replayed by hand: the initial global (the seeded
model) plus one outer step per round of the published ledger, each round's deltas (read back from the
repository) averaged, must give the published global and outer momentum bit for bit. Every delta in the
repository is applied exactly once, every node's final marker says finished and names an applied delta,
every launch exits 0, and the token is in no file the runs wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from mp_utils import wait_for_nodes
from trainer_utils import compose_cfg

from diloco.dumb_diloco.master.aggregation import average
from diloco.dumb_diloco.master.recovery import MasterState
from diloco.dumb_diloco.store.transport import DirectoryTransport, HubTransport
from diloco.dumb_diloco.wire.repo_paths import (
    GLOBAL_LEDGER_PATH,
    GLOBAL_MOMENTUM_PATH,
    GLOBAL_WEIGHTS_PATH,
    delta_path,
    parse_delta_path,
)
from diloco.dumb_diloco.wire.tensor_format import decode
from diloco.model import build_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_network")]

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch_node.sh"
EXPERIMENT = "tiny/dumb_diloco"
RUN_NAME = "tiny-dumb-diloco"  # the experiment's; each node's run is <run_name>-<node_id>
TOKEN = "hf_LaunchNodeFakeTokenNeverWritten4242"
STEPS, H = 30, 5
NODES = [("master", "node-0"), ("worker", "node-1"), ("worker", "node-2")]  # shard = index
DEADLINE = (
    480  # s: the longest the three nodes may take (about 25 s on 2 idle cores) before it counts as a failure
)


def overrides(tmp_path: Path) -> list[str]:
    """What follows `--` on every node: the micro run, on 3 nodes instead of the experiment's 4."""
    return [
        "launch.nodes=3",
        f"out_dir={tmp_path / 'runs'}",
        "data.seq_len=64",
        "train.batch_size=4",
        "train.micro_batch_size=4",
        f"train.max_steps={STEPS}",
        f"optim.total_steps={STEPS}",
        "optim.warmup_steps=2",
        "optim.lr=3e-3",
        "train.eval_every=0",
        "eval.tokens=1024",
        "wandb.mode=disabled",
        f"distributed.inner_steps={H}",
        "distributed.poll_interval=0.2",
        # the spec's quorum (each poll's deltas make a round, averaged per delta) and no wait at a boundary:
        # the experiment's quorum of 4 would hold 3 nodes back until their final markers
        "distributed.min_deltas_per_round=0",
        "distributed.install_wait_seconds=0",
        "distributed.startup_timeout=480",  # a worker waits for the master's first global
    ]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env |= {
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_TOKEN": TOKEN,  # exported on every node, as the README says; a shared directory ignores it
    }
    return env | extra


def launch_nodes(tmp_path: Path, repo_id: str, env: dict[str, str]) -> float:
    """The three README commands (workers first: they wait for the master's first global); all exit 0."""
    procs = []
    for shard, (role, node_id) in reversed(list(enumerate(NODES))):
        cmd = [
            str(LAUNCH),
            "--experiment",
            EXPERIMENT,
            "--cpu",
            "--role",
            role,
            "--node-id",
            node_id,
            "--repo-id",
            repo_id,
            "--shard",
            str(shard),
            "--",
            *overrides(tmp_path),
        ]
        out = open(tmp_path / f"{node_id}.out", "w")  # noqa: SIM115 - closed below
        procs.append((node_id, subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT), out))
    return wait_for_nodes(procs, tmp_path, DEADLINE)


def replay(repo, cfg, ledger: dict) -> None:
    """The published global and momentum of a run of `cfg` (the master's config), rebuilt from the seeded
    model and the published ledger: each round's deltas averaged in ledger order, one outer step each."""
    d = cfg.distributed
    period = d.delayed_nesterov_period if d.delayed_nesterov else 1  # as startup.py hands it to the master
    state = MasterState.from_model_state(build_model(cfg.model, seed=cfg.seed).state_dict())
    entries = ledger["entries"]
    for step in range(1, ledger["outer_step"] + 1):
        deltas = [
            decode(repo.read(delta_path(e["node_id"], e["local_step"])), max_bytes=2**28)[0]
            for e in entries
            if e["status"] == "applied" and e["outer_step"] == step
        ]
        assert deltas, f"outer step {step} has no deltas in the ledger"
        state.apply_outer_step(average(deltas), d.outer_lr, d.outer_momentum, period, len(deltas))
    weights, meta = decode(repo.read(GLOBAL_WEIGHTS_PATH), max_bytes=2**28)
    assert int(meta["outer_step"]) == ledger["outer_step"]
    assert weights.keys() == state.weights.keys()
    for k, t in weights.items():
        assert torch.equal(t, state.weights[k]), k
    momentum, _ = decode(repo.read(GLOBAL_MOMENTUM_PATH), max_bytes=2**28)
    for k, t in state.momentum.items():
        assert torch.equal(momentum[f"momentum/{k}"], t), k


def check_repository(repo, cfg, node_ids: list[str], steps: int) -> dict:
    """Every delta in the repository applied exactly once, every node's final marker "finished" naming its
    last delta (applied), and the published global and momentum replayed from the ledger; the ledger."""
    ledger = json.loads(repo.read(GLOBAL_LEDGER_PATH))
    entries = ledger["entries"]
    assert [e for e in entries if e["status"] != "applied"] == []
    applied = [(e["node_id"], e["local_step"]) for e in entries]
    assert len(applied) == len(set(applied)), "a delta was applied twice"
    files = [f.path for f in repo.list("nodes")]
    in_repo = {parse_delta_path(p) for p in files if p.endswith(".safetensors")}
    assert set(applied) == in_repo, (
        f"never applied: {in_repo - set(applied)}, not in the repo: {set(applied) - in_repo}"
    )
    assert {n for n, _ in in_repo} == set(node_ids)
    for node_id in node_ids:
        final = json.loads(repo.read(f"nodes/{node_id}/final.json"))
        assert final["state"] == "finished" and final["last_local_step"] == steps, final
        ours = [e for e in entries if (e["node_id"], e["local_step"]) == (node_id, steps)]
        assert [e["sha256"] for e in ours] == [final["last_delta_sha256"]], (final, ours)
    replay(repo, cfg, ledger)
    return ledger


def check_run(repo, tmp_path: Path) -> dict:
    cfg = compose_cfg([f"experiment={EXPERIMENT}", *overrides(tmp_path)])
    ledger = check_repository(repo, cfg, [n for _, n in NODES], STEPS)
    runs = tmp_path / "runs"
    summaries = {n: json.loads((runs / f"{RUN_NAME}-{n}" / "summary.json").read_text()) for _, n in NODES}
    for node_id, s in summaries.items():
        assert s["status"] == "completed" and s["step"] == STEPS, (node_id, s["status"], s["step"])
        assert s["dumb_diloco/final_delta"].startswith("applied at outer step"), s["dumb_diloco/final_delta"]
    assert summaries["node-0"]["dumb_diloco/final_left"] == ""
    for shard, (_, node_id) in enumerate(NODES):  # the launcher's log: its command, then the run's output
        log = (runs / f"{RUN_NAME}-{node_id}" / f"launch-node{shard}.log").read_text()
        first = log.splitlines()[0]
        assert f"distributed.node_id={node_id}" in first and f"data.shard={shard}" in first
        assert "data.num_shards=3" in first
    return {"deltas": len(ledger["entries"]), "outer_steps": ledger["outer_step"]}


def assert_token_written_nowhere(tmp_path: Path) -> None:
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "launch-node0.log" for p in written) and any(
        p.name == "config.yaml" for p in written
    )
    leaked = [str(p) for p in written if TOKEN.encode() in p.read_bytes()]
    assert leaked == [], leaked


@pytest.mark.timeout(600)
def test_readme_commands_over_the_loopback_hub(tmp_path):
    from diloco.testing.hub_server import HubServer

    with HubServer(token=TOKEN) as server:  # refuses any request without HF_TOKEN's value
        seconds = launch_nodes(tmp_path, "launch-org/dumb-tiny", _env(tmp_path, HF_ENDPOINT=server.url))
        hub = HubTransport("launch-org/dumb-tiny", token=TOKEN, endpoint=server.url, create=False)
        r = check_run(hub, tmp_path)
        assert server.unknown == [], server.unknown  # no call the loopback Hub does not model
    assert_token_written_nowhere(tmp_path)
    print(f"\n[launch_node.sh, hub] {seconds:.1f}s, {r['deltas']} deltas, {r['outer_steps']} outer steps")


@pytest.mark.timeout(600)
def test_readme_commands_over_a_shared_directory(tmp_path):
    repo = tmp_path / "shared" / "dumb-tiny"
    seconds = launch_nodes(tmp_path, str(repo), _env(tmp_path))
    r = check_run(DirectoryTransport(repo, create=False), tmp_path)
    assert_token_written_nowhere(tmp_path)
    print(
        f"\n[launch_node.sh, directory] {seconds:.1f}s, {r['deltas']} deltas, {r['outer_steps']} outer steps"
    )

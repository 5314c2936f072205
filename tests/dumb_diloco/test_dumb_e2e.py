"""DumbDiLoCo end to end: a master and two workers as separate `python -m diloco.train` processes on the
micro model, over a shared directory and over the loopback Hub (real huggingface_hub client, HF_TOKEN
checked by the server), with v1 (synchronous) and v2 (background upload/poll) transport.

Checks, from the repository, the master's state and the nodes' logs: outer steps advanced, every
delta in the repository was applied exactly once (with the default drain: the master keeps aggregating
until every node's final marker names an applied delta), each worker's summary says its final delta was
applied, the workers installed globals newer than the first, and the final global model evaluates
better than the initial one.

Each node is `python -m diloco.train` run through this file (`python tests/dumb_diloco/test_dumb_e2e.py <dir>
<overrides>`), which adds one rendezvous so that no check depends on how fast the processes run: a
worker takes its last boundary only once a global newer than the first is published and fetched, so
that boundary installs it. Nothing waits for the master's end: the master may finish first, last or
in between, and the drain must still find every delta.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mp_utils import wait_for_nodes
from trainer_utils import compose_cfg

from diloco.dumb_diloco.store.transport import DirectoryTransport, HubTransport
from diloco.dumb_diloco.wire.repo_paths import GLOBAL_STEP_PATH, GLOBAL_WEIGHTS_PATH, parse_delta_path
from diloco.dumb_diloco.wire.tensor_format import decode

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_network")]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_E2eFakeTokenNeverLogged0123456789"
STEPS, H = 30, 5
NODES = [("master", "master-1"), ("worker", "worker-1"), ("worker", "worker-2")]
COMMON = [
    "model=micro",
    "data=sample",
    "data.seq_len=64",
    "train.batch_size=4",
    "train.micro_batch_size=4",
    "train.log_every=10",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.progress=false",
    "eval.tokens=1024",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    f"optim.total_steps={STEPS}",
    f"train.max_steps={STEPS}",
    "device=cpu",
    "wandb.mode=disabled",
    "distributed=dumb_diloco",
    f"distributed.inner_steps={H}",
    "distributed.poll_interval=0.2",
    # The spec's quorum 0: each poll's deltas make an outer step, and which deltas a poll finds depends on the
    # processes' timing. Outer lr 1/3 without momentum makes the updates' sum the same however the deltas
    # group (3 nodes: each delta's third, i.e. plain averaging per round of all three), so the check that
    # the final global beats the initial one does not depend on timing. With 0.7/0.3 it failed in one of two
    # fresh-clone suites run side by side (final loss 7.13 against 6.96; the published global replayed exactly).
    "distributed.outer_lr=0.3333333",
    "distributed.outer_momentum=0.0",
    "distributed.startup_timeout=240",
    "distributed.shutdown_timeout=120",
]
DEADLINE = 240  # s: the longest a node or a rendezvous may take before it counts as a failure


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env |= {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # this file runs as each node's script: its imports (mp_utils, trainer_utils) live in tests/
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")])),
    }
    return env | extra


def run_nodes(tmp_path: Path, repo_id: str, mode: str, env: dict[str, str], timeout: float = DEADLINE):
    """Start the three nodes (workers first: they wait for the master's first global); wait for all."""
    asyncio = "true" if mode == "v2" else "false"
    procs = []
    for i, (role, node_id) in reversed(list(enumerate(NODES))):
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            str(tmp_path),
            *COMMON,
            f"distributed.role={role}",
            f"distributed.node_id={node_id}",
            f"distributed.repo_id={repo_id}",
            f"distributed.async_delta_upload={asyncio}",
            f"distributed.async_global_poll={asyncio}",
            f"distributed.state_dir={tmp_path / 'state'}",
            f"data.shard={i}",
            f"data.num_shards={len(NODES)}",
            f"out_dir={tmp_path / 'runs'}",
            f"run_name={node_id}",
        ]
        log = open(tmp_path / f"{node_id}.out", "w")
        procs.append(
            (node_id, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)
        )
    return wait_for_nodes(procs, tmp_path, timeout)  # the workers, then the master


_EVAL: dict = {}


@torch.no_grad()
def eval_loss(state: dict[str, torch.Tensor] | None) -> float:
    """Held-out loss of the initial global (state None: the master's seeded model) or of `state`."""
    from diloco.data import eval_batches, load_tokenizer
    from diloco.model import build_model
    from diloco.train import evaluate

    if not _EVAL:
        cfg = compose_cfg(COMMON)
        _EVAL["model"] = build_model(cfg.model, seed=cfg.seed)  # the master's seeded model
        _EVAL["initial"] = {k: t.clone() for k, t in _EVAL["model"].state_dict().items()}
        _EVAL["batches"] = eval_batches(cfg.data, load_tokenizer(cfg.data.tokenizer), 4096, 4)
    model = _EVAL["model"]
    model.load_state_dict(_EVAL["initial"] if state is None else state)
    return evaluate(model, _EVAL["batches"], torch.device("cpu"), torch.autocast("cpu", enabled=False))


def check_run(tmp_path: Path, transport) -> dict:
    # outer steps advanced
    info = json.loads(transport.read(GLOBAL_STEP_PATH))
    assert info["outer_step"] >= 2, info
    # every delta in the repository was applied exactly once (master ledger, and the master's log)
    files = [f.path for f in transport.list("nodes")]
    assert sorted(p for p in files if p.endswith("/final.json")) == sorted(
        f"nodes/{n}/final.json" for _, n in NODES
    )
    deltas = {parse_delta_path(p) for p in files if not p.endswith("/final.json")}
    per_node = {n: sorted(s for m, s in deltas if m == n) for _, n in NODES}
    for node, steps in per_node.items():
        assert steps and set(steps) <= set(range(H, STEPS + 1, H)), (node, steps)
    state = json.loads((tmp_path / "state" / "master-1" / "master_state.json").read_text())
    applied = [(e["node_id"], e["local_step"]) for e in state["ledger"] if e["status"] == "applied"]
    assert sorted(applied) == sorted(deltas), "ledger and repository disagree"
    assert not [e for e in state["ledger"] if e["status"] != "applied"]
    master_log = (tmp_path / "runs" / "master-1" / "train.log").read_text()
    logged = [int(n) for n in re.findall(r"outer step \d+ from (\d+) delta", master_log)]
    assert sum(logged) == len(deltas) and len(logged) == info["outer_step"] == state["outer_step"]
    # the workers installed globals newer than the first one
    for _, node in NODES[1:]:
        text = (tmp_path / "runs" / node / "train.log").read_text()
        installed = [int(k) for k in re.findall(r"installed global outer step (\d+)", text)]
        assert max(installed) >= 1, (node, installed)
    # the final global beats the initial one on held-out data
    tensors, meta = decode(transport.read(GLOBAL_WEIGHTS_PATH), max_bytes=2**28)
    assert int(meta["outer_step"]) == info["outer_step"]
    initial, final = eval_loss(None), eval_loss(tensors)
    assert final < initial - 0.05, (initial, final)
    summaries = {n: json.loads((tmp_path / "runs" / n / "summary.json").read_text()) for _, n in NODES}
    for s in summaries.values():
        assert s["status"] == "completed" and s["comm/uploads"] >= 1 and s["comm/total_bytes"] > 0
        assert s["dumb_diloco/final_delta"].startswith("applied at outer step"), s["dumb_diloco/final_delta"]
    assert summaries["master-1"]["dumb_diloco/final_left"] == ""  # every node's final delta was applied
    return {
        "deltas": len(deltas),
        "outer_steps": info["outer_step"],
        "initial": initial,
        "final": final,
        "summaries": summaries,
    }


def _report(name: str, seconds: float, r: dict) -> None:
    stall = {n: round(s["comm/boundary_stall_seconds_mean"], 4) for n, s in r["summaries"].items()}
    print(
        f"\n[{name}] {seconds:.1f}s, {r['deltas']} deltas, {r['outer_steps']} outer steps, eval loss "
        f"{r['initial']:.3f} -> {r['final']:.3f}, delta bytes {r['summaries']['worker-1']['comm/delta_bytes']}, "
        f"mean boundary stall {stall}, skipped {[s['comm/skipped_boundaries'] for s in r['summaries'].values()]}"
    )


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_master_and_two_workers_over_a_shared_directory(tmp_path, mode):
    seconds = run_nodes(tmp_path, str(tmp_path / "repo"), mode, _env())
    r = check_run(tmp_path, DirectoryTransport(tmp_path / "repo", create=False))
    _report(f"directory {mode}", seconds, r)


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_master_and_two_workers_over_the_hub(tmp_path, mode):
    from diloco.testing.hub_server import HubServer

    with HubServer(token=TOKEN) as server:  # refuses any request without HF_TOKEN's value
        env = _env(HF_ENDPOINT=server.url, HF_TOKEN=TOKEN, HF_HOME=str(tmp_path / "hf_home"))
        seconds = run_nodes(tmp_path, "e2e-org/run", mode, env)
        hub = HubTransport("e2e-org/run", token=TOKEN, endpoint=server.url, create=False)
        r = check_run(tmp_path, hub)
        assert server.unknown == [], server.unknown  # the client made no call the loopback Hub does not model
        commits = server.counts["commit"]
    _report(f"hub {mode} ({commits} commits)", seconds, r)
    for path in tmp_path.rglob("*"):  # the token is in no log, config, summary or state file
        if path.is_file() and "hf_home" not in path.parts:
            assert TOKEN.encode() not in path.read_bytes(), path


# ----------------------------------------------------------------------------------- the node processes


def _wait_for(pred, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"e2e rendezvous: timed out waiting for {what}")
        time.sleep(0.05)


def _published_step(transport) -> int:
    from diloco.dumb_diloco.store.transport import RemoteNotFound

    try:
        return json.loads(transport.read(GLOBAL_STEP_PATH))["outer_step"]
    except RemoteNotFound:
        return -1


def _run_node(rendezvous: Path, overrides: list[str]) -> None:
    """`python -m diloco.train <overrides>`, with the module docstring's rendezvous."""
    import runpy

    from diloco.dumb_diloco.node.strategy import DumbDiLoCo

    on_step = DumbDiLoCo.on_step

    def on_step_installing_at_the_end(self, local_step):
        if local_step == STEPS and not self.s.is_master and self.installer.outer_step < 1:
            # The last boundary installs a staged global newer than the first one. Stage it: wait for one
            # in the repository, for the upload in flight (a busy uploader would skip the boundary), and
            # for a poll that started after it was published (v2; v1 polls at the boundary itself).
            _wait_for(lambda: _published_step(self.transport) >= 1, "the master's outer step 1")
            _wait_for(lambda: not self.uploader.uploading, "the upload in flight")
            if self.s.async_global_poll:
                _wait_for(lambda: not self.poller.in_flight, "the poll in flight")
                assert self.poll()
                _wait_for(lambda: not self.poller.in_flight, "a poll of the newer global")
        return on_step(self, local_step)

    DumbDiLoCo.on_step = on_step_installing_at_the_end
    sys.argv = [sys.argv[0], *overrides]
    runpy.run_module("diloco.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _run_node(Path(sys.argv[1]), sys.argv[2:])

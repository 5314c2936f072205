"""A DumbDiLoCo node of several ranks (issue 16): DDP inside the node, rank 0 alone talks to the store, and
a global reaches every rank at the same step. Equal to a node of one rank with the same per-step batch,
over 3 boundaries with an install between them; ranks bit-identical; one uploader.

The functions without `test_` run inside the spawned gloo ranks (tests/mp_utils.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mp_utils import run_ranks

from diloco.dumb_diloco.wire.repo_paths import delta_path
from diloco.dumb_diloco.wire.tensor_format import decode

pytestmark = pytest.mark.usefixtures("no_network")

STEPS, H, BATCH, MICRO = 9, 3, 8, 2  # 3 boundaries; a global is published after the first one


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(4, 64), torch.nn.Linear(64, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 4, generator=g)
    return x, torch.sin(x[:, :2])


def new_global(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The global the test's "master" publishes after the first boundary: fixed, whoever computes it."""
    g = torch.Generator().manual_seed(7)
    return {k: t.detach() + 0.01 * torch.randn(t.shape, generator=g) for k, t in model.state_dict().items()}


def node_settings(repo: str, state_dir: str):
    from dumb_helpers import settings

    return settings(repo, node_id="n", inner_steps=H, reset_inner_optimizer=True, state_dir=state_dir)


def train(strategy, model, opt, repo: str, part: int, parts: int, is_rank0: bool) -> None:
    """The trainer's loop, shrunk: this rank takes rows part/parts of the node's batch, in micro-batches
    with gradient accumulation; after step H+1, rank 0 (standing for the master) publishes outer step 1."""
    from dumb_helpers import publish

    from diloco.dumb_diloco.store.transport import DirectoryTransport

    train_model = strategy.wrap(model)
    strategy.start()
    for step in range(1, STEPS + 1):
        x, y = (t.chunk(parts)[part] for t in batch(step))
        chunks = list(zip(x.split(MICRO), y.split(MICRO)))
        for i, (xb, yb) in enumerate(chunks):
            with strategy.grad_sync(last_micro_step=i == len(chunks) - 1):
                (torch.nn.functional.mse_loss(train_model(xb), yb) / len(chunks)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        strategy.after_inner_step(step)
        if step == H + 1 and is_rank0:
            publish(DirectoryTransport(repo, create=False), new_global(Net()), 1)
    strategy.close()


def node_rank(repo: str, state_dir: str) -> dict:
    """One rank of a node of WORLD_SIZE ranks (runs in a spawned process)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch.distributed as dist

    from diloco.distributed import DataParallel, DistContext
    from diloco.dumb_diloco.node.ranks import NodeRanks
    from diloco.dumb_diloco.node.strategy import DumbDiLoCo

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = DistContext(rank, world, rank, ranks_per_worker=world)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    s = node_settings(repo, state_dir)
    leader = DumbDiLoCo(model, s, optimizer=opt) if rank == 0 else None
    strategy = NodeRanks(ctx, model, opt, DataParallel(ctx, model), leader, s, 1)
    train(strategy, model, opt, repo, rank, world, rank == 0)
    out = {"weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
    if leader is not None:
        out |= {
            "installs": leader.counters.installs,
            "uploads": leader.counters.uploads,
            "outer_step": leader.installer.outer_step,
        }
    return out


def start_repo(path: Path) -> str:
    from dumb_helpers import publish

    from diloco.dumb_diloco.store.transport import DirectoryTransport

    publish(DirectoryTransport(path), Net().state_dict(), 0)
    return str(path)


def deltas(repo: str) -> list[dict[str, torch.Tensor]]:
    from diloco.dumb_diloco.store.transport import DirectoryTransport

    t = DirectoryTransport(repo, create=False)
    return [decode(t.read(delta_path("n", s)), max_bytes=2**24)[0] for s in range(H, STEPS + 1, H)]


@pytest.mark.slow
def test_a_node_of_two_ranks_uploads_the_deltas_of_a_node_of_one_rank(tmp_path):
    from diloco.dumb_diloco.node.strategy import DumbDiLoCo

    one = start_repo(tmp_path / "one")
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    alone = DumbDiLoCo(model, node_settings(one, str(tmp_path / "state1")), optimizer=opt)
    train(alone, model, opt, one, 0, 1, True)
    assert (
        alone.installer.outer_step == 1 and alone.counters.uploads == 3
    )  # the global of step H+1 was installed

    two = start_repo(tmp_path / "two")
    ranks = run_ranks("test_dumb_ranks:node_rank", 2, repo=two, state_dir=str(tmp_path / "state2"))
    assert ranks[0]["outer_step"] == 1 and ranks[0]["installs"] == alone.counters.installs
    assert ranks[0]["uploads"] == 3  # one uploader: rank 1 never had a store
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])  # identical after the install and after
    for want, got in zip(deltas(one), deltas(two), strict=True):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(ranks[0]["weights"], final, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ whole nodes: torchrun, the trainer


def _torchrun(role: str, node_id: str, shard: int, repo_id: str, tmp_path: Path, env: dict, extra=()):
    import subprocess

    from mp_utils import QUIET_ENV, ROOT, TORCHRUN_TRAIN_2
    from trainer_utils import SMALL

    cmd = [
        *TORCHRUN_TRAIN_2,
        *SMALL,
        "train.max_steps=20",
        "train.log_every=5",
        "eval.tokens=1024",
        "distributed=dumb_diloco",
        "distributed.inner_steps=5",
        "distributed.poll_interval=0.2",
        "distributed.outer_momentum=0.3",
        "distributed.min_deltas_per_round=2",
        "distributed.startup_timeout=240",
        "distributed.shutdown_timeout=120",
        "distributed.drain_timeout=240",
        f"distributed.role={role}",
        f"distributed.node_id={node_id}",
        f"distributed.repo_id={repo_id}",
        f"distributed.state_dir={tmp_path / 'state'}",
        f"data.shard={shard}",
        "data.num_shards=2",
        f"out_dir={tmp_path / 'runs'}",
        f"run_name={node_id}",
        *extra,
    ]
    log = open(tmp_path / f"{node_id}.out", "w")  # noqa: SIM115 - closed by the caller's wait
    env = {**env, **QUIET_ENV}
    if "HF_ENDPOINT" in env:  # the loopback Hub is the one place this test reaches
        env.pop("HF_HUB_OFFLINE")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", "hub"])
def test_a_master_node_and_a_worker_node_of_two_ranks_each(tmp_path, kind):
    """Two torchrun jobs of 2 gloo ranks each, `python -m diloco.train` as the launcher starts them: every
    delta applied exactly once, both ranks of each node identical after every boundary (their checkpoints), one
    uploader per node (the Hub's commits of each node's deltas = its delta files = its uploads)."""
    import json
    import os

    from diloco.dumb_diloco.store.transport import DirectoryTransport, HubTransport
    from diloco.dumb_diloco.wire.repo_paths import parse_delta_path

    token = "hf_NodeRanksTestToken0123456789"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    server = None
    if kind == "hub":
        from diloco.testing.hub_server import HubServer

        server = HubServer(token=token).start()
        env |= {"HF_ENDPOINT": server.url, "HF_TOKEN": token, "HF_HOME": str(tmp_path / "hf_home")}
    repo_id = "ranks-org/run" if kind == "hub" else str(tmp_path / "repo")
    try:
        every = ["train.checkpoint_every=5", "train.keep_checkpoints=10"]  # after each boundary's install
        procs = [_torchrun("worker", "worker-1", 1, repo_id, tmp_path, env, every)]
        procs.append(_torchrun("master", "master-1", 0, repo_id, tmp_path, env, every))
        for p, node in zip(procs, ("worker-1", "master-1")):
            p.wait(timeout=600)
            assert p.returncode == 0, (tmp_path / f"{node}.out").read_text()[-4000:]
        if kind == "hub":
            repo = HubTransport(repo_id, token=token, endpoint=server.url, create=False)
            commits = [c.title for c in server.repos[repo_id].commits.values()]
        else:
            repo = DirectoryTransport(repo_id, create=False)
        files = [f.path for f in repo.list("nodes") if f.path.endswith(".safetensors")]
    finally:
        if server is not None:
            server.stop()
    deltas = sorted(parse_delta_path(p) for p in files)
    state = json.loads((tmp_path / "state" / "master-1" / "master_state.json").read_text())
    applied = sorted((e["node_id"], e["local_step"]) for e in state["ledger"] if e["status"] == "applied")
    assert applied == deltas  # every delta applied exactly once
    for node in ("worker-1", "master-1"):
        run = tmp_path / "runs" / node
        summary = json.loads((run / "summary.json").read_text())
        assert summary["dumb_diloco/ranks_per_node"] == 2 and summary["world_size"] == 2
        # 4 boundaries, an upload each unless the previous one was still in flight (a loaded machine, the
        # Hub): then that boundary is skipped and its steps go into the next delta, or into the final one
        # that the end of the run sends; the last delta ends at step 20 either way
        mine = [step for n, step in deltas if n == node]
        assert summary["comm/boundaries"] == 4 and mine[-1] == 20, (node, mine)
        assert summary["comm/uploads"] == len(mine) and summary["comm/upload_failures"] == 0, (node, mine)
        assert summary["dumb_diloco/final_delta"].startswith("applied at outer step")
        steps = sorted((run / "checkpoints").glob("step_*"))
        assert [d.name for d in steps] == [f"step_{s:08d}" for s in (5, 10, 15, 20)]
        for d in steps:  # both ranks identical after every boundary (and its install)
            w0, w1 = (torch.load(d / f"rank{r}.pt", weights_only=True)["model"] for r in (0, 1))
            assert all(torch.equal(w0[k], w1[k]) for k in w0), (node, d.name)
        if kind == "hub":
            assert sum(t.startswith(f"{node}: delta at local step") for t in commits) == len(mine), commits


def _rank_pid(agent_pid: int, local_rank: int) -> int | None:
    """The pid of torchrun's child with LOCAL_RANK=local_rank (from /proc; None until it exists)."""
    for task in Path(f"/proc/{agent_pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"LOCAL_RANK={local_rank}".encode() in env:
                return int(child)
    return None


@pytest.mark.alone  # a bound in seconds: run with the machine to itself (issue 54)
@pytest.mark.slow
def test_killing_one_rank_stops_the_node_and_a_restart_resumes_exactly(tmp_path):
    """A worker node of 2 ranks training alone on a repository that holds its starting global (no master:
    nothing arrives from outside, so its deltas depend on the node only). Killing its rank 1 stops the
    node, with torchrun's report naming the rank; the same command resumes from the last checkpoint and
    uploads exactly the deltas of an uninterrupted node."""
    import os
    import signal
    import time

    from dumb_helpers import publish
    from trainer_utils import SMALL, compose_cfg

    from diloco import checkpoint
    from diloco.dumb_diloco.store.transport import DirectoryTransport
    from diloco.model import build_model

    cfg = compose_cfg([*SMALL, "distributed=dumb_diloco"])
    initial = build_model(cfg.model, seed=cfg.seed).state_dict()
    extra = ["train.checkpoint_every=5", "distributed.shutdown_timeout=2", "distributed.timeout_seconds=60"]
    runs = {}
    for name in ("whole", "killed"):
        (tmp_path / name).mkdir()
        publish(DirectoryTransport(tmp_path / name / "repo"), initial, 0)
        runs[name] = lambda name=name: _torchrun(
            "worker", "w", 0, str(tmp_path / name / "repo"), tmp_path / name, dict(os.environ), extra
        )
    whole = runs["whole"]()
    assert whole.wait(timeout=280) == 0, (tmp_path / "whole" / "w.out").read_text()[-3000:]

    node = runs["killed"]()
    run_dir, repo = tmp_path / "killed" / "runs" / "w", tmp_path / "killed" / "repo"
    deadline = time.monotonic() + 240
    while not (checkpoint.latest(run_dir) and (repo / "nodes" / "w" / "delta_10.safetensors").exists()):
        assert node.poll() is None and time.monotonic() < deadline, "no checkpoint at step 10"
        time.sleep(0.05)
    os.kill(_rank_pid(node.pid, 1), signal.SIGKILL)
    killed_at = time.monotonic()
    code = node.wait(timeout=120)
    out = (tmp_path / "killed" / "w.out").read_text()
    assert code != 0 and time.monotonic() - killed_at < 60, out[-3000:]  # within timeout_seconds
    assert "local_rank: 1" in out and "exitcode: -9" in out, out[-3000:]  # torchrun names the dead rank
    assert checkpoint.latest(run_dir) is not None and checkpoint.latest(run_dir).name < "step_00000020"

    resumed = runs["killed"]()
    assert resumed.wait(timeout=280) == 0, (tmp_path / "killed" / "w.out").read_text()[-3000:]
    assert "resum" in (run_dir / "train.log").read_text().lower()
    for step in (5, 10, 15, 20):
        path = Path("repo") / "nodes" / "w" / f"delta_{step}.safetensors"
        want, got = (
            decode((tmp_path / n / path).read_bytes(), max_bytes=2**24)[0] for n in ("whole", "killed")
        )
        assert all(torch.equal(want[k], got[k]) for k in want), step


def ranks_that_disagree(repo: str, state_dir: str) -> str:
    """A node whose rank 1's weights drift from rank 0's (a bug, a bit flip): the check names it."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch.distributed as dist

    from diloco.distributed import DataParallel, DistContext, DistributedError
    from diloco.dumb_diloco.node.ranks import NodeRanks
    from diloco.dumb_diloco.node.strategy import DumbDiLoCo

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ctx = DistContext(rank, 2, rank, ranks_per_worker=2)
    model = Net()
    s = node_settings(repo, state_dir)
    leader = DumbDiLoCo(model, s) if rank == 0 else None
    strategy = NodeRanks(ctx, model, None, DataParallel(ctx, model), leader, s, 1)
    strategy.start()
    if rank == 1:
        with torch.no_grad():
            model.fc1.bias.add_(1e-3)
    try:
        strategy.check_same_weights("at the end")
    except DistributedError as err:
        return str(err)
    finally:
        strategy.close()
    return ""


@pytest.mark.slow
def test_a_node_whose_ranks_disagree_stops_with_one_line(tmp_path):
    repo = start_repo(tmp_path / "repo")
    errors = run_ranks("test_dumb_ranks:ranks_that_disagree", 2, repo=repo, state_dir=str(tmp_path / "state"))
    assert errors == ["node n: the weights of ranks [1] differ from rank 0's at the end (SHA-256)"] * 2

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

from diloco.dumb_diloco.tensor_format import decode, delta_path

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

    from diloco.dumb_diloco.transport import DirectoryTransport

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

    sys.path.insert(0, str(Path(__file__).parent))
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from diloco.distributed import DataParallel, DistContext
    from diloco.dumb_diloco.ranks import NodeRanks
    from diloco.dumb_diloco.strategy import DumbDiLoCo

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = DistContext(rank, world, rank, ranks_per_worker=world)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    s = node_settings(repo, state_dir)
    leader = DumbDiLoCo(model, s, optimizer=opt) if rank == 0 else None
    strategy = NodeRanks(ctx, model, opt, DataParallel(OmegaConf.create({}), ctx, model), leader, s, 1)
    train(strategy, model, opt, repo, rank, world, rank == 0)
    out = {"weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
    if leader is not None:
        out |= {
            "installs": leader.installs,
            "uploads": leader.uploads,
            "outer_step": leader.installed_outer_step,
        }
    return out


def start_repo(path: Path) -> str:
    from dumb_helpers import publish

    from diloco.dumb_diloco.transport import DirectoryTransport

    publish(DirectoryTransport(path), Net().state_dict(), 0)
    return str(path)


def deltas(repo: str) -> list[dict[str, torch.Tensor]]:
    from diloco.dumb_diloco.transport import DirectoryTransport

    t = DirectoryTransport(repo, create=False)
    return [decode(t.read(delta_path("n", s)), max_bytes=2**24)[0] for s in range(H, STEPS + 1, H)]


@pytest.mark.slow
def test_a_node_of_two_ranks_uploads_the_deltas_of_a_node_of_one_rank(tmp_path):
    from diloco.dumb_diloco.strategy import DumbDiLoCo

    one = start_repo(tmp_path / "one")
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    alone = DumbDiLoCo(model, node_settings(one, str(tmp_path / "state1")), optimizer=opt)
    train(alone, model, opt, one, 0, 1, True)
    assert alone.installed_outer_step == 1 and alone.uploads == 3  # the global of step H+1 was installed

    two = start_repo(tmp_path / "two")
    ranks = run_ranks("test_dumb_ranks:node_rank", 2, repo=two, state_dir=str(tmp_path / "state2"))
    assert ranks[0]["outer_step"] == 1 and ranks[0]["installs"] == alone.installs
    assert ranks[0]["uploads"] == 3  # one uploader: rank 1 never had a store
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])  # identical after the install and after
    for want, got in zip(deltas(one), deltas(two), strict=True):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(ranks[0]["weights"], final, rtol=1e-5, atol=1e-6)

"""Translate on install (issue 12; src/diloco/dumb_diloco/node/install.py): a node keeps its own progress on
top of the global it installs. Two exact properties:

- installing with zero delay is synchronous DiLoCo (torch's SGD with Nesterov on the averaged
  pseudo-gradients), to float32 round-off (the specification's `replace` too: at zero delay there is
  no progress to lose);
- with one node and an outer step that applies its delta as it is (lr 1, no momentum), every step of
  progress lands in the global exactly once, whatever the installs' timing and a failed upload: the node
  trains as if alone, and the final global is its weights. `replace` fails this: it installs globals
  that miss the node's latest progress, which its next delta then counts on top of the wrong base.

Lock step in one process, no threads (v1 upload and poll), no clock.
"""

from __future__ import annotations

import pytest
import torch
from dumb_helpers import FakeClock, Spy, make_loop, publish, settings

from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.store.transport import DirectoryTransport

pytestmark = pytest.mark.usefixtures("no_network")
H = 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(4, 16), torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def inner_step(model, opt, node: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * node + step)
    x = torch.randn(8, 4, generator=g)
    torch.nn.functional.mse_loss(model(x), torch.sin(x[:, :2] * (node + 1))).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def nodes_and_master(tmp_path, n: int, lr: float, mu: float, transport=None, node_kw=None, **kw):
    repo = DirectoryTransport(tmp_path / "repo")
    publish(repo, Net().state_dict(), 0)
    loop, _ = make_loop(repo, Net().state_dict(), lr=lr, momentum=mu, min_deltas_per_round=n)
    nodes = []
    for i in range(n):
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        s = settings(tmp_path / "repo", node_id=f"w{i}", inner_steps=H, reset_inner_optimizer=False, **kw)
        node = DumbDiLoCo(model, s, transport or repo, optimizer=opt, **(node_kw or {}))
        node.start()
        nodes.append((node, model, opt))
    return loop, nodes


@pytest.mark.parametrize("install", ["translate", "replace"])
def test_translate_with_zero_install_delay_is_synchronous_diloco(tmp_path, install):
    lr, mu, rounds = 0.7, 0.9, 4
    loop, nodes = nodes_and_master(tmp_path, 2, lr, mu, install=install)
    for step in range(1, rounds * H + 1):
        for i, (node, model, opt) in enumerate(nodes):
            inner_step(model, opt, i, step)
            node.on_step(step)
        if step % H == 0:  # every node uploaded; the master's round; every node installs it at once
            assert loop.run_once().applied
            for node, _, _ in nodes:
                node.stage(loop.snapshot())
                assert node.install_staged()

    for _, model, _ in nodes:
        torch.testing.assert_close(
            flat(model), synchronous_diloco(len(nodes), lr, mu, rounds), rtol=1e-5, atol=1e-6
        )


def synchronous_diloco(n: int, lr: float, mu: float, rounds: int) -> torch.Tensor:
    """Synchronous DiLoCo by hand: the same workers, the mean pseudo-gradient, torch's SGD with Nesterov."""
    global_ = [p.detach().clone() for p in Net().parameters()]
    outer = torch.optim.SGD(global_, lr=lr, momentum=mu, nesterov=True)
    workers = [Net() for _ in range(n)]
    opts = [torch.optim.AdamW(w.parameters(), lr=1e-2) for w in workers]
    for step in range(1, rounds * H + 1):
        for i, (w, o) in enumerate(zip(workers, opts)):
            inner_step(w, o, i, step)
        if step % H == 0:
            for g, *ps in zip(global_, *(w.parameters() for w in workers)):
                g.grad = torch.stack([g - p.detach() for p in ps]).mean(0)
            outer.step()
            with torch.no_grad():
                for w in workers:
                    for p, g in zip(w.parameters(), global_):
                        p.copy_(g)
    return torch.cat([g.reshape(-1) for g in global_])


def test_nodes_that_wait_for_their_round_make_synchronous_diloco(tmp_path):
    """install_wait_seconds: at its boundary each node waits for the global that includes its delta, while
    the world moves (the other node reaches its boundary, the master runs its rounds); no install is driven
    by hand, and the run is synchronous DiLoCo to float32 round-off."""
    lr, mu, rounds, clock, later = 0.7, 0.9, 4, FakeClock(), []

    def world(seconds: float) -> None:  # a node's sleep while it waits
        clock.advance(seconds)
        while later:
            later.pop(0)()
        loop.run_once()

    kw = dict(install="translate", install_when_staged=True, install_wait_seconds=30.0)
    loop, nodes = nodes_and_master(tmp_path, 2, lr, mu, node_kw=dict(clock=clock, sleep=world), **kw)
    for step in range(1, rounds * H + 1):
        for i, (_, model, opt) in enumerate(nodes):
            inner_step(model, opt, i, step)
        later.append(lambda step=step: nodes[1][0].on_step(step))  # while node 0 waits, else right after
        waited = clock()
        nodes[0][0].on_step(step)
        if later:
            later.pop()()
        assert (clock() > waited) == (step % H == 0)  # a node waits at its boundaries only
        assert [node.installer.outer_step for node, _, _ in nodes] == [step // H] * 2  # its own round's
    for _, model, _ in nodes:
        torch.testing.assert_close(flat(model), synchronous_diloco(2, lr, mu, rounds), rtol=1e-5, atol=1e-6)


def test_the_wait_is_bounded_and_a_node_alone_trains_on(tmp_path):
    clock, naps = FakeClock(), []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        clock.advance(seconds)
        loop.run_once()  # quorum 2: never a round, the other node never comes

    kw = dict(install="translate", install_when_staged=True, install_wait_seconds=2.0)
    loop, nodes = nodes_and_master(tmp_path, 2, 0.7, 0.9, node_kw=dict(clock=clock, sleep=sleep), **kw)
    node, model, opt = nodes[0]
    for step in range(1, H + 1):
        inner_step(model, opt, 0, step)
        node.on_step(step)
    assert 2.0 <= sum(naps) < 2.0 + 0.1 and node.installer.outer_step == 0 and node.counters.uploads == 1
    for step in range(H + 1, H + 3):  # it trains on; no wait between boundaries
        inner_step(model, opt, 0, step)
        node.on_step(step)
    assert sum(naps) < 2.1


@pytest.mark.parametrize("install", ["translate", "replace"])
def test_every_step_lands_in_the_global_exactly_once_whatever_the_install_timing(tmp_path, install):
    """One node; the master applies each delta as it is (lr 1, momentum 0) at odd moments (mid-round,
    stale); the node installs whatever is staged at every step (translate: mid-round; replace: at its
    boundaries); one upload fails and is carried into the next delta."""
    repo = Spy(DirectoryTransport(tmp_path / "repo"))
    kw = {"install": install, "install_when_staged": install == "translate"}
    loop, [(node, model, opt)] = nodes_and_master(tmp_path, 1, 1.0, 0.0, transport=repo, **kw)
    alone, alone_opt = Net(), None
    alone_opt = torch.optim.AdamW(alone.parameters(), lr=1e-2)
    rounds_after = {4, 5, 8, 11, 13, 16}  # master rounds, out of step with the boundaries (H=3)
    for step in range(1, 19):
        inner_step(model, opt, 0, step)
        inner_step(alone, alone_opt, 0, step)
        if step == 6:
            repo.fail_writes = 1  # the upload of delta 6 fails: its progress goes into delta 9
        node.on_step(step)
        if step in rounds_after:
            loop.run_once()
            node.stage(loop.snapshot())
    loop.run_once()  # after the last boundary (18): every delta is in
    node.stage(loop.snapshot())
    node.install_staged()
    assert node.counters.upload_failures == 1 and node.counters.uploads == 5
    final = torch.cat(
        [loop.state.weights[k].reshape(-1) for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
    )
    ok = torch.allclose(final, flat(alone), rtol=1e-5, atol=1e-6)
    ok &= torch.allclose(flat(model), flat(alone), rtol=1e-5, atol=1e-6)
    assert ok == (install == "translate"), (final - flat(alone)).abs().max()


@pytest.mark.parametrize("cap", [2, 0])
def test_a_master_down_for_many_rounds_costs_a_translating_node_no_memory_and_no_steps(tmp_path, cap):
    """max_pending_snapshots: the master makes no round for 5 of the node's boundaries. With a cap of 2
    the node holds 2 snapshots and skips the boundaries past them (their steps go into its next delta);
    without a cap it holds one per boundary. Either way every step lands in the global exactly once."""
    kw = {"install": "translate", "install_when_staged": True, "max_pending_snapshots": cap}
    loop, [(node, model, opt)] = nodes_and_master(tmp_path, 1, 1.0, 0.0, **kw)
    alone = Net()
    alone_opt = torch.optim.AdamW(alone.parameters(), lr=1e-2)
    held = []
    for step in range(1, 22):
        inner_step(model, opt, 0, step)
        inner_step(alone, alone_opt, 0, step)
        node.on_step(step)
        held.append(len(node.installer.pending_snapshots))
        if step == 16:  # the master is back: deltas 3 and 6 (capped) or 3-15 (no cap) make its round
            loop.run_once()
            node.stage(loop.snapshot())
    loop.run_once()  # the last boundary's delta (21)
    node.stage(loop.snapshot())
    node.install_staged()
    assert max(held) == (2 if cap else 5) and node.counters.skipped_boundaries == (3 if cap else 0)
    assert node.counters.uploads == (4 if cap else 7) and node.installer.pending_snapshots == {}
    final = torch.cat(
        [loop.state.weights[k].reshape(-1) for k in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
    )
    torch.testing.assert_close(final, flat(alone), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat(model), flat(alone), rtol=1e-5, atol=1e-6)

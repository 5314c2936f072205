"""Past the specification, part 2: the master's quorum (`min_deltas_per_round`), staleness in the ledger,
staleness weighting and delayed Nesterov, each against an update worked out by hand."""

from __future__ import annotations

import pytest
import torch
from dumb_helpers import Tiny, put_delta, settings

from diloco.dumb_diloco.coordinator import Coordinator, Settings
from diloco.dumb_diloco.master import MasterState, OuterLoop
from diloco.dumb_diloco.transport import DirectoryTransport

pytestmark = pytest.mark.usefixtures("no_network")

LR, MU = 0.7, 0.9
W0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
B0 = torch.tensor([0.5, -0.5])


def g(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 2), value), "b": torch.full((2,), value)}


def make_loop(tmp_path, state: MasterState | None = None, **kw) -> tuple[OuterLoop, DirectoryTransport]:
    repo = DirectoryTransport(tmp_path / "repo")
    loop = OuterLoop(repo, state or MasterState.from_model_state(Tiny().state_dict()), node_id="m",
                     outer_lr=LR, outer_momentum=MU, poll_interval=0.05, state_dir=tmp_path / "state",
                     max_file_bytes=2**20, **kw)  # fmt: skip
    loop.publish()
    return loop, repo


# ------------------------------------------------------------------ quorum


def test_quorum_waits_for_n_deltas_then_takes_one_equal_weight_step(tmp_path):
    loop, repo = make_loop(tmp_path, min_deltas_per_round=3)
    put_delta(repo, "a", 5, g(1.0))
    put_delta(repo, "b", 5, g(3.0))
    r = loop.run_once()
    assert r.applied == [] and loop.state.outer_step == 0 and loop.pending == 2
    assert torch.equal(loop.state.weights["w"], W0) and len(loop.state.ledger) == 0  # not in the ledger yet
    assert loop.run_once().applied == [] and loop.pending == 2  # listed again: not counted twice
    put_delta(repo, "c", 5, g(5.0))
    r = loop.run_once()
    assert sorted(e.node_id for e in r.applied) == ["a", "b", "c"] and r.outer_step == 1
    mean = (1.0 + 3.0 + 5.0) / 3  # one outer step, like a synchronous round of 3 workers
    assert torch.allclose(loop.state.weights["w"], W0 - LR * (mean + MU * mean), atol=1e-6)
    assert torch.allclose(loop.state.weights["b"], B0 - LR * (mean + MU * mean), atol=1e-6)
    assert loop.pending == 0 and loop.state.ledger.count("applied") == 3


def test_quorum_zero_is_the_spec_one_step_per_poll_with_a_delta(tmp_path):
    loop, repo = make_loop(tmp_path)
    put_delta(repo, "a", 5, g(1.0))
    assert loop.run_once().outer_step == 1


def test_pending_deltas_are_found_again_by_a_restarted_master(tmp_path):
    loop, repo = make_loop(tmp_path, min_deltas_per_round=2)
    put_delta(repo, "a", 5, g(1.0))
    loop.run_once()
    assert loop.pending == 1
    loop.save_state()
    # the master dies with one delta pending (in memory only): a new one finds it in the repository
    again = OuterLoop(repo, MasterState.load(tmp_path / "state"), node_id="m", outer_lr=LR, outer_momentum=MU,
                      poll_interval=0.05, state_dir=tmp_path / "state", max_file_bytes=2**20,
                      min_deltas_per_round=2)  # fmt: skip
    put_delta(repo, "b", 5, g(3.0))
    r = again.run_once()
    assert sorted(e.node_id for e in r.applied) == ["a", "b"]
    assert torch.allclose(again.state.weights["w"], W0 - LR * (2.0 + MU * 2.0), atol=1e-6)


def test_flush_and_shutdown_apply_pending_deltas_below_the_quorum(tmp_path):
    loop, repo = make_loop(tmp_path, min_deltas_per_round=4)
    put_delta(repo, "a", 5, g(1.0))
    assert loop.run_once().applied == []
    assert [e.node_id for e in loop.run_once(flush=True).applied] == ["a"]
    # through the coordinator: close() applies what is still pending
    model = Tiny()
    s = settings(tmp_path / "repo2", role="master", node_id="m", poll_interval=0.05, min_deltas_per_round=4)
    coord = Coordinator(model, s, DirectoryTransport(tmp_path / "repo2"))
    coord.start()
    put_delta(coord.transport, "x", 3, g(1.0))
    put_delta(coord.transport, "y", 3, g(2.0))
    coord.close()
    assert coord.outer.state.outer_step == 1 and coord.outer.state.ledger.count("applied") == 2
    assert MasterState.load(tmp_path / "state" / "m").outer_step == 1


def test_min_deltas_per_round_config_key():
    base = {"role": "master", "node_id": "m", "repo_id": "org/run"}
    assert Settings.from_config(base).min_deltas_per_round == 0
    assert Settings.from_config(base | {"min_deltas_per_round": 4}).min_deltas_per_round == 4
    from diloco.config import ConfigError

    with pytest.raises(ConfigError, match="min_deltas_per_round"):
        Settings.from_config(base | {"min_deltas_per_round": -1})


# ------------------------------------------------------------------ staleness in the ledger


def test_staleness_is_recorded_for_every_delta(tmp_path):
    loop, repo = make_loop(tmp_path)
    put_delta(repo, "a", 5, g(1.0), base=0)
    loop.run_once()  # step 0 -> 1
    put_delta(repo, "a", 10, g(1.0), base=1)
    put_delta(repo, "b", 5, g(1.0), base=0)
    put_delta(repo, "c", 5, {"w": torch.zeros(3)}, base=0)  # rejected: wrong shape
    loop.run_once()  # step 1 -> 2
    st = {(e.node_id, e.local_step): (e.status, e.staleness) for e in loop.state.ledger.entries()}
    assert st == {("a", 5): ("applied", 0), ("a", 10): ("applied", 0), ("b", 5): ("applied", 1),
                  ("c", 5): ("rejected", 1)}  # fmt: skip

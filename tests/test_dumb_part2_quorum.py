"""Past the specification, part 2: the master's quorum (`min_deltas_per_round`), staleness in the ledger,
staleness weighting and delayed Nesterov, each against an update worked out by hand."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from dumb_helpers import B0, LR, MU, W0, Spy, Tiny, g, make_loop, put_delta, settings

from diloco.dumb_diloco.master.intake import final_marker_path
from diloco.dumb_diloco.master.recovery import MasterState
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import Settings
from diloco.dumb_diloco.store.transport import DirectoryTransport

pytestmark = pytest.mark.usefixtures("no_network")


# ------------------------------------------------------------------ quorum


def test_quorum_waits_for_n_deltas_then_takes_one_equal_weight_step(tmp_path):
    loop, repo = make_loop(tmp_path, min_deltas_per_round=3, state_dir=tmp_path / "state", publish=True)
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


def test_the_quorum_counts_distinct_nodes_not_deltas(tmp_path):
    loop, repo = make_loop(tmp_path, min_deltas_per_round=2, state_dir=tmp_path / "state", publish=True)
    put_delta(repo, "fast", 5, g(1.0))
    put_delta(repo, "fast", 10, g(2.0))
    assert loop.run_once().applied == [] and loop.pending == 2  # two deltas, one node: no quorum of 2
    put_delta(repo, "slow", 5, g(3.0))
    r = loop.run_once()
    assert sorted((e.node_id, e.local_step) for e in r.applied) == [("fast", 5), ("fast", 10), ("slow", 5)]
    # issue 12: a round averages over its nodes, not its deltas: the fast node's two deltas are its progress
    # ((1 + 2) + 3) / 2 nodes = 3.0, where a mean over the 3 deltas (2.0) took a third of each node's away
    assert torch.allclose(loop.state.weights["w"], W0 - LR * (3.0 + MU * 3.0), atol=1e-6)


def test_a_node_that_finished_counts_toward_the_quorum(tmp_path):
    """Issue 12: once a node has finished (its marker says so) it sends no more deltas, so the others'
    rounds no longer wait for it (before, they waited until every node finished: a slow node's deltas
    then piled up and were averaged into one step at the end)."""
    loop, repo = make_loop(tmp_path, min_deltas_per_round=3, state_dir=tmp_path / "state", publish=True)
    put_delta(repo, "a", 5, g(1.0))
    put_delta(repo, "b", 5, g(3.0))
    marker = {"node_id": "c", "state": "running"}
    repo.write({final_marker_path("c"): json.dumps(marker).encode()})
    assert loop.run_once().applied == [] and loop.pending == 2  # c still runs: wait for it
    marker |= {"state": "finished", "last_local_step": -1, "last_delta_sha256": ""}
    repo.write({final_marker_path("c"): json.dumps(marker).encode()})
    r = loop.run_once()
    assert sorted(e.node_id for e in r.applied) == ["a", "b"] and r.outer_step == 1
    assert torch.allclose(loop.state.weights["w"], W0 - LR * (2.0 + MU * 2.0), atol=1e-6)


def test_without_a_quorum_the_master_reads_no_final_marker(tmp_path):
    """With a quorum of 0 or 1 whether a node finished changes nothing in a round: its marker is not read."""
    marker = {"node_id": "c", "state": "finished", "last_local_step": -1, "last_delta_sha256": ""}
    for quorum in (0, 1, 2):
        repo = Spy(DirectoryTransport(tmp_path / f"repo{quorum}"))
        loop, _ = make_loop(repo, min_deltas_per_round=quorum)
        repo.write({final_marker_path("c"): json.dumps(marker).encode()})
        put_delta(repo, "a", 5, g(1.0))
        assert [e.node_id for e in loop.run_once().applied] == ["a"]
        assert repo.count("read", final_marker_path("c")) == (quorum == 2)


def test_quorum_zero_is_the_spec_one_step_per_poll_with_a_delta(tmp_path):
    loop, repo = make_loop(tmp_path, state_dir=tmp_path / "state", publish=True)
    put_delta(repo, "a", 5, g(1.0))
    assert loop.run_once().outer_step == 1


def test_pending_deltas_are_found_again_by_a_restarted_master(tmp_path):
    loop, repo = make_loop(tmp_path, min_deltas_per_round=2, state_dir=tmp_path / "state", publish=True)
    put_delta(repo, "a", 5, g(1.0))
    loop.run_once()
    assert loop.pending == 1
    loop.save_state()
    # the master dies with one delta pending (in memory only): a new one finds it in the repository
    again, _ = make_loop(
        repo, MasterState.load(tmp_path / "state"), state_dir=tmp_path / "state", min_deltas_per_round=2
    )
    put_delta(repo, "b", 5, g(3.0))
    r = again.run_once()
    assert sorted(e.node_id for e in r.applied) == ["a", "b"]
    assert torch.allclose(again.state.weights["w"], W0 - LR * (2.0 + MU * 2.0), atol=1e-6)


def test_flush_and_shutdown_apply_pending_deltas_below_the_quorum(tmp_path):
    loop, repo = make_loop(tmp_path, min_deltas_per_round=4, state_dir=tmp_path / "state", publish=True)
    put_delta(repo, "a", 5, g(1.0))
    assert loop.run_once().applied == []
    assert [e.node_id for e in loop.run_once(flush=True).applied] == ["a"]
    # a flush below the quorum: the lone delta stands for 1 of the 4 nodes (1/4), not for all of them (1.0)
    assert torch.allclose(loop.state.weights["w"], W0 - LR * (0.25 + MU * 0.25), atol=1e-6)
    # through the coordinator: close() applies what is still pending
    model = Tiny()
    s = settings(tmp_path / "repo2", role="master", node_id="m", poll_interval=0.05, min_deltas_per_round=4)
    coord = DumbDiLoCo(model, s, DirectoryTransport(tmp_path / "repo2"))
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
    loop, repo = make_loop(tmp_path, state_dir=tmp_path / "state", publish=True)
    put_delta(repo, "a", 5, g(1.0), base=0)
    loop.run_once()  # step 0 -> 1
    put_delta(repo, "a", 10, g(2.0), base=1)  # distinct payloads: a copy would be a duplicate
    put_delta(repo, "b", 5, g(3.0), base=0)
    put_delta(repo, "c", 5, {"w": torch.zeros(3)}, base=0)  # rejected: wrong shape
    loop.run_once()  # step 1 -> 2
    st = {(e.node_id, e.local_step): (e.status, e.staleness) for e in loop.state.ledger.entries()}
    assert st == {
        ("a", 5): ("applied", 0),
        ("a", 10): ("applied", 0),
        ("b", 5): ("applied", 1),
        ("c", 5): ("rejected", 1),
    }
    assert sorted(loop.last_staleness) == [0, 1]  # the last round's, per applied delta, for the metrics


# ------------------------------------------------------------------ staleness weighting


def test_staleness_weighting_against_a_hand_computed_update(tmp_path):
    state = MasterState.from_model_state(Tiny().state_dict(), outer_step=2)
    loop, repo = make_loop(
        tmp_path, state, staleness_weighting=True, state_dir=tmp_path / "state", publish=True
    )
    put_delta(repo, "fresh", 5, g(1.0), base=2)  # staleness 0: raw weight 1
    put_delta(repo, "stale", 5, g(4.0), base=0)  # staleness 2: raw weight 1/3
    loop.run_once()
    mean = (1.0 * 1.0 + 4.0 / 3) / (1.0 + 1 / 3)  # = 0.75 * 1 + 0.25 * 4 = 1.75
    assert mean == pytest.approx(1.75)
    assert torch.allclose(loop.state.weights["w"], W0 - LR * (mean + MU * mean), atol=1e-6)
    st = {e.node_id: e.staleness for e in loop.state.ledger.entries()}
    assert st == {"fresh": 0, "stale": 2}


def test_without_staleness_weighting_stale_deltas_weigh_the_same(tmp_path):
    state = MasterState.from_model_state(Tiny().state_dict(), outer_step=2)
    loop, repo = make_loop(tmp_path, state, state_dir=tmp_path / "state", publish=True)
    put_delta(repo, "fresh", 5, g(1.0), base=2)
    put_delta(repo, "stale", 5, g(4.0), base=0)
    loop.run_once()
    assert torch.allclose(loop.state.weights["w"], W0 - LR * (2.5 + MU * 2.5), atol=1e-6)


# ------------------------------------------------------------------ delayed Nesterov


def test_delayed_nesterov_against_a_hand_computed_update(tmp_path):
    loop, repo = make_loop(tmp_path, delayed_nesterov_period=2, state_dir=tmp_path / "state", publish=True)
    grads = (1.0, -0.5, 2.0)
    for i, v in enumerate(grads):
        put_delta(repo, "a", i + 1, g(v))
        loop.run_once()
    # step 1: k=1 < 2, plain SGD on the delta; the buffer is untouched
    w1 = W0 - LR * 1.0
    # step 2: k=2, m <- mu*0 + (1.0 - 0.5)/2, Nesterov with the refreshed buffer
    m = 0.0 * MU + (1.0 + -0.5) / 2
    w2 = w1 - LR * (-0.5 + MU * m)
    # step 3: k=1 again, plain SGD; m unchanged, the delta waits in the accumulator
    w3 = w2 - LR * 2.0
    assert torch.allclose(loop.state.weights["w"], w3, atol=1e-6)
    assert torch.allclose(loop.state.momentum["w"], torch.full((2, 2), m))
    assert loop.state.delayed_count == 1 and torch.equal(loop.state.delayed["w"], torch.full((2, 2), 2.0))
    # the accumulator survives a save/load and a trainer checkpoint
    loop.save_state()
    for again in (
        MasterState.load(tmp_path / "state"),
        MasterState.from_checkpoint(loop.state.to_checkpoint()),
    ):
        assert again.delayed_count == 1 and torch.equal(again.delayed["w"], loop.state.delayed["w"])


def test_delayed_nesterov_with_period_1_is_torch_nesterov(tmp_path):
    loop, repo = make_loop(tmp_path, delayed_nesterov_period=1, state_dir=tmp_path / "state", publish=True)
    p = W0.clone()
    opt = torch.optim.SGD([p], lr=LR, momentum=MU, nesterov=True)
    for i, v in enumerate((1.0, -0.5, 2.0)):
        put_delta(repo, "a", i + 1, g(v))
        loop.run_once()
        p.grad = torch.full((2, 2), v)
        opt.step()
    assert torch.allclose(loop.state.weights["w"], p, atol=1e-6)


def test_delayed_nesterov_counts_the_deltas_of_a_quorum_round(tmp_path):
    """Issue 12: the period counts deltas. Rounds of 2 deltas (quorum 2) with period 2 refresh the momentum
    every round: torch's SGD-Nesterov on the round means (before, every 2nd round)."""
    loop, repo = make_loop(
        tmp_path,
        min_deltas_per_round=2,
        delayed_nesterov_period=2,
        state_dir=tmp_path / "state",
        publish=True,
    )
    p = W0.clone()
    opt = torch.optim.SGD([p], lr=LR, momentum=MU, nesterov=True)
    for step, (x, y) in enumerate(((1.0, 3.0), (-0.5, 0.5), (2.0, 1.5)), start=1):
        put_delta(repo, "a", step, g(x))
        put_delta(repo, "b", step, g(y))
        assert len(loop.run_once().applied) == 2
        p.grad = torch.full((2, 2), (x + y) / 2)
        opt.step()
        assert torch.allclose(loop.state.weights["w"], p, atol=1e-6)
    assert loop.state.delayed_count == 0


def test_config_switches_reach_the_outer_loop(tmp_path):
    s = settings(
        tmp_path / "repo",
        role="master",
        node_id="m",
        poll_interval=0.05,
        staleness_weighting=True,
        delayed_nesterov=True,
        delayed_nesterov_period=3,
        min_deltas_per_round=2,
    )
    coord = DumbDiLoCo(Tiny(), s, DirectoryTransport(tmp_path / "repo"))
    coord.start()
    try:
        o = coord.outer
        assert (o.staleness_weighting, o.delayed_nesterov_period, o.min_deltas_per_round) == (True, 3, 2)
    finally:
        coord.close()
    off = DumbDiLoCo(
        Tiny(),
        settings(tmp_path / "r2", role="master", node_id="m", delayed_nesterov_period=3),
        DirectoryTransport(tmp_path / "r2"),
    )
    off.start()
    try:
        assert off.outer.delayed_nesterov_period == 0 and not off.outer.staleness_weighting  # the spec's
    finally:
        off.close()


def test_a_master_with_a_quorum_trains_once_the_quorum_s_nodes_have_announced(tmp_path):
    """Issue 12: a master needs no first global, so without this wait it starts a few seconds before
    its workers and its deltas stay a round ahead of theirs for the whole run."""
    repo = DirectoryTransport(tmp_path / "repo")
    spy = Spy(repo)
    s = settings(tmp_path / "repo", role="master", node_id="m", min_deltas_per_round=2, poll_interval=0.05)
    s.startup_timeout = 60.0
    coord = DumbDiLoCo(Tiny(), s, spy)
    started = threading.Thread(target=coord.start, daemon=True)
    started.start()
    try:
        deadline = time.monotonic() + 30
        while spy.count("list", "nodes") < 3 and time.monotonic() < deadline:  # it has looked, and waits
            time.sleep(0.01)
        assert spy.count("list", "nodes") >= 3 and started.is_alive() and not coord.started
        repo.write({final_marker_path("w1"): b'{"node_id": "w1", "state": "running"}'})
        started.join(30)
        assert not started.is_alive() and coord.started
    finally:
        started.join(30)
        coord.close()

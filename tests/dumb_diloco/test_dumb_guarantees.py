"""DumbDiLoCo's guarantees (docs/dumb_diloco.md, "Guarantees"), one test per way they were found broken
(issue 14): work lost at the end of a run, two masters with one node id, rejections missing from the
published ledger, a copy of an applied delta applied twice. Each test fails on the old behaviour.

Nothing here waits on a clock or a thread interleaving: the end of a run is driven by hooks on the
master's rounds and the worker's sleep; the process test waits for durable records only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dumb_helpers import W0, Spy, Tiny, g, make_loop, put_delta, settings, worker

from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.store.transport import DirectoryTransport, RemoteFile
from diloco.dumb_diloco.wire.repo_paths import (
    GLOBAL_LEDGER_PATH,
    GLOBAL_STEP_PATH,
    LEASE_PATH,
    delta_path,
    final_marker_path,
)
from diloco.dumb_diloco.wire.tensor_format import encode

pytestmark = pytest.mark.usefixtures("no_network")


def marker(repo, node: str, step: int, sha: str) -> None:
    """A node's final marker, as ending.send_final writes it."""
    body = {"node_id": node, "state": "finished", "last_local_step": step, "last_delta_sha256": sha}
    repo.write({final_marker_path(node): json.dumps(body).encode()})


def master(tmp_path: Path, **kw) -> DumbDiLoCo:
    kw = {"poll_interval": 0.01, "outer_momentum": 0.0, "outer_lr": 1.0} | kw
    s = settings(tmp_path / "repo", role="master", node_id="m", **kw)
    coord = DumbDiLoCo(Tiny(), s, DirectoryTransport(tmp_path / "repo"))
    coord.start()
    return coord


# ------------------------------------------------------------------ 1. nothing lost at the end of a run


def test_the_master_keeps_aggregating_until_every_nodes_final_delta_is_applied(tmp_path):
    coord = master(tmp_path)
    repo = coord.transport
    put_delta(repo, "w", 3, g(1.0))  # a worker's delta, no final marker yet: the worker is still running
    run_once, arrived = coord.outer.run_once, []

    def run_once_then_the_workers_last_delta(*args, **kwargs):
        result = run_once(*args, **kwargs)
        if coord.outer.draining and not arrived:  # after the master's own end: the old one stopped here
            arrived.append(put_delta(repo, "w", 5, g(2.0)))
            marker(repo, "w", 5, arrived[0])
        return result

    coord.outer.run_once = run_once_then_the_workers_last_delta
    coord.finish()  # the master's own final marker (it uploaded nothing), then the drain
    applied = {(e.node_id, e.local_step) for e in coord.outer.state.ledger.entries() if e.status == "applied"}
    assert applied == {("w", 3), ("w", 5)} and coord.outer.unfinished == {}
    assert coord.summary()["dumb_diloco/final_left"] == ""
    # the final write: the ledger marked final and the lease released, so workers and successors know
    published = json.loads(repo.read(GLOBAL_LEDGER_PATH))
    assert published["final"] and len(published["entries"]) == 2
    assert json.loads(repo.read(LEASE_PATH))["released"]
    # and the model evaluated at the end holds the global with both deltas (outer lr 1, no momentum)
    assert torch.allclose(coord.model.w.detach(), W0 - 3.0, atol=1e-6)
    coord.close()  # finish() does not close (the trainer closes last)


def test_a_node_without_a_final_marker_is_named_once_drain_timeout_passed(tmp_path, caplog):
    coord = master(tmp_path, drain_timeout=0.3)
    put_delta(coord.transport, "slow", 3, g(1.0))
    coord.finish()
    assert ("slow", 3) in {(e.node_id, e.local_step) for e in coord.outer.state.ledger.entries()}
    left = coord.summary()["dumb_diloco/final_left"]
    assert left.startswith("slow (not finished yet") and "stopped after drain_timeout 0.3s" in caplog.text
    coord.close()


def test_a_worker_uploads_its_tail_and_says_whether_the_master_applied_it(tmp_path):
    coord, spy, model = worker(tmp_path, inner_steps=3, poll_interval=0.01)
    loop, _ = make_loop(spy.inner, model.state_dict(), momentum=0.0, published_step=0)
    for step in (1, 2, 3, 4):  # a boundary at 3, then one step the old node never uploaded
        with torch.no_grad():
            model.w.add_(0.1)
        coord.on_step(step)
    rounds = []

    def a_master_round(seconds):  # while the worker waits for the ledger; its clock is a fake one
        assert len(rounds) < 5, "the worker kept waiting"
        rounds.append(loop.run_once())

    coord.sleep = a_master_round
    coord.finish()
    deltas = sorted(f.path for f in spy.inner.list("nodes") if f.path.endswith(".safetensors"))
    assert deltas == [delta_path("w1", 3), delta_path("w1", 4)]
    assert json.loads(spy.inner.read(final_marker_path("w1")))["last_local_step"] == 4
    assert coord.final_status.startswith("applied at outer step") and rounds
    assert coord.summary()["dumb_diloco/final_delta"] == coord.final_status
    coord.close()


# ------------------------------------------------------------------ 2. fencing: one master process


def test_a_master_whose_lease_another_process_with_its_id_took_writes_nothing(tmp_path):
    repo = Spy(DirectoryTransport(tmp_path / "repo"))
    loop, _ = make_loop(repo, lease_seconds=300)
    assert loop.publish()  # holds the lease
    took_over = json.loads(repo.read(LEASE_PATH)) | {"instance": "another-process"}  # same node id "m"
    repo.write({LEASE_PATH: json.dumps(took_over).encode()})
    writes = repo.count("write")
    put_delta(repo, "a", 3, g(1.0))
    assert not loop.run_once().published and "another process" in loop.fenced
    loop.heartbeat(final=True)
    assert repo.count("write") == writes + 1  # the delta's upload only: no publication, lease or ledger
    assert json.loads(repo.read(GLOBAL_STEP_PATH))["outer_step"] == 0


@pytest.mark.slow
def test_a_second_process_with_the_same_master_id_is_refused(tmp_path):
    from polling import wait_until
    from test_dumb_faults import finish, node

    repo_dir = str(tmp_path / "repo")
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir(), elsewhere.mkdir()
    first = node(here, "master", repo_dir, "m", lease=300)
    lease_file = tmp_path / "repo" / LEASE_PATH
    wait_until(lease_file.exists, "the first master's lease", 120)
    instance = json.loads(lease_file.read_text())["instance"]
    # a requeued job on another machine (another state_dir) with the same node id: refused by the lease
    second = node(elsewhere, "master", repo_dir, "m", lease=300, tag="-second")
    # a double launch on the same machine (the same state_dir): refused by the state_dir's lock
    third = node(here, "master", repo_dir, "m", lease=300, tag="-third")
    for p, log, words in (
        (second, elsewhere / "m-second.log", "(another process with this node id)"),
        (third, here / "m-third.log", "holds master.lock"),
    ):
        p.wait(timeout=120)
        text = log.read_text()
        assert p.returncode == 2 and words in text, text[-2000:]
        assert len([line for line in text.splitlines() if line.startswith("error:")]) == 1
    (here / "stop").touch()
    out = finish(first, here / "m.log")
    assert out["errors"] == 0
    lease = json.loads(lease_file.read_text())
    assert lease["instance"] == instance and lease["released"]  # nobody else ever held it


# ------------------------------------------------------------------ 4. a complete record


def test_every_file_under_nodes_is_on_the_published_ledger_and_a_copy_is_a_duplicate(tmp_path):
    repo = DirectoryTransport(tmp_path / "repo")
    sha = put_delta(repo, "a", 3, g(1.0))
    hostile = {
        "nodes/a/notes.txt": b"hello",  # not a delta file name
        "nodes/a/delta_x.safetensors": b"\0" * 16,  # not a step
        "nodes/b/delta_3.safetensors": b"\x08" + b"\0" * 20,  # no readable header
        "nodes/b/delta_6.safetensors": encode({"w": torch.zeros(3)}, {"node_id": "b", "local_step": "6"}),
        "nodes/stray.safetensors": b"\0" * 8,  # no node directory
    }
    repo.write(hostile)
    planted = [RemoteFile("nodes/../evil/delta_1.safetensors", 10)]  # a path a Hub repo can list

    class Planted:
        def __init__(self, inner):
            self.inner = inner

        def list(self, prefix, revision=None):
            return sorted(self.inner.list(prefix, revision) + planted, key=lambda f: f.path)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    loop, _ = make_loop(Planted(repo), momentum=0.0)
    assert loop.run_once().published  # a@3 applied, the rest rejected, all published with the global
    published = json.loads(repo.read(GLOBAL_LEDGER_PATH))["entries"]
    assert len(published) == 1 + len(hostile) + len(planted)
    assert sum(r["status"] == "rejected" for r in published) == len(hostile) + len(planted)
    # a byte-identical copy of a@3's payload under another node: a duplicate, never applied again; a round
    # with rejections only reaches the published ledger within LEDGER_EVERY_S, and at the end for sure
    copy = repo.read(delta_path("a", 3)).replace(b'"node_id":"a"', b'"node_id":"c"')
    repo.write({delta_path("c", 3): copy})
    weights = loop.state.weights["w"].clone()
    result = loop.run_once()
    assert not result.applied and [e.status for e in result.rejected] == ["duplicate"]
    assert "same payload (SHA-256) as a@3" in result.rejected[0].reason and result.rejected[0].sha256 == sha
    assert torch.equal(loop.state.weights["w"], weights) and loop.state.outer_step == 1
    loop.heartbeat(final=True)  # the master's last write
    published = json.loads(repo.read(GLOBAL_LEDGER_PATH))
    assert (
        published["outer_step"] == 1
        and published["final"]
        and ["c", 3, "duplicate"]
        in [[r["node_id"], r["local_step"], r["status"]] for r in published["entries"]]
    )


def test_a_quorum_does_not_hold_back_the_last_deltas_once_every_node_finished(tmp_path, caplog):
    coord = master(tmp_path, min_deltas_per_round=4, drain_timeout=600)
    repo = coord.transport
    marker(repo, "w", 3, put_delta(repo, "w", 3, g(1.0)))  # one delta, below the quorum, and w is done
    coord.finish()  # the master's own marker too: nothing more can come, so the pending delta is applied
    assert [(e.node_id, e.status) for e in coord.outer.state.ledger.entries()] == [("w", "applied")]
    assert coord.outer.unfinished == {} and "stopped after drain_timeout" not in caplog.text
    coord.close()

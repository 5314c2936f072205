"""Past the specification, part 2: the master's published unit (global weights + step_count.json + ledger
+ outer momentum + lease, one write), exact takeover by a replacement master, garbage collection of
processed deltas in the publication's write, and the single-master lease."""

from __future__ import annotations

import json
import time

import pytest
import torch
from dumb_helpers import Spy, Tiny, g, make_loop, put_delta, settings

from diloco.dumb_diloco.master.recovery import (
    GLOBAL_LEDGER_PATH,
    GLOBAL_MOMENTUM_PATH,
    LEASE_PATH,
    MasterState,
    lease_holder,
)
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import DumbDiLoCoError
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.dumb_diloco.wire.repo_paths import GLOBAL_STEP_PATH, GLOBAL_WEIGHTS_PATH, delta_path
from diloco.dumb_diloco.wire.tensor_format import decode

pytestmark = pytest.mark.usefixtures("no_network")


def wait_until(cond, timeout: float = 60.0) -> None:
    """Poll `cond` until it holds; fail after `timeout` s (generous: only a failing test waits that long)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def wait_for_lease_expiry(transport) -> None:
    """Until the lease in the repository (written by a master that stopped) is older than its lease_seconds."""
    lease = json.loads(transport.read(LEASE_PATH))
    wait_until(lambda: time.time() - lease["heartbeat"] > lease["lease_seconds"])


def master(tmp_path, node_id="m", state_dir=None, spy=False, **kw) -> DumbDiLoCo:
    s = settings(
        tmp_path / "repo",
        role="master",
        node_id=node_id,
        poll_interval=0.05,
        state_dir=str(state_dir or tmp_path / "state"),
        **kw,
    )
    transport = DirectoryTransport(tmp_path / "repo")
    return DumbDiLoCo(Tiny(), s, Spy(transport) if spy else transport)


def test_global_step_ledger_momentum_and_lease_are_one_write(tmp_path):
    repo = Spy(DirectoryTransport(tmp_path / "repo"))
    loop, _ = make_loop(repo, lease_seconds=60)
    put_delta(repo, "a", 3, g(1.0), base=0)
    loop.run_once()
    writes = [arg for op, arg, _ in repo.calls if op == "write" and GLOBAL_WEIGHTS_PATH in arg]
    assert len(writes) == 1
    assert set(writes[0].split(",")) == {
        GLOBAL_WEIGHTS_PATH,
        GLOBAL_STEP_PATH,
        GLOBAL_LEDGER_PATH,
        GLOBAL_MOMENTUM_PATH,
        LEASE_PATH,
    }
    step = json.loads(repo.read(GLOBAL_STEP_PATH))
    ledger = json.loads(repo.read(GLOBAL_LEDGER_PATH))
    assert (
        ledger["outer_step"] == step["outer_step"] == 1 and ledger["global_sha256"] == step["global_sha256"]
    )
    assert ledger["entries"] == loop.state.ledger.to_json() and ledger["entries"][0]["staleness"] == 0
    tensors, meta = decode(repo.read(GLOBAL_MOMENTUM_PATH), max_bytes=2**20)
    assert meta["global_sha256"] == step["global_sha256"]
    assert torch.equal(tensors["momentum/w"], loop.state.momentum["w"])
    assert json.loads(repo.read(LEASE_PATH))["master"] == "m"


def test_replacement_master_continues_exactly_from_the_repository(tmp_path):
    a = master(tmp_path, lease_seconds=0)
    a.start()
    put_delta(a.transport, "w1", 3, g(1.0))
    wait_until(lambda: a.outer.state.outer_step >= 1)
    put_delta(a.transport, "w1", 6, g(-0.5), base=1)
    a.close()
    before = MasterState.from_checkpoint(a.outer.state.to_checkpoint())
    assert before.outer_step == 2
    put_delta(a.transport, "w2", 3, g(2.0), base=0)  # arrived after the first master stopped
    # the replacement: another machine (no state_dir), another node id
    b = master(tmp_path, node_id="m2", state_dir=tmp_path / "other", lease_seconds=0)
    b.start()
    b.close()
    st = b.outer.state
    assert st.outer_step == 3  # w2@3 applied once; w1@3 and w1@6 not re-applied
    assert [(e.node_id, e.local_step, e.status) for e in st.ledger.entries()] == [
        ("w1", 3, "applied"),
        ("w1", 6, "applied"),
        ("w2", 3, "applied"),
    ]
    # exactly what the first master would have done with w2@3 (weights and momentum carried over)
    ref, _ = make_loop(tmp_path, before, publish_state=False)
    ref._pending.clear()
    for e in before.ledger.entries():
        assert e.status == "applied"
    ref.run_once()
    assert ref.state.outer_step == 3
    for k in ("w", "b"):
        assert torch.equal(st.weights[k], ref.state.weights[k]) and torch.equal(
            st.momentum[k], ref.state.momentum[k]
        )


def test_processed_deltas_beyond_keep_deltas_are_deleted_in_the_publication(tmp_path):
    repo = Spy(DirectoryTransport(tmp_path / "repo"))
    loop, _ = make_loop(repo, keep_deltas=1)
    for step in (3, 6, 9):  # distinct payloads: a copy would be a duplicate
        put_delta(repo, "a", step, g(step + 0.1))
        put_delta(repo, "b", step, g(step + 0.2))
        loop.run_once()
    put_delta(repo, "b", 12, {"w": torch.zeros(5)})  # rejected: processed too, so collected in turn
    loop.run_once()  # no outer step: nothing published, nothing deleted
    listed = {f.path for f in repo.list("nodes")}
    assert listed == {delta_path("a", 9), delta_path("b", 9), delta_path("b", 12)}
    n_writes = repo.count("write")
    put_delta(repo, "a", 12, g(12.1))
    loop.run_once()
    assert repo.count("write") == n_writes + 2  # the delta's upload and ONE publication (with the deletions)
    assert {f.path for f in repo.list("nodes")} == {delta_path("a", 12), delta_path("b", 12)}
    assert len(loop.state.ledger) == 8  # the ledger keeps every collected delta


def test_gc_never_blocks_a_publication(tmp_path):
    repo = DirectoryTransport(tmp_path / "repo")
    loop, _ = make_loop(repo, keep_deltas=1)
    put_delta(repo, "a", 3, g(0.1))
    loop.run_once()
    put_delta(repo, "a", 6, g(0.2))
    repo.delete([delta_path("a", 3)])  # someone else deleted the delta the master will collect
    loop._processed_paths[delta_path("a", 3)] = ("a", 3)
    assert loop.run_once().published


def test_second_master_refuses_while_the_lease_is_fresh_and_takes_over_after(tmp_path, caplog):
    a = master(tmp_path, lease_seconds=1.0)
    a.start()
    # a lease is fresh for the longer of the holder's lease_seconds and the newcomer's (300 s here), so a's
    # is fresh when b looks however slow the machine (the rule itself: the test after this one)
    b = master(tmp_path, node_id="m2", state_dir=tmp_path / "other", lease_seconds=300)
    with pytest.raises(DumbDiLoCoError, match=r"held by master 'm'.*one master per repository"):
        b.start()
    a.close()
    wait_for_lease_expiry(a.transport)  # a's last heartbeat is more than its 1 s old
    b = master(tmp_path, node_id="m2", state_dir=tmp_path / "other", lease_seconds=1.0)
    b.start()
    try:
        assert "taking over" in caplog.text and json.loads(b.transport.read(LEASE_PATH))["master"] == "m2"
    finally:
        b.close()


def test_a_lease_is_fresh_for_the_longer_of_the_holders_and_the_readers_lease_seconds(tmp_path):
    lease = {"master": "m", "instance": "i1", "heartbeat": 1000.0, "lease_seconds": 10}
    assert lease_holder(lease, "i1", 10, now=1001.0) is None  # this process's own lease never holds it back
    assert lease_holder(lease, "i2", 10, now=1009.5) == ("m", 9.5)  # another process, even with id "m"
    assert lease_holder(lease, "i2", 1, now=1009.5) == ("m", 9.5)  # the holder's 10 s, not the reader's 1 s
    assert lease_holder(lease, "i2", 10, now=1010.0) is None  # expired
    assert lease_holder(lease, "i2", 60, now=1030.0) == ("m", 30.0)  # the reader's longer lease counts too
    assert lease_holder(lease | {"released": True}, "i2", 60, now=1001.0) is None  # a clean stop released it


def test_a_master_whose_lease_was_taken_stops_publishing(tmp_path):
    a = master(tmp_path, lease_seconds=0.3)
    a.start()
    a.outer.stop()  # a hangs (no heartbeats) long enough for its lease to expire
    wait_for_lease_expiry(a.transport)
    b = master(tmp_path, node_id="m2", state_dir=tmp_path / "other", lease_seconds=0.3)
    b.start()
    lease = json.loads(b.transport.read(LEASE_PATH))
    assert lease["master"] == "m2"
    # a comes back within b's lease (by a's clock: on a loaded machine real time may already be past b's
    # 0.3 s, and b's heartbeats are a thread's); it sees b's fresh lease and stands down
    a.outer.wall_clock = lambda: lease["heartbeat"]
    a.outer._last_lease_write = -1e9
    a.outer.heartbeat()
    assert "m2" in a.outer.fenced and not a.outer.publish()
    b.close()
    a.close()


def test_lease_config_keys():
    from diloco.dumb_diloco.settings import Settings

    s = Settings.from_config({"role": "master", "node_id": "m", "repo_id": "o/r"})
    assert (s.lease_seconds, s.keep_deltas, s.publish_master_state) == (300, 0, True)


def test_processed_deltas_are_recognised_without_reading_them_again(tmp_path):
    repo = Spy(DirectoryTransport(tmp_path / "repo"))
    loop, _ = make_loop(repo)
    put_delta(repo, "a", 3, g(1.0))
    loop.run_once()
    headers, reads = repo.count("read_header"), repo.count("read")
    for _ in range(3):
        assert loop.run_once().applied == []
    assert (repo.count("read_header"), repo.count("read")) == (headers, reads)  # path + version: no I/O
    put_delta(repo, "a", 3, g(5.0))  # the same path re-uploaded with other contents: a new delta
    assert [e.local_step for e in loop.run_once().applied] == [3] and loop.state.ledger.count("applied") == 2


def test_a_long_round_checks_the_lease_before_publishing(tmp_path):
    repo = DirectoryTransport(tmp_path / "repo")
    loop, _ = make_loop(repo, lease_seconds=60)
    assert loop.publish()  # takes the lease
    # the round took longer than lease_seconds/2 and another master took over meanwhile
    repo.write(
        {LEASE_PATH: json.dumps({"master": "m2", "heartbeat": time.time(), "lease_seconds": 60}).encode()}
    )
    loop._last_lease_write -= 31
    put_delta(repo, "a", 3, g(1.0))
    assert not loop.run_once().published and "m2" in loop.fenced
    assert json.loads(repo.read(GLOBAL_STEP_PATH))["outer_step"] == 0  # nothing overwritten

"""The master's outer loop (spec "Outer-loop lifecycle", steps 1-10) on a tiny model, checked against
numbers worked out by hand; plus the master's start-up against its state, checkpoint and repository.

Each test names the step it pins down: it fails if that step is skipped or done wrong.
"""

from __future__ import annotations

import io
import json
import struct
import threading
import time

import pytest
import torch
from dumb_helpers import B0, LR, MU, W0, Spy, Tiny, g, make_loop, put_delta, settings
from polling import wait_until

from diloco.dumb_diloco.master.recovery import MasterState, lease_holder
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import DumbDiLoCoError
from diloco.dumb_diloco.store.transport import DirectoryTransport, RemoteFile, TransientError
from diloco.dumb_diloco.wire.repo_paths import (
    GLOBAL_LEDGER_PATH,
    GLOBAL_MOMENTUM_PATH,
    GLOBAL_STEP_PATH,
    GLOBAL_WEIGHTS_PATH,
    LEASE_PATH,
    delta_path,
)
from diloco.dumb_diloco.wire.tensor_format import DeltaMeta, decode, encode

pytestmark = pytest.mark.usefixtures("no_network")


@pytest.fixture
def setup(tmp_path):
    repo = Spy(DirectoryTransport(tmp_path / "repo"))
    snapshots = []
    loop, _ = make_loop(
        repo, poll_interval=0.05, state_dir=tmp_path / "state", publish=True, on_snapshot=snapshots.append
    )
    return loop, repo, snapshots


def published(repo):
    tensors, meta = decode(repo.read(GLOBAL_WEIGHTS_PATH), max_bytes=2**20)
    return tensors, meta, json.loads(repo.read(GLOBAL_STEP_PATH))


# ------------------------------------------------------------------ steps 1, 2, 5, 6: one round


def test_steps_1_2_5_6_one_poll_averages_all_valid_deltas_and_takes_a_nesterov_step(setup):
    loop, repo, _ = setup
    put_delta(repo, "a", 10, g(1.0))
    put_delta(repo, "b", 7, g(3.0))
    result = loop.run_once()
    assert sorted(e.node_id for e in result.applied) == ["a", "b"] and result.outer_step == 1
    assert result.num_peers == 2
    mean = 2.0  # equal weight, whatever the steps or tokens behind each delta
    # SGD with Nesterov, first step: buf = g; update = g + mu * buf
    assert torch.allclose(loop.state.weights["w"], W0 - LR * (mean + MU * mean))
    assert torch.allclose(loop.state.weights["b"], B0 - LR * (mean + MU * mean))
    assert repo.count("list") == 1 and repo.count("read", delta_path("a", 10)) == 1


def test_step6_nesterov_over_rounds_matches_hand_computation_and_torch_sgd(setup):
    loop, repo, _ = setup
    put_delta(repo, "a", 1, g(1.0))
    loop.run_once()
    put_delta(repo, "a", 2, g(-0.5))
    loop.run_once()
    buf1 = 1.0
    w1 = W0 - LR * (1.0 + MU * buf1)
    buf2 = MU * buf1 + -0.5
    w2 = w1 - LR * (-0.5 + MU * buf2)
    assert torch.allclose(loop.state.weights["w"], w2)
    assert torch.allclose(loop.state.momentum["w"], torch.full((2, 2), buf2))
    # and the same as one long-lived torch.optim.SGD(nesterov=True)
    p = W0.clone()
    opt = torch.optim.SGD([p], lr=LR, momentum=MU, nesterov=True)
    for grad in (1.0, -0.5):
        p.grad = torch.full((2, 2), grad)
        opt.step()
    assert torch.equal(loop.state.weights["w"], p)


def test_step6_plain_sgd_without_momentum(tmp_path):
    state = MasterState.from_model_state(Tiny().state_dict())
    state.apply_outer_step(g(1.0), lr=1.0, momentum=0.0)
    assert torch.equal(state.weights["w"], W0 - 1.0) and state.momentum == {}


# ------------------------------------------------------------------ step 3: dedupe


def test_step3_each_identity_is_applied_exactly_once(setup):
    loop, repo, _ = setup
    put_delta(repo, "a", 5, g(1.0))
    loop.run_once()
    after_one = loop.state.weights["w"].clone()
    for _ in range(3):
        assert loop.run_once().applied == []  # the same file, listed again
    assert torch.equal(loop.state.weights["w"], after_one) and loop.state.outer_step == 1
    assert repo.count("read", delta_path("a", 5)) == 1  # identified by its header, not downloaded again
    # the same path uploaded again with other contents (a node restarted from an older checkpoint)
    # is a new delta: identity = (node_id, local_step, payload sha256)
    put_delta(repo, "a", 5, g(2.0))
    assert [e.local_step for e in loop.run_once().applied] == [5] and loop.state.outer_step == 2


# ------------------------------------------------------------------ step 4: validation


def _torch_save_bytes() -> bytes:
    buf = io.BytesIO()
    torch.save(g(1.0), buf)
    return buf.getvalue()


BAD = {
    "missing-key": lambda: encode({"w": torch.ones(2, 2)}, DeltaMeta("bad", 1, 0).to_header()),
    "extra-key": lambda: encode(g(1.0) | {"x": torch.ones(1)}, DeltaMeta("bad", 2, 0).to_header()),
    "wrong-shape": lambda: encode(
        {"w": torch.ones(4), "b": torch.ones(2)}, DeltaMeta("bad", 3, 0).to_header()
    ),
    "wrong-dtype": lambda: encode(
        {k: t.half() for k, t in g(1.0).items()}, DeltaMeta("bad", 4, 0).to_header()
    ),
    "nan": lambda: encode(g(float("nan")), DeltaMeta("bad", 5, 0).to_header()),
    "inf": lambda: encode(g(float("inf")), DeltaMeta("bad", 6, 0).to_header()),
    "truncated": lambda: encode(g(1.0), DeltaMeta("bad", 7, 0).to_header())[:-5],
    "pickle": _torch_save_bytes,
    "garbage": lambda: b"not a safetensors file at all",
    "path-mismatch": lambda: encode(g(1.0), DeltaMeta("someone-else", 9, 0).to_header()),
    "no-metadata": lambda: encode(g(1.0), {}),
}


def test_step4_invalid_deltas_are_rejected_with_reasons_and_do_not_block_valid_ones(setup, caplog):
    loop, repo, _ = setup
    for i, make in enumerate(BAD.values(), start=1):
        repo.inner.write({delta_path("bad", i): make()})
    put_delta(repo, "good", 3, g(2.0))
    result = loop.run_once()  # must not raise
    assert [e.node_id for e in result.applied] == ["good"]
    assert torch.allclose(loop.state.weights["w"], W0 - LR * (2.0 + MU * 2.0))  # as if alone
    reasons = {e.local_step: e.reason for e in result.rejected}
    assert sorted(reasons) == list(range(1, len(BAD) + 1)), reasons
    assert all(reasons.values()) and loop.deltas_rejected == len(BAD)
    for word in ("missing", "unexpected", "shape", "dtype", "NaN or Inf", "torch.save", "path says"):
        assert any(word in r for r in reasons.values()), word
    assert "rejected delta" in caplog.text
    # a rejected delta is not downloaded and rejected again at every poll
    reads = repo.count("read")
    assert loop.run_once().rejected == [] and repo.count("read") == reads


# ------------------------------------------------------------------ steps 7, 8: publication


def test_steps_7_8_publish_full_weights_and_step_metadata_in_one_write(setup):
    loop, repo, _ = setup
    put_delta(repo, "a", 5, g(1.0), base=0)
    rev = int(repo.revision())
    loop.run_once()
    assert int(repo.revision()) == rev + 1  # one unit: weights and step count never disagree
    tensors, meta, info = published(repo)
    assert set(tensors) == {"w", "b", "count"}  # the integer buffer is published ...
    assert torch.equal(tensors["count"], torch.tensor([7]))  # ... and never updated
    assert torch.equal(tensors["w"], loop.state.weights["w"]) and meta["outer_step"] == "1"
    assert info["outer_step"] == 1 and info["global_sha256"] == meta["payload_sha256"]
    assert info["deltas"] == [
        {
            "node_id": "a",
            "local_step": 5,
            "sha256": loop.state.ledger.entries()[0].sha256,
            "base_outer_step": 0,
        }
    ]


def test_step7_publication_failure_is_retried_at_the_next_poll(setup):
    loop, repo, _ = setup
    put_delta(repo, "a", 5, g(1.0))
    repo.fail_writes = 1
    result = loop.run_once()
    assert not result.published and loop.state.outer_step == 1
    assert published(repo)[2]["outer_step"] == 0
    loop.run_once()
    assert published(repo)[2]["outer_step"] == 1


def test_complex_and_bf16_entries_go_through_float32(tmp_path):
    model = Tiny(complex_param=True, bf16=True)
    repo = DirectoryTransport(tmp_path / "repo")
    loop, _ = make_loop(repo, model.state_dict(), lr=1.0, momentum=0.0)
    delta = g(1.0) | {"z": torch.ones(2, 2), "h": torch.full((3,), 0.5)}
    put_delta(repo, "a", 1, delta)
    assert loop.run_once().applied
    tensors, _, _ = published(repo)
    assert tensors["z"].dtype == torch.complex64 and tensors["h"].dtype == torch.bfloat16
    assert torch.allclose(tensors["z"], model.z.detach() - (1 + 1j))
    assert torch.equal(tensors["h"], (model.h.detach().float() - 0.5).bfloat16())


# ------------------------------------------------------------------ step 9: local state


def test_step9_saved_state_resumes_exactly(setup, tmp_path):
    loop, repo, _ = setup
    put_delta(repo, "a", 1, g(1.0))
    put_delta(repo, "b", 1, g(0.5))
    loop.run_once()
    saved = MasterState.load(tmp_path / "state")
    assert saved.outer_step == 1 and len(saved.ledger) == 2
    assert torch.equal(saved.weights["w"], loop.state.weights["w"])
    assert torch.equal(saved.momentum["w"], loop.state.momentum["w"])
    # a master restarted from the saved state continues exactly like the uninterrupted one
    restarted, _ = make_loop(repo, saved)
    put_delta(repo, "a", 2, g(-1.0))
    assert [e.node_id for e in restarted.run_once().applied] == ["a"]  # a@1 and b@1 not re-applied
    loop.run_once()
    assert torch.equal(restarted.state.weights["w"], loop.state.weights["w"])
    # and through the trainer checkpoint format (torch.load(weights_only=True))
    torch.save(loop.state.to_checkpoint(), tmp_path / "ckpt.pt")
    back = MasterState.from_checkpoint(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    assert back.outer_step == 2 and torch.equal(back.weights["w"], loop.state.weights["w"])
    assert back.dtypes == loop.state.dtypes and len(back.ledger) == 3


def test_step9_rejections_alone_are_saved_too(setup, tmp_path):
    loop, repo, _ = setup
    repo.inner.write({delta_path("bad", 1): b"garbage"})
    loop.run_once()
    assert MasterState.load(tmp_path / "state").ledger.count("rejected") == 1


# ------------------------------------------------------------------ step 10: notification


def test_step10_training_thread_is_notified_with_a_snapshot(setup):
    loop, repo, snapshots = setup
    put_delta(repo, "a", 1, g(1.0))
    loop.run_once()
    assert [s.outer_step for s in snapshots] == [1] and snapshots[0].source == "master"
    assert torch.equal(snapshots[0].state["w"], loop.state.weights["w"])
    loop.state.weights["w"].add_(1.0)  # the snapshot is a copy: later rounds never change it
    assert not torch.equal(snapshots[0].state["w"], loop.state.weights["w"])


# ------------------------------------------------------------------ the thread, the allowlist


def test_outer_thread_survives_errors_and_never_touches_the_live_model(tmp_path):
    model = Tiny()
    repo = Spy(DirectoryTransport(tmp_path / "repo"))
    coord = DumbDiLoCo(
        model, settings(tmp_path / "repo", role="master", node_id="m", poll_interval=0.05), repo
    )
    coord.start()
    live = model.w.detach().clone()
    repo.fail_revisions = 2  # two rounds fail: logged, counted, the thread goes on
    wait_until(lambda: coord.outer.errors >= 2)
    put_delta(repo.inner, "w9", 3, g(1.0))  # only now: the thread went on after its errors
    wait_until(lambda: coord.newest_known() >= 1)  # the outer loop notified the training thread
    # Hold the outer loop at its next round's first read, so that it cannot apply the master's own delta
    # of step 3 (uploaded at that boundary, before the install) and stage a newer global first.
    repo.hold_revisions = threading.Event()
    assert repo.revisions_held.wait(60)
    notified = coord.installer.staged.state["w"].clone()
    assert not torch.equal(notified, live)
    assert torch.equal(model.w.detach(), live)  # only the training thread installs, at a boundary
    coord.on_step(1), coord.on_step(2)
    assert torch.equal(model.w.detach(), live)
    assert coord.on_step(3).installed and torch.equal(model.w.detach(), notified)
    repo.hold_revisions.set()
    coord.close()
    assert not coord.outer.running


def test_collaborators_is_an_allowlist(tmp_path, caplog):
    repo = DirectoryTransport(tmp_path / "repo")
    loop, _ = make_loop(repo, lr=1.0, momentum=0.0, collaborators=["a"])
    for i, node in enumerate(("a", "m", "intruder")):  # distinct payloads: a copy would be a duplicate
        put_delta(repo, node, 1, g(1.0 + i))
    result = loop.run_once()
    assert sorted(e.node_id for e in result.applied) == ["a", "m"]  # the master's own deltas always
    assert (
        "intruder" in caplog.text
        and ("intruder", 1, "applied")
        not in {(e.node_id, e.local_step, e.status) for e in loop.state.ledger.entries()}
    )  # part 2: recorded as rejected, under an identity without its hash (tests/dumb_diloco/master/test_dumb_master.py)


# ------------------------------------------------------------------ master start-up


def _master(tmp_path, model=None, **kw) -> DumbDiLoCo:
    s = settings(tmp_path / "repo", role="master", node_id="m", poll_interval=0.05, **kw)
    coord = DumbDiLoCo(model or Tiny(), s, DirectoryTransport(tmp_path / "repo"))
    return coord


def test_master_publishes_outer_step_0_from_its_model(tmp_path):
    coord = _master(tmp_path)
    coord.start()
    coord.close()
    tensors, _, info = published(DirectoryTransport(tmp_path / "repo"))
    assert info["outer_step"] == 0 and torch.equal(tensors["w"], W0)


def test_master_restart_resumes_its_state_and_does_not_reapply(tmp_path):
    coord = _master(tmp_path)
    coord.start()
    put_delta(coord.transport, "a", 3, g(1.0))
    coord.close()
    assert coord.outer.state.outer_step == 1
    weights = coord.outer.state.weights["w"].clone()
    again = _master(tmp_path)
    again.start()
    assert again.installer.outer_step == 1 and torch.equal(again.model.w.detach(), weights)
    again.close()
    assert again.outer.state.outer_step == 1  # a@3 is in the saved ledger


def test_master_without_state_adopts_the_repository_and_skips_old_deltas(tmp_path):
    # without the published ledger (part 2's publish_master_state: false; with it the takeover is exact,
    # tests/dumb_diloco/master/test_dumb_master.py)
    coord = _master(tmp_path, publish_master_state=False)
    coord.start()
    put_delta(coord.transport, "a", 3, g(1.0))
    coord.close()
    put_delta(coord.transport, "a", 6, g(1.0))  # arrived after the master stopped
    new = _master(tmp_path, state_dir=str(tmp_path / "elsewhere"), publish_master_state=False)  # state lost
    new.start()
    new.close()
    assert new.outer.state.outer_step == 1  # adopted, and a@6 treated as already there (not re-applied)
    assert {e.status for e in new.outer.state.ledger.entries()} == {"applied", "preexisting"}


def test_master_prefers_the_newer_of_checkpoint_and_state_dir(tmp_path):
    coord = _master(tmp_path)
    coord.start()
    put_delta(coord.transport, "a", 3, g(1.0))
    coord.close()
    ckpt = coord.state_dict()
    assert ckpt["master"]["outer_step"] == 1
    fresh = _master(tmp_path / "other")  # another repository and state dir, same checkpoint
    fresh.load_state_dict(ckpt)
    fresh.start()
    fresh.close()
    assert fresh.installer.outer_step == 1 and published(fresh.transport)[2]["outer_step"] == 1


def test_transient_write_errors_on_the_master_never_raise(tmp_path):
    repo = Spy(DirectoryTransport(tmp_path / "repo"))
    loop, _ = make_loop(repo, lr=1.0, momentum=0.0)
    repo.fail_writes = 3
    assert loop.publish() is False
    put_delta(repo.inner, "a", 1, g(1.0))
    loop.run_once(), loop.run_once()
    assert loop.errors == 3 and published(repo)[2]["outer_step"] == 1
    with pytest.raises(TransientError):
        repo.fail_revisions = 1
        loop.run_once()  # a failed listing raises out of run_once; the thread catches it (test above)


def test_master_refuses_a_repository_of_another_model_and_replaces_a_corrupt_global(tmp_path):
    from dumb_helpers import publish, publish_raw

    from diloco.dumb_diloco.settings import DumbDiLoCoError

    publish(DirectoryTransport(tmp_path / "repo"), Tiny(bf16=True).state_dict(), 3)
    with pytest.raises(DumbDiLoCoError, match="is not this model"):
        _master(tmp_path).start()
    other = tmp_path / "other"
    publish_raw(
        DirectoryTransport(other / "repo"), {**Tiny().state_dict(), "b": torch.tensor([float("nan"), 0])}, 5
    )
    coord = _master(other)
    coord.start()
    coord.close()
    info = published(DirectoryTransport(other / "repo"))[2]
    assert info["outer_step"] == 6  # above the corrupt one, so every reader installs it


# ====================================================================================================
# Past the specification, part 2 (formerly tests/test_dumb_part2_master.py):
# Past the specification, part 2: the master's published unit (global weights + step_count.json + ledger
# + outer momentum + lease, one write), exact takeover by a replacement master, garbage collection of
# processed deltas in the publication's write, and the single-master lease.


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
    assert ref.pending == 0
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


class DeletedFirst(DirectoryTransport):
    """A repository where someone else deletes what a write would delete, a moment before the write."""

    def write(self, files, delete=(), message="", parent_revision=None):
        if delete:
            super().write({}, delete, message="someone else")
        return super().write(files, delete, message, parent_revision)


def test_gc_never_blocks_a_publication(tmp_path):
    repo = DeletedFirst(tmp_path / "repo")
    loop, _ = make_loop(repo, keep_deltas=1)
    put_delta(repo, "a", 3, g(0.1))
    loop.run_once()
    put_delta(repo, "a", 6, g(0.2))
    assert loop.run_once().published  # its GC of a@3 found it gone: published without the deletion
    assert loop.publication.published_step == 2 and {f.path for f in repo.list("nodes")} == {
        delta_path("a", 6)
    }


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
    a.outer.publication.wall_clock = lambda: lease["heartbeat"]
    a.outer.publication.cadence.last_lease = -1e9
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
    loop.publication.cadence.last_lease -= 31
    put_delta(repo, "a", 3, g(1.0))
    assert not loop.run_once().published and "m2" in loop.fenced
    assert json.loads(repo.read(GLOBAL_STEP_PATH))["outer_step"] == 0  # nothing overwritten


# ====================================================================================================
# Past the specification, part 2 (formerly tests/test_dumb_part2_hostile.py):
# Past the specification, part 2: hostile and broken inputs on the master, one test each. Each must be
# rejected, logged with its reason, recorded in the ledger as "rejected" with that reason (and published
# with it), never crash the master, and a valid delta afterwards is still applied.


CAP = 4096


class Planted:
    """A repository view with extra listed files (paths a Hub repo can hold but our writers refuse)."""

    def __init__(self, inner, extra=()):
        self.inner, self.extra = inner, list(extra)

    def list(self, prefix, revision=None):
        return sorted(self.inner.list(prefix, revision) + self.extra, key=lambda f: f.path)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def make(tmp_path, transport=None, **kw):
    repo = DirectoryTransport(tmp_path / "repo")
    return make_loop(transport or repo, max_file_bytes=CAP, **kw)[0], repo


def check(loop, repo, caplog, node, step, words):
    """The hostile file is rejected with a reason containing `words`, logged, in the (published) ledger;
    a valid delta is applied in the same poll and the master keeps going."""
    put_delta(repo, "good", 3, g(2.0))
    result = loop.run_once()  # never raises
    assert [e.node_id for e in result.applied] == ["good"]
    assert torch.allclose(loop.state.weights["w"], W0 - LR * (2.0 + MU * 2.0), atol=1e-6)  # as if alone
    (bad,) = [e for e in loop.state.ledger.entries() if e.status == "rejected"]
    assert (bad.node_id, bad.local_step) == (node, step) and words in bad.reason, bad
    assert "rejected delta" in caplog.text and words in caplog.text
    published = json.loads(repo.read(GLOBAL_LEDGER_PATH))["entries"]
    assert any(r["status"] == "rejected" and r["reason"] == bad.reason for r in published)
    # not rejected again, and the next valid delta is applied too
    put_delta(repo, "good", 6, g(1.0))
    r = loop.run_once()
    assert r.rejected == [] and [e.local_step for e in r.applied] == [6]


def test_sha256_mismatch(tmp_path, caplog):
    loop, repo = make(tmp_path)
    blob = bytearray(encode(g(1.0), DeltaMeta("evil", 3, 0).to_header()))
    blob[-1] ^= 0x01  # one payload bit flipped after the hash was taken
    repo.write({delta_path("evil", 3): bytes(blob)})
    check(loop, repo, caplog, "evil", 3, "SHA-256")


def test_header_lying_about_offsets(tmp_path, caplog):
    loop, repo = make(tmp_path)
    blob = encode(g(1.0), DeltaMeta("evil", 3, 0).to_header())
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    header["w"]["data_offsets"] = [0, 64]  # claims 64 bytes for a [2, 2] float32 tensor (16)
    raw = json.dumps(header).encode()
    repo.write({delta_path("evil", 3): struct.pack("<Q", len(raw)) + raw + blob[8 + n :]})
    loop.run_once()
    (bad,) = [e for e in loop.state.ledger.entries() if e.status == "rejected"]
    assert "offset" in bad.reason or "size" in bad.reason, bad.reason
    check(loop, repo, caplog, "evil", 3, bad.reason)


def test_oversized_file_is_refused_from_its_listed_size_without_download(tmp_path, caplog):
    loop, repo = make(tmp_path)
    big = {"w": torch.ones(40, 40), "b": torch.ones(2)}  # 6.4 kB > CAP
    repo.write({delta_path("evil", 3): encode(big, DeltaMeta("evil", 3, 0).to_header())})
    reads = []
    real_read, real_header = repo.read, repo.read_header
    repo.read = lambda path, *a, **k: (reads.append(path), real_read(path, *a, **k))[1]  # type: ignore[method-assign]
    repo.read_header = lambda path, *a, **k: (reads.append(path), real_header(path, *a, **k))[1]  # type: ignore[method-assign]
    check(loop, repo, caplog, "evil", 3, "over the cap")
    assert delta_path("evil", 3) not in reads


def test_pickle_renamed_safetensors(tmp_path, caplog):
    loop, repo = make(tmp_path)
    buf = io.BytesIO()
    torch.save(g(1.0), buf)  # a pickle: never unpickled
    repo.write({delta_path("evil", 3): buf.getvalue()})
    check(loop, repo, caplog, "evil", 3, "torch.save")


def test_node_outside_collaborators_is_recorded_as_rejected(tmp_path, caplog):
    loop, repo = make(tmp_path, collaborators=["good"])
    put_delta(repo, "intruder", 3, g(100.0))
    check(loop, repo, caplog, "intruder", 3, "collaborators")
    (e,) = [e for e in loop.state.ledger.entries() if e.node_id == "intruder"]
    assert e.sha256 == "not-a-collaborator"  # its real identity stays free for a master that allows it


def test_path_unsafe_node_directory_planted_in_the_repo(tmp_path, caplog):
    repo = DirectoryTransport(tmp_path / "repo")
    planted = Planted(
        repo,
        [RemoteFile("nodes/../delta_3.safetensors", 100), RemoteFile("nodes/a b/delta_3.safetensors", 100)],
    )
    loop, _ = make(tmp_path, transport=planted)
    put_delta(repo, "good", 3, g(2.0))
    result = loop.run_once()
    assert [e.node_id for e in result.applied] == ["good"]
    reasons = sorted(e.reason for e in result.rejected)
    assert len(reasons) == 2 and all("path-unsafe" in r for r in reasons), reasons
    assert "path-unsafe" in caplog.text
    put_delta(repo, "good", 6, g(1.0))
    r = loop.run_once()
    assert r.rejected == [] and [e.local_step for e in r.applied] == [6]

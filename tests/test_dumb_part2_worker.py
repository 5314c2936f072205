"""Past the specification, part 2, the node side: exact restart mid-inner-loop from a trainer checkpoint,
and a closed coordinator that cannot be started again."""

from __future__ import annotations

import io
import time

import pytest
import torch
from dumb_helpers import FakeClock, Tiny, nudge, publish, settings, worker

from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import DumbDiLoCoError
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.dumb_diloco.wire.repo_paths import delta_path
from diloco.dumb_diloco.wire.tensor_format import decode

pytestmark = pytest.mark.usefixtures("no_network")


def read_delta(transport, node_id, step):
    return decode(transport.read(delta_path(node_id, step)), max_bytes=2**20)


def step(coord, i):
    coord.on_step(i)
    deadline = time.monotonic() + 60
    while coord.uploading:  # v2: no boundary skipped for a busy uploader
        assert time.monotonic() < deadline, "the upload never finished"
        time.sleep(0.01)


def roundtrip(obj):
    """Through torch.save/torch.load(weights_only=True), as the trainer's checkpoint does."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("v2", [False, True])
def test_resumed_worker_sends_the_delta_of_an_uninterrupted_one(tmp_path, v2):
    kw = dict(inner_steps=4, async_delta_upload=v2, async_global_poll=v2)
    steps = [0.1, -0.2, 0.3, 0.05, 0.4, -0.1, 0.2, 0.15]  # one "optimizer step" each
    # uninterrupted
    ref, ref_repo, ref_model = worker(tmp_path / "ref", **kw)
    for i, x in enumerate(steps, 1):
        nudge(ref_model, x)
        step(ref, i)
    ref.close()
    # interrupted after step 6 (mid-inner-loop: boundary at 4, next at 8), restarted from the checkpoint
    coord, repo, model = worker(tmp_path / "run", **kw)
    for i, x in enumerate(steps[:6], 1):
        nudge(model, x)
        step(coord, i)
    ckpt = roundtrip({"model": model.state_dict(), "strategy": coord.state_dict()})
    coord.close()
    model2 = Tiny()
    model2.load_state_dict(ckpt["model"])
    again = DumbDiLoCo(
        model2,
        settings(tmp_path / "run" / "repo", **kw),
        DirectoryTransport(tmp_path / "run" / "repo"),
        clock=FakeClock(),
        tokens_per_step=64,
        samples_per_step=4,
    )
    again.load_state_dict(ckpt["strategy"])
    again.start()
    for i, x in enumerate(steps[6:], 7):
        nudge(model2, x)
        step(again, i)
    again.close()
    got, meta = read_delta(repo, "w1", 8)
    want, want_meta = read_delta(ref_repo, "w1", 8)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert meta["tokens_since_baseline"] == want_meta["tokens_since_baseline"] == str(4 * 64)
    assert meta["base_outer_step"] == want_meta["base_outer_step"]


def test_resume_keeps_a_newer_global_for_the_next_boundary(tmp_path):
    coord, repo, model = worker(tmp_path, inner_steps=3)
    nudge(model, 0.5)
    coord.on_step(1)
    ckpt = roundtrip({"model": model.state_dict(), "strategy": coord.state_dict()})
    coord.close()
    newer = {k: t + 1 if t.is_floating_point() else t for k, t in Tiny().state_dict().items()}
    publish(repo, newer, 1)  # published while the node was down
    model2 = Tiny()
    model2.load_state_dict(ckpt["model"])
    again = DumbDiLoCo(model2, settings(tmp_path / "repo", inner_steps=3), repo, clock=FakeClock())
    again.load_state_dict(ckpt["strategy"])
    again.start()
    nudge(model2, 0.25)
    again.on_step(2)
    assert again.installed_outer_step == 0 and torch.equal(
        model2.w, Tiny().w + 0.75
    )  # not installed mid-loop
    nudge(model2, 0.25)
    assert again.on_step(3).installed and again.installed_outer_step == 1
    delta, _ = read_delta(repo, "w1", 3)
    assert torch.allclose(delta["w"], torch.full((2, 2), -1.0))  # steps 1-3, none lost
    again.close()


def test_a_closed_coordinator_cannot_be_started_again(tmp_path):
    coord, _, model = worker(tmp_path)
    coord.close()
    with pytest.raises(DumbDiLoCoError, match="closed"):
        coord.on_step(1)
    with pytest.raises(DumbDiLoCoError, match="closed"):
        coord.start()


def test_bounded_shutdown_reports_the_delta_it_could_not_upload(tmp_path, caplog):
    import threading

    coord, repo, model = worker(tmp_path, inner_steps=1, async_delta_upload=True, shutdown_timeout=0.2)
    repo.block_writes = threading.Event()  # the repository hangs (until the end of this test, 60 s at most)
    nudge(model, 0.1)
    coord.on_step(1)
    assert repo.writes_started.wait(60)
    t0 = time.monotonic()
    coord.close()
    # close() gave up after shutdown_timeout: the write is still blocked, and waiting for it would have
    # taken the blocked write's 60 s (the bound leaves a loaded machine all the rest)
    assert coord.uploading and time.monotonic() - t0 < 30
    assert "nodes/w1/delta_1.safetensors (1 step(s)) was still uploading" in caplog.text
    repo.block_writes.set()

"""The worker lifecycle (spec "Inner-loop lifecycle", steps 2-7; step 1 is the trainer's, tested in
test_dumb_config.py), v1 and v2, on a tiny model whose numbers are followed by hand.

Each test names the step it pins down: it fails if that step is skipped or done wrong.
"""

from __future__ import annotations

import io
import logging
import threading
import time

import pytest
import torch
from dumb_helpers import FakeClock, Tiny, nudge, publish, publish_raw, settings, worker
from polling import wait_until

from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import DumbDiLoCoError
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.dumb_diloco.wire.repo_paths import GLOBAL_WEIGHTS_PATH, delta_path
from diloco.dumb_diloco.wire.tensor_format import DeltaMeta, decode

pytestmark = pytest.mark.usefixtures("no_network")


def read_delta(transport, node_id: str, step: int):
    tensors, meta = decode(transport.read(delta_path(node_id, step)), max_bytes=2**20)
    return tensors, DeltaMeta.from_header(meta)


def deltas_on_disk(transport) -> list[str]:
    return [f.path for f in transport.list("nodes") if f.path.endswith(".safetensors")]  # not final.json


# ------------------------------------------------------------------ steps 2-4: boundary, delta, upload


def test_step2_boundaries_are_local_step_multiples_of_inner_steps(tmp_path):
    coord, repo, model = worker(tmp_path, inner_steps=3)
    for step in range(1, 8):
        nudge(model, 0.1)
        result = coord.on_step(step)
        assert bool(result.metrics) == (step % 3 == 0)  # the trainer logs boundary steps
    assert deltas_on_disk(repo) == ["nodes/w1/delta_3.safetensors", "nodes/w1/delta_6.safetensors"]


def test_step3_delta_is_float32_baseline_minus_current(tmp_path):
    model = Tiny(complex_param=True, bf16=True)
    initial = {k: t.clone() for k, t in model.state_dict().items()}
    coord, repo, _ = worker(tmp_path, model=model)
    for step in (1, 2, 3):
        nudge(model, 0.25)
        coord.on_step(step)
    delta, _ = read_delta(repo, "w1", 3)
    # floating and complex entries only: the integer buffer is never part of a delta
    assert set(delta) == {"w", "b", "z", "h"} and all(t.dtype == torch.float32 for t in delta.values())
    now = {k: t.clone() for k, t in model.state_dict().items()}
    for k in ("w", "b", "h"):
        assert torch.equal(delta[k], initial[k].float() - now[k].float()), k
    assert torch.equal(delta["z"], torch.view_as_real(initial["z"]) - torch.view_as_real(now["z"]))
    # the baseline moved to the uploaded state: the next delta covers only the steps since
    nudge(model, 1.0)
    coord.on_step(4), coord.on_step(5), coord.on_step(6)
    second, _ = read_delta(repo, "w1", 6)
    assert torch.allclose(second["w"], now["w"] - model.w.detach())


def test_step3_failed_upload_stays_in_the_next_cumulative_delta(tmp_path):
    coord, repo, model = worker(tmp_path)
    start = model.w.detach().clone()
    repo.fail_writes = 1  # the transport gave up after its retries
    for step in range(1, 7):
        nudge(model, 0.5)
        coord.on_step(step)  # never raises
    assert deltas_on_disk(repo) == ["nodes/w1/delta_6.safetensors"]
    delta, meta = read_delta(repo, "w1", 6)
    assert torch.allclose(delta["w"], start - model.w.detach())  # all six steps
    assert meta.tokens_since_baseline == 6 * 64 and meta.samples_since_baseline == 6 * 4
    assert coord.counters.upload_failures == 1 and coord.counters.uploads == 1


def test_step4_upload_path_and_metadata(tmp_path):
    coord, repo, model = worker(tmp_path, node_id="node-a.1")
    nudge(model, 0.1)
    for step in (1, 2, 3):
        coord.on_step(step)
    _, meta = read_delta(repo, "node-a.1", 3)  # decode checked format_version and payload SHA-256
    assert meta.node_id == "node-a.1" and meta.local_step == 3 and meta.base_outer_step == 0
    assert meta.tokens_since_baseline == 3 * 64 and meta.samples_since_baseline == 3 * 4
    assert meta.dtype == "float32" and meta.created_at and len(meta.payload_sha256) == 64
    assert coord.counters.bytes_uploaded == len(repo.read(delta_path("node-a.1", 3)))


# ------------------------------------------------------------------ step 5: polling


def test_step5_polls_at_boundaries_and_at_most_once_per_interval_between(tmp_path):
    clock = FakeClock()
    coord, repo, model = worker(tmp_path, clock=clock, inner_steps=100, poll_interval=1.0)
    before = repo.count("revision")
    for step in range(1, 40):  # 3.9 s of steps at 0.1 s each, no boundary
        clock.advance(0.1)
        coord.on_step(step)
    polls = repo.count("revision") - before
    assert 3 <= polls <= 4
    coord.on_step(100)  # a boundary polls whatever the interval
    assert repo.count("revision") - before == polls + 1


def test_step5_poll_finds_a_new_global_and_6_installs_it_only_at_a_boundary(tmp_path):
    clock = FakeClock()
    coord, repo, model = worker(tmp_path, clock=clock, inner_steps=3, poll_interval=1.0)
    new = {k: t + 10 if t.is_floating_point() else t for k, t in model.state_dict().items()}
    publish(repo.inner, new, 1)
    clock.advance(2.0)
    nudge(model, 0.1)
    assert not coord.on_step(1).installed  # polled (staged) but not installed between boundaries
    assert repo.count("read", GLOBAL_WEIGHTS_PATH) == 2  # startup + this poll
    assert not torch.equal(model.w.detach(), new["w"])
    coord.on_step(2)
    result = coord.on_step(3)
    assert result.installed and coord.installer.outer_step == 1
    assert torch.equal(model.w.detach(), new["w"]) and torch.equal(model.b.detach(), new["b"])
    assert result.metrics["outer/step"] == 1


def test_step5_poll_failures_never_reach_the_training_loop(tmp_path):
    coord, repo, model = worker(tmp_path)
    repo.fail_revisions = 5
    for step in range(1, 7):
        coord.on_step(step)
    assert coord.counters.poll_failures == 2 and coord.counters.uploads == 2


# ------------------------------------------------------------------ step 6: install


def test_step6_install_replaces_weights_and_resets_the_baseline(tmp_path):
    coord, repo, model = worker(tmp_path)
    nudge(model, 0.5)
    coord.on_step(1), coord.on_step(2)
    new = {k: t * 2 if t.is_floating_point() else t for k, t in model.state_dict().items()}
    publish(repo.inner, new, 1)
    assert coord.on_step(3).installed
    assert torch.equal(model.w.detach(), new["w"])
    nudge(model, 0.25)
    coord.on_step(4), coord.on_step(5), coord.on_step(6)
    delta, meta = read_delta(repo, "w1", 6)
    assert torch.allclose(delta["w"], torch.full((2, 2), -0.25)) and meta.base_outer_step == 1


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda sd: {**sd, "w": torch.zeros(3, 2)}, id="wrong-shape"),
        pytest.param(lambda sd: {**sd, "w": sd["w"].double()}, id="wrong-dtype"),
        pytest.param(lambda sd: {k: t for k, t in sd.items() if k != "b"}, id="missing-key"),
        pytest.param(lambda sd: {**sd, "extra": torch.ones(1)}, id="extra-key"),
        pytest.param(lambda sd: {**sd, "w": torch.full((2, 2), float("nan"))}, id="nan"),
        pytest.param(lambda sd: {**sd, "b": torch.tensor([float("inf"), 0.0])}, id="inf"),
    ],
)
def test_step6_incompatible_global_is_never_installed(tmp_path, bad, caplog):
    coord, repo, model = worker(tmp_path)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    publish_raw(repo.inner, bad(dict(model.state_dict())), 1)
    with caplog.at_level(logging.ERROR, logger="diloco.dumb_diloco"):
        for step in range(1, 7):
            assert not coord.on_step(step).installed
    assert all(torch.equal(before[k], t) for k, t in model.state_dict().items())
    assert (
        coord.installer.outer_step == 0 and coord.counters.rejected_globals == 1
    )  # downloaded once, not per poll
    assert "not installing" in caplog.text


def test_step6_global_whose_metadata_disagrees_with_step_count_is_rejected(tmp_path):
    coord, repo, model = worker(tmp_path)
    publish_raw(repo.inner, dict(model.state_dict()), 2, meta_step=1)
    for step in (1, 2, 3):
        assert not coord.on_step(step).installed
    assert coord.counters.rejected_globals == 1


# ------------------------------------------------------------------ step 7: reset


def test_step7_reset_is_reported_exactly_when_a_global_was_installed(tmp_path):
    coord, repo, model = worker(tmp_path)
    results = []
    for step in range(1, 10):
        if step == 4:
            publish(repo.inner, model.state_dict(), 1)
        results.append(coord.on_step(step).reset_optimizer)
    assert results == [False] * 5 + [True] + [False] * 3


def test_step7_reset_is_off_when_configured_off(tmp_path):
    coord, repo, model = worker(tmp_path, reset_inner_optimizer=False)
    publish(repo.inner, model.state_dict(), 1)
    assert [coord.on_step(s).reset_optimizer for s in (1, 2, 3)] == [False, False, False]
    assert coord.installer.outer_step == 1


def test_step7_strategy_clears_the_inner_optimizer(tmp_path):
    coord, repo, model = worker(tmp_path)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    strategy = coord  # the node is the trainer's strategy
    coord.optimizer = opt
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert opt.state
    publish(repo.inner, model.state_dict(), 1)
    for step in (1, 2):
        strategy.after_inner_step(step)
        assert opt.state
    strategy.after_inner_step(3)
    assert not opt.state


# ------------------------------------------------------------------ v2: background upload and poll


def test_v2_boundary_with_upload_in_flight_is_skipped_and_nothing_is_lost(tmp_path, caplog):
    coord, repo, model = worker(tmp_path, async_delta_upload=True, async_global_poll=True)
    start = model.w.detach().clone()
    repo.block_writes = threading.Event()
    for step in (1, 2, 3):
        nudge(model, 0.5)
        coord.on_step(step)  # returns at once: the uploader thread holds the write
    assert repo.writes_started.wait(60)
    after_first = model.w.detach().clone()
    with caplog.at_level(logging.INFO, logger="diloco.dumb_diloco"):
        for step in (4, 5, 6):
            nudge(model, 0.5)
            coord.on_step(step)
    assert coord.counters.skipped_boundaries == 1 and "skipped" in caplog.text
    repo.block_writes.set()
    wait_until(lambda: not coord.uploader.uploading)
    for step in (7, 8, 9):
        nudge(model, 0.5)
        coord.on_step(step)
    coord.close()
    d3, _ = read_delta(repo, "w1", 3)
    d9, meta9 = read_delta(repo, "w1", 9)
    assert deltas_on_disk(repo.inner) == ["nodes/w1/delta_3.safetensors", "nodes/w1/delta_9.safetensors"]
    assert torch.allclose(d3["w"], start - after_first)
    assert torch.allclose(d9["w"], after_first - model.w.detach())  # steps 4-9, the skipped ones included
    assert torch.allclose(d3["w"] + d9["w"], start - model.w.detach())
    assert meta9.tokens_since_baseline == 6 * 64
    uploads = [t for op, arg, t in repo.calls if op == "write" and arg.endswith(".safetensors")]
    assert uploads and all(t.startswith("dumb-diloco-upload") for t in uploads)  # never the training thread


def test_v2_failed_upload_is_carried_even_across_an_install(tmp_path):
    coord, repo, model = worker(tmp_path, async_delta_upload=True, async_global_poll=False)
    repo.fail_writes = 1
    nudge(model, 0.5)
    new = {k: t + 1 if t.is_floating_point() else t for k, t in model.state_dict().items()}
    publish(repo.inner, new, 1)
    coord.on_step(1), coord.on_step(2)
    assert coord.on_step(3).installed  # captured (job enqueued), then installed
    wait_until(lambda: not coord.uploader.uploading)
    nudge(model, 0.25)
    coord.on_step(4), coord.on_step(5), coord.on_step(6)
    coord.close()
    assert deltas_on_disk(repo.inner) == ["nodes/w1/delta_6.safetensors"]
    d6, _ = read_delta(repo, "w1", 6)
    assert torch.allclose(d6["w"], torch.full((2, 2), -0.75))  # the failed -0.5 plus -0.25 on the new global


def test_v2_reused_snapshot_buffers_give_exact_deltas_across_installs_and_failures(tmp_path):
    """The v2 boundary copies the weights once into a reused buffer, and the uploader subtracts (into the
    snapshot itself at the install's boundary, delta_file.py). Eight boundaries with a failed upload and
    an install between them: every delta on disk is exactly float32(state at the previous capture or
    install) - float32(now) (+ the carry), and the buffers are reused: three snapshot buffers allocated in all
    (the node keeps one free buffer, so the install's boundary, which frees two, drops one)."""
    coord, repo, model = worker(tmp_path, inner_steps=1, async_delta_upload=True, async_global_poll=False)
    reference = {k: t.float().clone() for k, t in model.state_dict().items() if t.is_floating_point()}
    expected, carry, allocated, snapshot = {}, None, [], coord.buffers.snapshot

    def counting(state):  # a snapshot buffer allocated, not taken from the one kept free
        allocated.append(not coord.buffers.free)
        return snapshot(state)

    coord.buffers.snapshot = counting
    for step in range(1, 9):
        nudge(model, 0.125 * step)  # a different, exactly representable change each round
        if step == 4:
            repo.fail_writes = 1  # this delta is carried into step 5's
        now = {k: t.float().clone() for k, t in model.state_dict().items() if t.is_floating_point()}
        want = {k: reference[k] - now[k] for k in now}
        if carry is not None:
            want = {k: want[k] + carry[k] for k in want}
        if step == 6:  # a new global arrives: installed right after this boundary's capture
            new = {k: t + 2 if t.is_floating_point() else t for k, t in model.state_dict().items()}
            publish(repo.inner, new, 1)
        installed = coord.on_step(step).installed
        wait_until(lambda: not coord.uploader.uploading)
        coord.collect()
        carry = want if step == 4 else None
        if step != 4:
            expected[step] = want
        reference = {k: t.float().clone() for k, t in model.state_dict().items() if t.is_floating_point()}
        assert installed == (step == 6)
    coord.close()
    assert sorted(expected) == [1, 2, 3, 5, 6, 7, 8]
    for step, want in expected.items():
        got, _ = read_delta(repo, "w1", step)
        for k in want:
            assert torch.equal(got[k], want[k]), (step, k)
    assert coord.counters.upload_failures == 1 and sum(allocated) == 3


def test_v2_polls_in_the_background_and_installs_on_the_training_thread(tmp_path):
    clock = FakeClock()
    coord, repo, model = worker(tmp_path, clock=clock, async_global_poll=True)
    new = {k: t + 3 if t.is_floating_point() else t for k, t in model.state_dict().items()}
    publish(repo.inner, new, 1)
    repo.calls.clear()
    clock.advance(2.0)
    coord.on_step(1)  # asks the poll lane
    wait_until(lambda: not coord.poller.in_flight)
    coord.on_step(2)  # collects the staged global, does not install it
    assert not torch.equal(model.w.detach(), new["w"])
    installed = coord.on_step(3).installed
    reads = [t for op, _, t in repo.calls if op in ("revision", "read")]
    coord.close()
    assert installed and torch.equal(model.w.detach(), new["w"])
    assert reads and all(t.startswith("dumb-diloco-poll") for t in reads)


# ------------------------------------------------------------------ start-up and shutdown


def test_worker_waits_for_the_first_global_and_installs_it(tmp_path):
    repo = DirectoryTransport(tmp_path / "repo")
    model = Tiny()
    target = {k: t - 1 if t.is_floating_point() else t + 1 for k, t in model.state_dict().items()}
    waits = []

    def sleep(seconds):  # the worker found no global and waits: the master publishes meanwhile
        if not waits:
            publish(repo, target, 4)
        waits.append(seconds)

    s = settings(tmp_path / "repo", poll_interval=0.05, startup_timeout=60)
    coord = DumbDiLoCo(model, s, repo, sleep=sleep)
    coord.start()
    assert waits == [0.05]  # it waited one poll_interval, then found and installed the global
    assert coord.installer.outer_step == 4
    assert all(torch.equal(target[k], t) for k, t in model.state_dict().items())  # the int buffer too


def test_worker_without_a_master_fails_with_a_clear_error(tmp_path):
    coord = DumbDiLoCo(Tiny(), settings(tmp_path / "nothing-here", startup_timeout=0.3, poll_interval=0.05))
    with pytest.raises(
        DumbDiLoCoError, match=r"no global model in .*start the master \(distributed.role=master\)"
    ):
        coord.connect()


def test_state_dict_is_loadable_with_weights_only(tmp_path):
    coord, repo, model = worker(tmp_path)
    for step in (1, 2, 3):
        coord.on_step(step)
    torch.save(coord.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    other = DumbDiLoCo(Tiny(), settings(tmp_path / "repo"), repo)
    other.load_state_dict(state)
    assert other.counters.uploads == 1 and other.counters.bytes_uploaded == coord.counters.bytes_uploaded
    summary = coord.summary()
    assert summary["comm/total_bytes"] == coord.counters.bytes_uploaded + coord.counters.bytes_downloaded > 0


def test_a_global_of_another_model_fails_fast_a_corrupt_one_is_waited_out(tmp_path):
    repo = DirectoryTransport(tmp_path / "repo")
    publish(repo, Tiny(complex_param=True).state_dict(), 0)  # a different model
    waits = []
    coord = DumbDiLoCo(Tiny(), settings(tmp_path / "repo", startup_timeout=30), repo, sleep=waits.append)
    with pytest.raises(DumbDiLoCoError, match="is not this model .*same model config"):
        coord.connect()
    assert waits == []  # at the first look, without waiting for a better one
    bad = DirectoryTransport(tmp_path / "bad")
    publish_raw(bad, {**Tiny().state_dict(), "w": torch.full((2, 2), float("nan"))}, 0)
    waiting = DumbDiLoCo(Tiny(), settings(tmp_path / "bad", startup_timeout=0.3, poll_interval=0.05), bad)
    with pytest.raises(DumbDiLoCoError, match="NaN or Inf"):
        waiting.connect()  # waited for a valid one, then said why it gave up


def test_num_peers_comes_from_the_installed_round(tmp_path):
    from dumb_helpers import make_loop, put_delta

    coord, repo, model = worker(tmp_path)
    loop, _ = make_loop(repo.inner, model.state_dict(), lr=0.1, momentum=0.0)
    for i, node in enumerate(("a", "b", "c")):  # distinct payloads: a copy would be a duplicate
        put_delta(repo.inner, node, 3, {"w": torch.full((2, 2), 1.0 + i), "b": torch.ones(2)})
    loop.run_once()
    metrics = [coord.on_step(s).metrics for s in (1, 2, 3)][-1]
    assert metrics["outer/step"] == 1 and metrics["num_peers"] == 3


# ------------------------------------------------------------------ same start


def test_a_worker_built_with_other_initial_weights_than_the_master_refuses_to_join(tmp_path):
    """The master publishes the SHA-256 of the weights it was built with beside every global; a worker
    whose own differ (another seed, model config or transformers version) stops, naming both."""
    master = DumbDiLoCo(Tiny(), settings(tmp_path / "repo", role="master", node_id="m", poll_interval=0.05))
    master.start()
    try:
        same = DumbDiLoCo(Tiny(), settings(tmp_path / "repo", node_id="w1"))
        same.connect()  # same initial weights: joins
        other_model = Tiny()
        nudge(other_model, 1e-3)  # same shapes, other values
        other = DumbDiLoCo(other_model, settings(tmp_path / "repo", node_id="w2"))
        with pytest.raises(DumbDiLoCoError, match="initial weights differ from the master's") as err:
            other.connect()
        assert master.init_sha256 in str(err.value) and other.init_sha256 in str(err.value)
        assert master.init_sha256 != other.init_sha256
    finally:
        master.close()


# ====================================================================================================
# Past the specification, part 2 (formerly tests/test_dumb_part2_worker.py):
# Past the specification, part 2, the node side: exact restart mid-inner-loop from a trainer checkpoint,
# and a closed coordinator that cannot be started again.


def read_delta_raw(transport, node_id, step):
    return decode(transport.read(delta_path(node_id, step)), max_bytes=2**20)


def step(coord, i):
    coord.on_step(i)
    wait_until(
        lambda: not coord.uploader.uploading, "the upload"
    )  # v2: no boundary skipped for a busy uploader


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
    got, meta = read_delta_raw(repo, "w1", 8)
    want, want_meta = read_delta_raw(ref_repo, "w1", 8)
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
    assert again.installer.outer_step == 0 and torch.equal(
        model2.w, Tiny().w + 0.75
    )  # not installed mid-loop
    nudge(model2, 0.25)
    assert again.on_step(3).installed and again.installer.outer_step == 1
    delta, _ = read_delta_raw(repo, "w1", 3)
    assert torch.allclose(delta["w"], torch.full((2, 2), -1.0))  # steps 1-3, none lost
    again.close()


def test_a_closed_coordinator_cannot_be_started_again(tmp_path):
    coord, _, model = worker(tmp_path)
    coord.close()
    with pytest.raises(DumbDiLoCoError, match="closed"):
        coord.on_step(1)
    with pytest.raises(DumbDiLoCoError, match="closed"):
        coord.start()


@pytest.mark.alone  # a bound in seconds: run with the machine to itself (issue 54)
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
    assert coord.uploader.uploading and time.monotonic() - t0 < 30
    assert "nodes/w1/delta_1.safetensors (1 step(s)) was still uploading" in caplog.text
    repo.block_writes.set()

"""Issue 12, bounded memory: the master adds each valid delta to a running float32 sum as it arrives
(`aggregation.RunningSum`) and keeps only the identities of the pending ones. Checked against the
average over the whole list (`aggregation.average`, the master's step 5 before), bit for bit with equal
weights and to float32 round-off with staleness weights, and by the tensor memory a master holds."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import threading
import types

import pytest
import torch
from dumb_helpers import B0, LR, MU, W0, Spy, Tiny, g, make_loop, put_delta, settings
from polling import wait_until

from diloco.dumb_diloco.master.aggregation import RunningSum, average
from diloco.dumb_diloco.master.loop import OuterLoop
from diloco.dumb_diloco.master.recovery import MasterState
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import Settings
from diloco.dumb_diloco.store.transport import DirectoryTransport, ReadsInto
from diloco.dumb_diloco.wire.repo_paths import delta_path, final_marker_path
from diloco.dumb_diloco.wire.tensor_format import InvalidTensorFile, decode, encode

pytestmark = pytest.mark.usefixtures("no_network")

SHAPES = {"w": (64, 33), "b": (33,)}
N = 64 * 33 + 33  # float32 entries of one delta


def deltas(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=gen) * 10 ** (i % 3) for k, s in SHAPES.items()} for i in range(n)]


def shapes_loop(tmp_path, state: MasterState | None = None, **kw) -> OuterLoop:
    """A master over SHAPES (every entry 0.5) that saves its state to tmp_path/state."""
    state = state or {k: torch.full(s, 0.5) for k, s in SHAPES.items()}
    return make_loop(tmp_path, state, poll_interval=0.05, state_dir=tmp_path / "state", **kw)[0]


def expected_step(state: MasterState, mean: dict[str, torch.Tensor]) -> MasterState:
    ref = MasterState.from_checkpoint(state.to_checkpoint())
    ref.apply_outer_step(mean, 0.7, 0.9)
    return ref


def test_running_sum_is_the_average_bit_for_bit_with_equal_weights():
    ds = deltas(7)
    acc = RunningSum()
    for d in ds:
        acc.add(d)
    got, want = acc.mean(), average(ds)
    assert all(torch.equal(got[k], want[k]) for k in SHAPES)
    assert acc.count == 0 and acc.total == {}  # handed over: the next round starts empty
    acc.add(ds[0])
    assert torch.equal(acc.mean()["w"], ds[0]["w"])


def test_running_sum_with_staleness_weights_is_the_normalised_average_to_float32_round_off():
    ds, raw = deltas(5, seed=1), [1.0, 1 / 3, 0.5, 1.0, 1 / 4]
    acc = RunningSum()
    for d, w in zip(ds, raw):
        acc.add(d, w)
    got, want = acc.mean(), average(ds, [w / sum(raw) for w in raw])
    for k in SHAPES:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)


def held_tensor_bytes(obj, skip: tuple) -> int:
    """Bytes of the distinct tensor storages reachable from `obj`, not looking inside `skip` objects."""
    seen, storages, todo = {id(obj)}, {}, [obj]
    while todo:
        for ref in gc.get_referents(todo.pop()):
            if id(ref) in seen or isinstance(ref, (*skip, type, types.ModuleType, types.FunctionType)):
                continue
            seen.add(id(ref))
            if isinstance(ref, torch.Tensor):
                storages[ref.untyped_storage().data_ptr()] = ref.untyped_storage().nbytes()
            else:
                todo.append(ref)
    return sum(storages.values())


def test_pending_deltas_hold_one_sum_however_many_wait(tmp_path):
    """Before: each pending delta's tensors stayed in memory until the quorum was met."""
    loop = shapes_loop(tmp_path, min_deltas_per_round=5)
    held = []
    for i, d in enumerate(deltas(4)):
        put_delta(loop.transport, f"n{i}", 1, d)
        assert loop.run_once().applied == [] and loop.pending == i + 1
        held.append(held_tensor_bytes(loop, skip=(MasterState, DirectoryTransport)))
    assert held == [4 * N] * 4  # one float32 sum, however many deltas are pending
    assert all(not isinstance(c, tuple) for c in loop.waiting)  # identities only


def test_outer_loop_equal_weight_round_is_the_reference_bit_for_bit_and_restart_re_reads_pending(tmp_path):
    loop = shapes_loop(tmp_path, min_deltas_per_round=3)
    ds = deltas(3, seed=2)
    put_delta(loop.transport, "a", 1, ds[0])
    put_delta(loop.transport, "b", 1, ds[1])
    assert loop.run_once().applied == [] and loop.pending == 2
    loop.save_state()
    # the master dies with two deltas pending (summed in memory, not in the ledger or the saved state)
    before = MasterState.load(tmp_path / "state")
    again = shapes_loop(tmp_path, MasterState.load(tmp_path / "state"), min_deltas_per_round=3)
    assert again.pending == 0 and len(again.state.ledger) == 0
    put_delta(loop.transport, "c", 1, ds[2])
    r = again.run_once()
    assert [(e.node_id, e.status) for e in r.applied] == [
        ("a", "applied"),
        ("b", "applied"),
        ("c", "applied"),
    ]
    ref = expected_step(before, average(ds))
    assert all(torch.equal(again.state.weights[k], ref.weights[k]) for k in SHAPES)
    assert all(torch.equal(again.state.momentum[k], ref.momentum[k]) for k in SHAPES)


def test_outer_loop_staleness_weighted_round_is_the_reference(tmp_path):
    loop = shapes_loop(tmp_path, staleness_weighting=True)
    first, *ds = deltas(4, seed=3)
    put_delta(loop.transport, "a", 1, first, base=0)
    assert loop.run_once().outer_step == 1
    loop.config = dataclasses.replace(loop.config, min_deltas_per_round=3)
    before = MasterState.from_checkpoint(loop.state.to_checkpoint())
    for node, base, d in zip("bcd", (0, 1, 0), ds):
        put_delta(loop.transport, node, 2, d, base=base)
        r = loop.run_once()
    assert [e.staleness for e in r.applied] == [1, 0, 1]
    raw = [1 / 2, 1.0, 1 / 2]
    read = [decode(loop.transport.read(delta_path(n, 2)), max_bytes=2**20)[0] for n in "bcd"]
    ref = expected_step(before, average(read, [w / sum(raw) for w in raw]))
    for k in SHAPES:
        torch.testing.assert_close(loop.state.weights[k], ref.weights[k], rtol=1e-6, atol=1e-6)


def test_decode_views_are_the_loaded_tensors_without_a_copy():
    tensors = deltas(1)[0] | {"empty": torch.zeros(0, 3), "h": torch.ones(3, dtype=torch.float16)}
    blob = encode(tensors, {"note": "x"})
    loaded, _ = decode(blob, max_bytes=len(blob))
    viewed, _ = decode(blob, max_bytes=len(blob), views=True)
    for k, t in loaded.items():
        assert viewed[k].dtype == t.dtype and torch.equal(viewed[k], t), k
    start = ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value
    assert start <= viewed["w"].data_ptr() < start + len(blob)  # inside the file's bytes: no copy


class BufferWatch(DirectoryTransport):
    """The directory store, recording the buffer each `read_into` returns its bytes in."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.buffers: list[int] = []

    def read_into(self, *a, **kw):
        view = super().read_into(*a, **kw)
        self.buffers.append(id(view.obj))
        return view


def test_a_round_read_into_one_buffer_equals_a_round_of_plain_reads(tmp_path):
    """A master over the directory store reads every delta into one buffer (`ReadsInto`), one over a
    wrapper without it reads each file into fresh bytes: the same acceptances and rejections (a NaN, a
    lying payload digest, an oversized file), the same weights and momentum bit for bit."""
    ds = deltas(5, seed=4)
    ds[1] = {k: t.clone() for k, t in ds[1].items()}
    ds[1]["b"][3] = float("nan")
    big = {k: torch.zeros(s) for k, s in SHAPES.items()} | {"pad": torch.zeros(70_000)}
    loops = []
    for name, wrap in (("into", lambda t: t), ("read", Spy)):
        repo = BufferWatch(tmp_path / name / "repo")
        state = {k: torch.full(s, 0.5) for k, s in SHAPES.items()}
        loop = make_loop(wrap(repo), state, max_file_bytes=2**18)[0]
        for i, d in enumerate(ds):
            put_delta(repo, f"n{i}", 1, d)
        put_delta(repo, "liar", 1, deltas(1, seed=5)[0])
        blob = bytearray(repo.read(delta_path("liar", 1)))
        blob[-1] ^= 1  # a flipped payload bit: the header's SHA-256 no longer matches
        repo.write({delta_path("liar", 1): bytes(blob)})
        put_delta(repo, "huge", 1, big)
        r = loop.run_once()
        loops.append((loop, repo, r))
    (a, repo_a, ra), (b, repo_b, rb) = loops
    assert isinstance(a.transport, ReadsInto) and not isinstance(b.transport, ReadsInto)
    assert len(repo_a.buffers) == 6 and len(set(repo_a.buffers)) == 1 and repo_b.buffers == []
    assert a.intake.buffer is None  # not held between polls
    rows = lambda r: [(e.node_id, e.status, e.reason) for e in r.applied + r.rejected]  # noqa: E731
    assert rows(ra) == rows(rb) and len(ra.applied) == 4
    assert {e.node_id for e in ra.rejected} == {"n1", "liar", "huge"}
    for k in SHAPES:
        assert torch.equal(a.state.weights[k], b.state.weights[k])
        assert torch.equal(a.state.momentum[k], b.state.momentum[k])


def test_running_sum_of_file_views_adds_each_delta_in_one_operation_bit_for_bit():
    """Deltas decoded in place (`decode(views=True)`: views of one float32 tensor over the payload) are
    summed as one buffer; equal weights give `average` bit for bit, staleness weights the sum tensor by
    tensor to round-off (alpha * x may be fused into the add in one and not the other), and a delta of
    separate tensors (a dequantized one) mixes in tensor by tensor."""
    ds = deltas(6, seed=6)
    views = []
    for d in ds:
        blob = encode(d | {"z.empty": torch.zeros(0, 3)}, {})
        v, _ = decode(blob, max_bytes=len(blob), views=True)
        assert len({t.untyped_storage().data_ptr() for t in v.values()}) == 1  # one tensor over the payload
        views.append({k: v[k] for k in SHAPES})
    acc = RunningSum()
    for i, v in enumerate(views):
        acc.add(v if i != 3 else ds[3])  # the 4th: separate tensors, added tensor by tensor
        assert acc.packed
    got, want = acc.mean(), average(ds)
    assert all(torch.equal(got[k], want[k]) for k in SHAPES)
    assert not acc.packed and acc.total == {}
    raw, by_tensor = [1.0, 1 / 3, 0.5, 1.0, 1 / 4, 1 / 2], RunningSum()
    for v, d, w in zip(views, ds, raw):
        acc.add(v, w)
        by_tensor.add(d, w)
    got, want = acc.mean(), by_tensor.mean()
    for k in SHAPES:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)
    first = RunningSum()
    first.add(ds[0])  # a first delta of separate tensors: every later one is added tensor by tensor
    for v in views[1:]:
        first.add(v)
    assert not first.packed
    got = first.mean()
    assert all(torch.equal(got[k], average(ds)[k]) for k in SHAPES)


def test_decode_checks_an_all_float32_payload_in_one_pass_and_still_names_the_bad_tensor():
    big = torch.full((4,), 3e38)  # finite values whose sum overflows: settled element by element
    blob = encode({"a": big, "b": torch.ones(3)}, {})
    assert torch.equal(decode(blob, max_bytes=len(blob), views=True)[0]["a"], big)
    for bad in (float("nan"), float("inf")):
        b = torch.ones(3)
        b[1] = bad
        blob = encode({"a": big, "b": b, "c": torch.ones(2)}, {})
        with pytest.raises(InvalidTensorFile, match="tensor 'b' holds NaN or Inf"):
            decode(blob, max_bytes=len(blob), views=True)


# ====================================================================================================
# Past the specification, part 2 (formerly tests/test_dumb_part2_quorum.py):
# Past the specification, part 2: the master's quorum (`min_deltas_per_round`), staleness in the ledger,
# staleness weighting and delayed Nesterov, each against an update worked out by hand.


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
    # the paper's rule (arXiv 2401.09135), N = 2: each delta moves theta by lr * g / N
    # step 1: k=1 < 2, half a step on the delta; the buffer is untouched
    w1 = W0 - LR * 1.0 / 2
    # step 2: k=2, m <- mu*0 + (1.0 - 0.5)/2, and theta moves by lr * (g/2 + mu m)
    m = 0.0 * MU + (1.0 + -0.5) / 2
    w2 = w1 - LR * (-0.5 / 2 + MU * m)
    # step 3: k=1 again, half a step; m unchanged, the delta waits in the accumulator
    w3 = w2 - LR * 2.0 / 2
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
        o = coord.outer.config
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
        assert (
            off.outer.config.delayed_nesterov_period == 0 and not off.outer.config.staleness_weighting
        )  # the spec's
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
        wait_until(lambda: spy.count("list", "nodes") >= 3, "the master's third listing of nodes/", 30)
        assert started.is_alive() and not coord.started  # it has looked, and waits
        repo.write({final_marker_path("w1"): b'{"node_id": "w1", "state": "running"}'})
        started.join(30)
        assert not started.is_alive() and coord.started
    finally:
        started.join(30)
        coord.close()

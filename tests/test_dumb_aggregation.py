"""Issue 12, bounded memory: the master adds each valid delta to a running float32 sum as it arrives
(`aggregation.RunningSum`) and keeps only the identities of the pending ones. Checked against the
average over the whole list (`aggregation.average`, the master's step 5 before), bit for bit with equal
weights and to float32 round-off with staleness weights, and by the tensor memory a master holds."""

from __future__ import annotations

import ctypes
import gc
import types

import pytest
import torch
from dumb_helpers import Spy, make_loop, put_delta

from diloco.dumb_diloco.master.aggregation import RunningSum, average
from diloco.dumb_diloco.master.loop import OuterLoop
from diloco.dumb_diloco.master.recovery import MasterState
from diloco.dumb_diloco.store.transport import DirectoryTransport, ReadsInto
from diloco.dumb_diloco.wire.repo_paths import delta_path
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
    assert all(not isinstance(c, tuple) for c in loop._pending.values())  # identities only


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
    loop.min_deltas_per_round = 3
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
        assert acc._flat is not None
    got, want = acc.mean(), average(ds)
    assert all(torch.equal(got[k], want[k]) for k in SHAPES)
    assert acc._flat is None and acc.total == {}
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
    assert first._flat is None
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

"""DumbDiLoCo deltas as topk2 (issue 32; dumb_diloco/wire/delta_codec.py): per chunk of each tensor the k
largest values as 2-bit codes with 12-bit indices (diloco.sparse, synchronous DiLoCo's format), with
error feedback on the node.

Each test proves an equality: the master decodes a topk2 file to exactly `sparse.decode(sparse.encode(v))`
and the node keeps v minus that; over boundaries what the master decoded plus the node's residual equals
the sum of the node's raw deltas; a file whose chunk repeats an index, points outside its chunk or carries
a NaN level is rejected with a reason while a good delta still applies; the file is at most 1/60 of the
float32 one.
"""

from __future__ import annotations

import math

import pytest
import torch
from dumb_helpers import g, worker
from test_dumb_quant import (
    Mlp,
    assert_nothing_lost,
    assert_rejected_while_good_deltas_apply,
    decoded_by_master,
    put_raw,
    random_delta,
    run_boundaries,
    small,
    weights,
)

from diloco import sparse
from diloco.comm import SoloCollective
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.dumb_diloco.wire.delta_codec import DeltaCodec, wire_layout
from diloco.dumb_diloco.wire.global_state import delta_layout
from diloco.dumb_diloco.wire.repo_paths import delta_path
from diloco.dumb_diloco.wire.tensor_format import DeltaMeta, parse_header

pytestmark = pytest.mark.usefixtures("no_network")


def test_a_topk2_file_decodes_on_the_master_to_exactly_the_sent_values_at_under_a_60th_of_float32(tmp_path):
    model = Mlp()  # 328,576 parameters
    delta = random_delta(model, 1)
    codec = DeltaCodec("topk2")  # SparseLoCo's 64 of 4,096
    blob, residual = codec.encode(delta, DeltaMeta("w1", 3, 0))
    repo = DirectoryTransport(tmp_path / "repo")
    repo.write({delta_path("w1", 3): blob})
    got = decoded_by_master(repo, model)[3]
    for k, d in delta.items():
        want = sparse.decode(sparse.encode(d.reshape(-1), 4096, 64), d.numel(), 4096, 64).view(d.shape)
        assert torch.equal(got[k], want), k  # bit for bit
        assert torch.equal(residual[k], d - want), k  # v minus what was sent, with no residual before
        assert int(torch.count_nonzero(want)) <= 64 * sparse.num_chunks(d.numel(), 4096)
    header = parse_header(blob)
    assert header.metadata["dtype"] == "topk2" and (
        header.metadata["topk_chunk"],
        header.metadata["topk_k"],
    ) == (
        "4096",
        "64",
    )
    n_payload = sum(sparse.payload_bytes(t.numel(), 4096, 64) for t in delta.values())
    assert len(blob) == 8 + header.header_len + n_payload
    float32 = DeltaCodec("float32").encode(delta, DeltaMeta("w1", 3, 0))[0]
    assert len(float32) / len(blob) >= 60, len(float32) / len(blob)
    params = sum(t.numel() for t in delta.values())
    assert 8 * len(blob) / params < 0.5  # bits per parameter, header included
    assert 0.5 < codec.rel_error < 1  # most of the delta waits in the residual


def test_the_master_computes_the_topk2_layout_from_the_announced_chunk_and_k():
    layout = delta_layout(small().state_dict())  # a.weight 600, a.bias 20, b.weight 600, b.bias 30
    got = wire_layout(layout, DeltaMeta("a", 1, 0, dtype="topk2", topk_chunk=64, topk_k=4))
    per_chunk = 1 + 6 + 4  # codes ceil(4/4), indices 3 ceil(4/2), two bfloat16 levels
    assert got == {
        k: ((math.ceil(math.prod(s) / 64) * per_chunk,), torch.uint8) for k, (s, _) in layout.items()
    }


def test_topk2_error_feedback_loses_nothing_over_boundaries(tmp_path):
    model = small()
    kw = dict(pseudo_grad_dtype="topk2", topk_chunk=64, topk_density=1 / 16)
    coord, spy, _ = worker(tmp_path, model=model, **kw)
    run_boundaries.base, raw = weights(model), []
    run_boundaries(coord, model, range(1, 16), raw)  # 5 boundaries
    decoded = decoded_by_master(spy.inner, model)
    assert sorted(decoded) == [3, 6, 9, 12, 15] and coord.counters.uploads == 5
    assert_nothing_lost(raw, decoded.values(), coord.codec.residual)
    assert coord.metrics()["comm/cast_rel_error"] == coord.codec.rel_error > 0


def test_a_decayed_carry_on_a_node_keeps_what_synchronous_sparseloco_keeps(tmp_path):
    """topk_ef_decay 0.95 on a node: over four deltas of one tensor, each file decodes on the master to what
    sparse.TopKAverager (one worker, the same decay: synchronous SparseLoCo) sends for the same values, and
    the node's residual is that averager's carry, bit for bit (from the second delta on, the decay
    matters: the carry is never zero)."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(3, 100))  # the layout the master checks a file against
    codec = DeltaCodec("topk2", topk_density=1 / 16, topk_chunk=64, topk_ef_decay=0.95)
    avg = sparse.TopKAverager(SoloCollective(), density=1 / 16, chunk=64, decay=0.95)
    repo, gen = DirectoryTransport(tmp_path / "repo"), torch.Generator().manual_seed(3)
    for step in range(1, 5):
        d = torch.randn(3, 100, generator=gen) * 1e-2
        blob, residual = codec.encode({"w": d}, DeltaMeta("w1", step, 0))
        codec.commit(residual)
        repo.write({delta_path("w1", step): blob})
        want = avg.average_(d.reshape(-1).clone(), [d.numel()])
        assert torch.equal(decoded_by_master(repo, model)[step]["w"].reshape(-1), want), step
        assert torch.equal(codec.residual["w"].reshape(-1), avg.residuals[0][: d.numel()]), step


def test_topk2_without_error_feedback_is_refused():
    with pytest.raises(ValueError, match="needs error_feedback"):
        DeltaCodec("topk2", error_feedback=False)


# ------------------------------------------------------------------ hostile topk2 files on the master


def topk_tiny(value: float = 1.0, indices: bytes | None = None, levels: float | None = None) -> dict:
    """Tiny's delta g(value) (w: 4 values, b: 2) as topk2 payloads of one chunk of 4 keeping 2; `indices`
    replaces w's three index bytes, `levels` both of w's levels."""
    out = {k: sparse.encode(t.reshape(-1), 4, 2) for k, t in g(value).items()}
    w = out["w"]  # codes [0:1], indices [1:4], levels [4:8]
    if indices is not None:
        w[1:4] = torch.tensor(list(indices), dtype=torch.uint8)
    if levels is not None:
        w[4:8] = torch.tensor([levels, levels], dtype=torch.bfloat16).view(torch.uint8)
    return out


def put_topk(repo, tensors, **meta) -> None:
    put_raw(
        repo, tensors, **{"dtype": "topk2", "quant_block_size": None, "topk_chunk": "4", "topk_k": "2"} | meta
    )


HOSTILE = {
    "a chunk repeats an index": (
        lambda r: put_topk(r, topk_tiny(indices=bytes([1, 0x10, 0]))),
        "repeats an index",
    ),
    "an index outside its chunk": (
        lambda r: put_topk(r, topk_tiny(indices=bytes([5, 0, 0]))),
        "outside its chunk",
    ),
    "NaN level": (lambda r: put_topk(r, topk_tiny(levels=math.nan)), "NaN or Inf"),
    "k above the chunk": (lambda r: put_topk(r, topk_tiny(), topk_k="5"), "topk_k <= topk_chunk"),
    "missing chunk": (lambda r: put_topk(r, topk_tiny(), topk_chunk=None), "is missing"),
    "payload for another k": (lambda r: put_topk(r, topk_tiny(), topk_k="3"), "shape"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_topk2_files_are_rejected_with_a_reason_and_good_deltas_still_apply(tmp_path, caplog, case):
    plant, words = HOSTILE[case]
    good = lambda repo: put_topk(repo, topk_tiny(), step=6)  # noqa: E731
    assert_rejected_while_good_deltas_apply(tmp_path, caplog, plant, words, good)

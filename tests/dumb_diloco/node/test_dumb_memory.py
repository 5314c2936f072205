"""Issue 12, "Bounded memory", on the node. The upload lane computes a float32 delta into the payload of
the bytes it uploads (delta_file.py): byte for byte what tensor_format.encode writes, value for value
what pseudo_gradient computes. A worker then holds at most three model-sized buffers around a
boundary: counted here as the distinct storages its fields refer to at the moment its delta is written
and after every step (the same bound, measured as resident memory: scripts/bench_node_memory.py). The
code before this change (adcdc5c) held up to 6 in this test with `replace` (old baseline, snapshot,
delta, encoded bytes, staged global, a pooled buffer) and 4 with `translate`.
"""

from __future__ import annotations

import io
import random

import pytest
import torch
from dumb_helpers import make_loop, publish, settings

from diloco.dumb_diloco.node.lanes import DeltaJob, OwnCopy
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.dumb_diloco.wire.delta_file import DeltaFile
from diloco.dumb_diloco.wire.global_state import pseudo_gradient
from diloco.dumb_diloco.wire.tensor_format import DeltaMeta, encode

pytestmark = pytest.mark.usefixtures("no_network")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_delta_file_is_the_bytes_encode_writes(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    names = ["layers.9.w", "layers.10.w", "embed", "norm.b", "a", "é.unicode", "z.scalar", "empty"]
    shapes = {n: tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3))) for n in names}
    shapes |= {"z.scalar": (), "empty": (0, 3)}
    f = DeltaFile(shapes)
    for name, t in f.tensors.items():
        assert t.shape == shapes[name] and t.dtype == torch.float32
        t.copy_(torch.randn(shapes[name], generator=g))
    for local_step in (7, 123456789):  # headers of different lengths over the same buffer
        meta = DeltaMeta("node-1", local_step, 3, 1024, 8).to_header()
        assert bytes(f.file(meta)) == encode(f.tensors, meta)
    meta = {"long": "x" * 10_000}  # more metadata than the room kept for it: a copy, the same bytes
    assert bytes(f.file(meta)) == encode(f.tensors, meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
@pytest.mark.parametrize("in_place", [False, True])
def test_the_upload_lane_computes_the_pseudo_gradient_into_the_file(dtype, in_place):
    if in_place and dtype != torch.float32:
        pytest.skip("a snapshot is laid out as a delta file only for a float32 model")
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (5, 7), "b": (7,)}
    base = {k: torch.randn(s, generator=g).to(dtype) for k, s in shapes.items()}
    snap = {k: torch.randn(s, generator=g).to(dtype) for k, s in shapes.items()}
    delta_shapes = {k: (*s, *((2,) if dtype.is_complex else ())) for k, s in shapes.items()}
    carry = {k: torch.randn(s, generator=g) for k, s in delta_shapes.items()}
    want = pseudo_gradient(base, snap)
    for k in want:
        want[k] += carry[k]
    if in_place:
        own = OwnCopy.of_file(DeltaFile(delta_shapes))
        for k, t in snap.items():
            own[k].copy_(t)
        snap = own
    job = DeltaJob(
        1, "p", DeltaMeta("n", 1, 0), 1, base, snap, carry=carry, new_file=lambda: DeltaFile(delta_shapes)
    )
    job.in_place = in_place
    delta, _ = job.materialize()
    assert (job.file is own.file) if in_place else job.file is not None
    for k in want:
        assert torch.equal(delta[k], want[k]), k  # bit for bit


class Wide(torch.nn.Module):
    """Large enough that a delta file's header room (~4 KB) is under 1% of a model copy."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)


def held_copies(node: DumbDiLoCo, job: DeltaJob | None = None) -> float:
    """Model-sized buffers the node's fields (and the job being written) refer to, the live model aside."""
    live = {t.untyped_storage().data_ptr() for t in node.model.state_dict().values()}
    tensors = [*node.uploader.baseline.values(), *(node.installer.reference or {}).values()]
    tensors += [
        t for s in [*node.installer.pending_snapshots.values(), *node.buffers.free] for t in s.values()
    ]
    tensors += list(node.installer.staged.state.values()) if node.installer.staged is not None else []
    for j in (job, node.uploader.carry, node.uploader.in_flight):
        if j is not None:
            for d in (j.base, j.snapshot, j.delta, j.carry, j.free):
                tensors += list((d or {}).values())
            tensors += [j.file.buffer] if j.file is not None else []
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in live:
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values()) / sum(t.nbytes for t in node.model.state_dict().values())


@pytest.mark.parametrize("install", ["replace", "translate"])
def test_a_worker_holds_at_most_three_model_copies_around_a_boundary(tmp_path, install):
    repo = DirectoryTransport(tmp_path / "repo")
    publish(repo, Wide().state_dict(), 0)
    loop, _ = make_loop(repo, Wide().state_dict(), min_deltas_per_round=1)
    model = Wide()
    kw = dict(install_when_staged=True) if install == "translate" else {}
    node = DumbDiLoCo(model, settings(repo.root, inner_steps=3, install=install, **kw), repo)
    node.start()
    seen, send = [], node.uploader.send

    def counting_send(job):  # the delta's write, inside the job: the boundary's peak
        write = node.transport.write
        node.transport.write = lambda files, **kw: (seen.append(held_copies(node, job)), write(files, **kw))[
            1
        ]
        try:
            return send(job)
        finally:
            node.transport.write = write

    node.uploader.send = counting_send
    params = list(model.parameters())
    for step in range(1, 13):
        with torch.no_grad():
            torch._foreach_add_(params, 1e-3 * step)  # an inner step
        node.on_step(step)
        seen.append(held_copies(node))
        torch.save(
            node.state_dict(), io.BytesIO()
        )  # the trainer's checkpoint: snapshots laid out as files save
        if step % 3 == 0:  # the master's round, then a poll stages its global (a download, as a worker's)
            assert loop.run_once().applied
            node.stage(node.fetch_global())
            seen.append(held_copies(node))
    assert node.counters.installs >= 3 and node.counters.uploads == 4
    assert max(seen) <= 3.05, seen
    node.close()

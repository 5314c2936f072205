"""Past the specification, part 2: hostile and broken inputs on the master, one test each. Each must be
rejected, logged with its reason, recorded in the ledger as "rejected" with that reason (and published
with it), never crash the master, and a valid delta afterwards is still applied."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from dumb_helpers import LR, MU, W0, g, make_loop, put_delta

from diloco.dumb_diloco.master.recovery import GLOBAL_LEDGER_PATH
from diloco.dumb_diloco.store.transport import DirectoryTransport, RemoteFile
from diloco.dumb_diloco.wire.repo_paths import delta_path
from diloco.dumb_diloco.wire.tensor_format import DeltaMeta, encode

pytestmark = pytest.mark.usefixtures("no_network")

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

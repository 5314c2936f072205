"""diloco.files.write_atomic: a file is either its old content or its new one, never a mix, and a
writer that fails leaves no temporary file behind."""

from __future__ import annotations

import io
import os

import pytest
import torch

from diloco import files
from diloco.files import write_atomic, write_atomic_with


class Boom(RuntimeError):
    pass


def test_write_atomic_replaces_bytes_and_text(tmp_path):
    path = tmp_path / "record.json"
    write_atomic(path, b"old\n")
    assert path.read_bytes() == b"old\n"
    write_atomic(path, "néw\n")
    assert path.read_bytes() == "néw\n".encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_a_writer_that_raises_mid_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "rank0.pt"
    write_atomic(path, b"old content")

    def half_then_fail(f):
        f.write(b"new content, first half")
        f.flush()
        raise Boom

    with pytest.raises(Boom):
        write_atomic_with(path, half_then_fail)
    assert path.read_bytes() == b"old content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt"]


def test_a_failed_first_write_leaves_nothing(tmp_path):
    def fail(f):
        raise Boom

    with pytest.raises(Boom):
        write_atomic_with(tmp_path / "x", fail)
    assert list(tmp_path.iterdir()) == []


def test_a_crash_before_the_rename_leaves_the_old_file(tmp_path, monkeypatch):
    """The rename is the commit point: if the process dies before it (simulated by a failing
    os.replace), the reader still sees the complete old file and the temporary is cleaned up."""
    path = tmp_path / "summary.json"
    write_atomic(path, "old")

    def die(src, dst):
        assert open(src).read() == "new"  # the new content was complete and fsynced before the rename
        raise Boom

    monkeypatch.setattr(files.os, "replace", die)
    with pytest.raises(Boom):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_the_data_and_the_directory_are_fsynced_before_return(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else fd)
        real(fd)

    monkeypatch.setattr(files.os, "fsync", spy)
    write_atomic(tmp_path / "a", b"x")
    assert len(synced) == 2
    if os.path.exists("/proc/self/fd"):
        assert synced[0].startswith(str(tmp_path.resolve() / ".a."))  # the temporary, before the rename
        assert synced[1] == str(tmp_path.resolve())  # then the directory holding the rename


def test_torch_save_through_the_writer_round_trips(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 7}
    write_atomic_with(tmp_path / "s.pt", lambda f: torch.save(state, f))
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    assert back["step"] == 7 and torch.equal(back["w"], state["w"])
    buf = io.BytesIO()
    torch.save(state, buf)
    assert (tmp_path / "s.pt").stat().st_size == len(buf.getvalue())

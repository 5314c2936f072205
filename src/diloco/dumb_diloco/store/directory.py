"""The shared-directory store (NFS, Lustre, a local disk): immutable versions and a commit log.

Invariants: nothing is modified in place; a write becomes visible only when `os.link` creates its log
record `log/<rev>.json` (an atomic compare-and-swap, NFS included), so a reader pinned to revision R
sees exactly the units committed up to R; every file is fsynced before it is published. Plain paths
are a symlink view that may lag by milliseconds. On-disk scheme: docs/dumb_diloco.md#stores.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...files import fsync_dir, write_atomic, write_durable
from ..wire.tensor_format import DEFAULT_MAX_HEADER_BYTES, SafetensorsHeader, read_header_ranges
from .base import (
    CTRL_DIR,
    FileTooLarge,
    RemoteFile,
    RemoteNotFound,
    RevisionConflict,
    TransportError,
    check_write_args,
    validate_prefix,
    validate_repo_path,
)

_VERSION_RE = re.compile(r"^(.+)@(\d{12})-([0-9a-f]{16})(\.del)?$")
_FORMAT_LINE = "dumb-diloco directory repository, format 1\n"


@dataclass(frozen=True)
class _Version:
    name: str
    rev: int
    unit: str
    deleted: bool
    entry: str  # file name inside the index directory


class DirectoryTransport:
    """Transport over a shared directory; on-disk scheme: docs/dumb_diloco.md#stores."""

    def __init__(
        self, root: str | os.PathLike[str], *, create: bool = True, keep_old_versions_s: float = 900.0
    ):
        self.root = Path(root).expanduser().absolute()
        self.keep_old_versions_s = keep_old_versions_s
        self._ctrl = self.root / CTRL_DIR
        self._files = self._ctrl / "files"
        self._log_dir = self._ctrl / "log"
        self._tmp = self._ctrl / "tmp"
        self._log_cache: dict[int, dict[str, Any]] = {}
        self._cache_lock = threading.Lock()
        marker = self._ctrl / "FORMAT"
        if not marker.exists():
            if not create:
                raise RemoteNotFound(f"{self.root} is not a DumbDiLoCo directory repository")
            for d in (self._files, self._log_dir, self._tmp):
                d.mkdir(parents=True, exist_ok=True)
            genesis = self._tmp / f"genesis.{uuid.uuid4().hex}"
            write_durable(genesis, json.dumps({"rev": 0, "unit": "0" * 16, "time": time.time()}).encode())
            with contextlib.suppress(FileExistsError):
                os.link(genesis, self._log_path(0))
            genesis.unlink()
            write_atomic(marker, _FORMAT_LINE.encode())
        elif marker.read_text() != _FORMAT_LINE:
            raise TransportError(f"{self.root}: unknown repository format")

    def __repr__(self) -> str:
        return f"DirectoryTransport(root={str(self.root)!r})"

    # ---- log

    def _log_path(self, rev: int) -> Path:
        return self._log_dir / f"{rev:012d}.json"

    def _log(self, rev: int) -> dict[str, Any] | None:
        rec = self._log_cache.get(rev)
        if rec is not None:
            return rec
        try:
            rec = json.loads(
                self._log_path(rev).read_bytes()
            )  # {"rev", "unit", "time", "files": {path: size}, ...}
        except FileNotFoundError:
            return None
        with self._cache_lock:
            self._log_cache[rev] = rec
        return rec

    def _head(self) -> int:
        try:
            head = int((self._ctrl / "HEAD").read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            head = 0
        while self._log_path(head + 1).exists():
            head += 1
        return head

    def _resolve(self, revision: str | None) -> int:
        head = self._head()
        if revision is None:
            return head
        try:
            rev = int(revision)
        except (TypeError, ValueError):
            raise RemoteNotFound(f"unknown revision {revision!r}") from None
        if rev < 0 or rev > head:
            raise RemoteNotFound(f"unknown revision {revision!r} (head is {head})")
        return rev

    # ---- index

    def _versions(self, index_dir: Path) -> dict[str, list[_Version]]:
        out: dict[str, list[_Version]] = {}
        try:
            entries = list(os.scandir(index_dir))
        except (FileNotFoundError, NotADirectoryError):
            return out
        for e in entries:
            m = _VERSION_RE.match(e.name)
            if m is None or not e.is_file(follow_symlinks=False):
                continue
            v = _Version(m.group(1), int(m.group(2)), m.group(3), m.group(4) is not None, e.name)
            out.setdefault(v.name, []).append(v)
        for versions in out.values():
            versions.sort(key=lambda v: v.rev, reverse=True)
        return out

    def _committed(self, v: _Version) -> dict[str, Any] | None:
        rec = self._log(v.rev)
        return rec if rec is not None and rec["unit"] == v.unit else None

    def _visible(self, versions: list[_Version], rev: int) -> _Version | None:
        """The version a reader at `rev` sees (None: absent or deleted)."""
        for v in versions:
            if v.rev <= rev and self._committed(v) is not None:
                return None if v.deleted else v
        return None

    def locate(self, path: str, rev: int) -> tuple[Path, int]:
        """The file holding `path` at revision `rev`, and the size the log recorded for it."""
        validate_repo_path(path)
        parent, _, name = path.rpartition("/")
        index_dir = self._files / parent if parent else self._files
        v = self._visible(self._versions(index_dir).get(name, []), rev)
        if v is None:
            raise RemoteNotFound(f"{path} does not exist at revision {rev:012d}")
        rec = self._log(v.rev)
        assert rec is not None
        return index_dir / v.entry, int(rec.get("files", {}).get(path, -1))

    # ---- Transport API

    def revision(self) -> str:
        return f"{self._head():012d}"

    def list(self, prefix: str, revision: str | None = None) -> list[RemoteFile]:
        prefix = validate_prefix(prefix)
        rev = self._resolve(revision)
        out: list[RemoteFile] = []
        stack = [(self._files / prefix if prefix else self._files, prefix)]
        while stack:
            index_dir, rel = stack.pop()
            try:
                subdirs = [e.name for e in os.scandir(index_dir) if e.is_dir(follow_symlinks=False)]
            except (FileNotFoundError, NotADirectoryError):
                continue
            stack.extend((index_dir / d, f"{rel}/{d}" if rel else d) for d in subdirs)
            for name, versions in self._versions(index_dir).items():
                v = self._visible(versions, rev)
                if v is not None:
                    path = f"{rel}/{name}" if rel else name
                    rec = self._log(v.rev)
                    assert rec is not None
                    out.append(RemoteFile(path, int(rec["files"][path]), f"{v.rev}:{v.entry}"))
        return sorted(out, key=lambda f: f.path)

    def read(self, path: str, revision: str | None = None, max_bytes: int | None = None) -> bytes:
        file, size = self.locate(path, self._resolve(revision))
        if max_bytes is not None and size > max_bytes:
            raise FileTooLarge(f"{path} is {size} bytes, over the cap of {max_bytes}")
        try:
            return file.read_bytes()
        except FileNotFoundError:
            raise RemoteNotFound(f"{path}: this version was garbage-collected (revision too old)") from None

    def read_into(
        self, path: str, buffer: bytearray | None, revision: str | None = None, max_bytes: int | None = None
    ) -> memoryview:
        """`read`, into `buffer` (a new bytearray where the file does not fit): a view of the file's bytes,
        whose `.obj` is the buffer to pass next time. A reused buffer is resident already: reading a file
        into a fresh one page-faults on every page, ~4x the copy itself. The size is capped before reading."""
        file, size = self.locate(path, self._resolve(revision))
        try:
            with open(file, "rb", buffering=0) as f:
                size = max(size, os.fstat(f.fileno()).st_size)  # the log's size, or the file's if larger
                if max_bytes is not None and size > max_bytes:
                    raise FileTooLarge(f"{path} is {size} bytes, over the cap of {max_bytes}")
                view = memoryview(buffer if buffer is not None and len(buffer) >= size else bytearray(size))
                n = 0
                while n < size and (got := f.readinto(view[n:size])):
                    n += got
                return view[:n]
        except FileNotFoundError:
            raise RemoteNotFound(f"{path}: this version was garbage-collected (revision too old)") from None

    def read_header(
        self, path: str, revision: str | None = None, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    ) -> SafetensorsHeader:
        file, _ = self.locate(path, self._resolve(revision))
        try:
            with open(file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                return read_header_ranges(
                    path, lambda start, n: (os.pread(f.fileno(), n, start), size), max_header_bytes
                )
        except FileNotFoundError:
            raise RemoteNotFound(f"{path}: this version was garbage-collected (revision too old)") from None

    def write(
        self,
        files: dict[str, bytes],
        delete: Sequence[str] = (),
        message: str = "",
        parent_revision: str | None = None,
    ) -> str:
        files, delete = check_write_args(files, delete)
        if not files and not delete:
            return self.revision()
        parent = None if parent_revision is None else self._resolve(parent_revision)
        if parent is not None and parent != self._head():  # cheap early exit; _commit re-checks
            raise RevisionConflict(f"repository is at revision {self.revision()}, not {parent:012d}")
        unit = uuid.uuid4().hex[:16]
        # staged: (repo path, index dir, staged file, is deletion)
        staged: list[tuple[str, Path, Path, bool]] = []
        try:
            for path, data in [*files.items(), *((p, b"") for p in delete)]:
                parent_dir, _, name = path.rpartition("/")
                index_dir = self._files / parent_dir if parent_dir else self._files
                index_dir.mkdir(parents=True, exist_ok=True)
                tmp = index_dir / f".{name}.{unit}.tmp"
                write_durable(tmp, data)
                staged.append((path, index_dir, tmp, path in delete))
            for index_dir in {s[1] for s in staged}:
                fsync_dir(index_dir)
            rev = self._commit(files, delete, staged, unit, message, parent)
        except BaseException:
            for _, _, tmp, _ in staged:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            raise
        write_atomic(self._ctrl / "HEAD", str(rev).encode())  # a hint for `_head`, which probes past it
        for path in [*files, *delete]:
            with contextlib.suppress(OSError):
                self._sync_view(path)
        with contextlib.suppress(OSError):
            self._gc({s[1] for s in staged})
        return f"{rev:012d}"

    def _commit(
        self,
        files: dict[str, bytes],
        delete: list[str],
        staged: list[tuple[str, Path, Path, bool]],
        unit: str,
        message: str,
        parent: int | None,
    ) -> int:
        """Move the staged files to the versioned names of revision head+1 and link the log
        record; on a lost race, move them to the next number. Updates `staged` in place."""
        while True:
            head = self._head()
            if parent is not None and head != parent:
                raise RevisionConflict(f"repository is at revision {head:012d}, not {parent:012d}")
            for path in delete:
                try:
                    self.locate(path, head)
                except RemoteNotFound:
                    raise RemoteNotFound(f"cannot delete {path}: it does not exist") from None
            for path in files:
                self._check_no_type_clash(path, head)
            rev = head + 1
            for i, (path, index_dir, current, is_del) in enumerate(staged):
                name = path.rpartition("/")[2]
                target = index_dir / f"{name}@{rev:012d}-{unit}{'.del' if is_del else ''}"
                os.rename(current, target)
                staged[i] = (path, index_dir, target, is_del)
            record = {"rev": rev, "unit": unit, "parent": head, "time": time.time(), "message": message}
            record |= {"files": {p: len(d) for p, d in files.items()}, "deleted": list(delete)}
            tmp = self._tmp / f"log.{unit}.{rev}"
            write_durable(tmp, json.dumps(record).encode())
            try:
                os.link(tmp, self._log_path(rev))  # the commit point: fails if another writer got here first
            except FileExistsError:
                continue
            finally:
                tmp.unlink()
            fsync_dir(self._log_dir)
            return rev

    def _check_no_type_clash(self, path: str, head: int) -> None:
        parts = path.split("/")
        for i in range(1, len(parts)):
            with contextlib.suppress(RemoteNotFound):
                self.locate("/".join(parts[:i]), head)
                raise ValueError(f"cannot write {path}: {'/'.join(parts[:i])} is a file")
        if (self._files / path).is_dir() and self.list(path, f"{head:012d}"):
            raise ValueError(f"cannot write {path}: it is a directory")

    def delete(self, paths: Sequence[str]) -> str:
        return self.write({}, delete=paths, message=f"delete {len(paths)} file(s)")

    # ---- plain-path view and garbage collection

    def _sync_view(self, path: str) -> None:
        """Point <root>/<path> at the newest visible version (or remove it)."""
        parent, _, name = path.rpartition("/")
        index_dir = self._files / parent if parent else self._files
        view = self.root / path
        v = self._visible(self._versions(index_dir).get(name, []), self._head())
        if v is None:
            if view.is_symlink():
                view.unlink()
            return
        view.parent.mkdir(parents=True, exist_ok=True)
        up = "../" * path.count("/")
        target = f"{up}{CTRL_DIR}/files/{parent + '/' if parent else ''}{v.entry}"
        link_tmp = view.parent / f".{name}.{uuid.uuid4().hex[:16]}.lnk"
        os.symlink(target, link_tmp)
        os.replace(link_tmp, view)

    def _gc(self, index_dirs: set[Path]) -> None:
        now = time.time()
        grace = self.keep_old_versions_s
        for index_dir in index_dirs:
            for versions in self._versions(index_dir).values():
                newer: dict[str, Any] | None = None  # commit of the next newer committed version
                for v in versions:  # newest first
                    rec = self._committed(v)
                    if rec is None:
                        # Not committed: a writer still at work, or the leftover of a crashed one.
                        if now - os.stat(index_dir / v.entry).st_mtime > grace:
                            (index_dir / v.entry).unlink()
                        continue
                    superseded = newer is not None and now - newer["time"] > grace
                    lone_tombstone = newer is None and v.deleted and now - rec["time"] > grace
                    if superseded or lone_tombstone:
                        (index_dir / v.entry).unlink()
                    newer = rec
            for e in os.scandir(index_dir):
                if e.name.endswith(".tmp") and now - e.stat().st_mtime > max(grace, 3600):
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)

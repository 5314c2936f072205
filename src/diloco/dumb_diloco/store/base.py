"""What every DumbDiLoCo store shares: the `Transport` protocol, its errors and repository paths.

Invariants: a store moves bytes and never interprets them (`tensor_format` does); one `write` makes
all its files and deletions visible as one unit; a read pinned to a revision sees exactly the units
committed up to it; every path is checked (`validate_repo_path`) before any I/O.
Stores and their guarantees: docs/dumb_diloco.md#stores.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..wire.tensor_format import DEFAULT_MAX_HEADER_BYTES, SafetensorsHeader

CTRL_DIR = ".dumb_diloco"  # reserved: the directory store's versions and commit log


class TransportError(Exception):
    """Base class of every error a caller of a Transport should handle."""


class RemoteNotFound(TransportError):
    """The repository, revision or file does not exist (or no longer exists)."""


class FileTooLarge(TransportError):
    """A file is larger than the caller's `max_bytes`."""


class RevisionConflict(TransportError):
    """`parent_revision` was given and the repository has moved on."""


class TransientError(TransportError):
    """A retryable failure (rate limit, 5xx, network) persisted after every retry."""


class PermanentError(TransportError):
    """Authentication or permission refused (HTTP 401/403): retrying will not help; a node stops."""


def why_permanent(err: BaseException) -> str:
    """One line if `err` is a PermanentError (the node must stop), else ""."""
    return f"{type(err).__name__}: {err}" if isinstance(err, PermanentError) else ""


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    # identifies this version of the contents (Hub: git blob id; directory: its revision), "" if
    # unknown; lets a reader cache what it learnt from a file's header
    version: str = field(default="", compare=False)


@runtime_checkable
class Transport(Protocol):
    """Paths are relative POSIX paths (`validate_repo_path`). `revision=None` means the newest
    revision at the time of the call; to read several files consistently, take `revision()`
    once and pass it to every read."""

    def revision(self) -> str:
        """Current revision id (Hub: commit sha; directory: zero-padded counter)."""
        ...

    def list(self, prefix: str, revision: str | None = None) -> list[RemoteFile]:
        """Files under the directory `prefix` ("" for all), recursively, sorted by path."""
        ...

    def read(self, path: str, revision: str | None = None, max_bytes: int | None = None) -> bytes:
        """File contents; FileTooLarge above `max_bytes`, RemoteNotFound if absent."""
        ...

    def read_header(
        self, path: str, revision: str | None = None, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    ) -> SafetensorsHeader:
        """The validated safetensors header, without reading the payload
        (`tensor_format.InvalidTensorFile` if it is malformed)."""
        ...

    def write(
        self,
        files: dict[str, bytes],
        delete: Sequence[str] = (),
        message: str = "",
        parent_revision: str | None = None,
    ) -> str:
        """Write `files` and delete `delete` as one atomic unit; returns the new revision.
        RevisionConflict if `parent_revision` is given and is no longer the newest. A file's contents
        may be a buffer the caller reuses once this returns: send or copy it before returning."""
        ...

    def delete(self, paths: Sequence[str]) -> str:
        """Delete `paths` as one unit (RemoteNotFound if one is absent); returns the new revision."""
        ...


@runtime_checkable
class ReadsInto(Protocol):
    """A store that can also read a file into the caller's buffer (`DirectoryTransport.read_into`)."""

    def read_into(
        self, path: str, buffer: bytearray | None, revision: str | None = None, max_bytes: int | None = None
    ) -> memoryview:
        """The file's bytes in `buffer`, or in a new bytearray (the view's `.obj`) if they do not fit;
        FileTooLarge above `max_bytes` (before reading), RemoteNotFound if absent."""
        ...


_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def validate_repo_path(path: str) -> str:
    """Return `path` if it is a clean relative POSIX path inside the repository, else ValueError."""
    if not isinstance(path, str) or not path:
        raise ValueError("repository path must be a non-empty string")
    if _CONTROL_RE.search(path):
        raise ValueError(f"repository path {path!r} contains control characters")
    if "\\" in path:
        raise ValueError(f"repository path {path!r} contains a backslash")
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise ValueError(f"repository path {path!r} is absolute")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"repository path {path!r} has an empty, '.' or '..' component")
    if parts[0] in (CTRL_DIR, ".git"):
        raise ValueError(f"repository path {path!r} is inside the reserved {parts[0]!r} directory")
    return path


def validate_prefix(prefix: str) -> str:
    prefix = prefix.strip("/") if prefix else ""
    return validate_repo_path(prefix) if prefix else ""


def check_write_args(files: dict[str, bytes], delete: Sequence[str]) -> tuple[dict[str, bytes], list[str]]:
    """The arguments of `Transport.write`, checked: clean paths, bytes-like contents, no path both written
    and deleted."""
    if isinstance(delete, str):
        raise TypeError("delete must be a sequence of paths, not a string")
    for path, data in files.items():
        validate_repo_path(path)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"contents of {path!r} must be bytes, got {type(data).__name__}")
    delete = [validate_repo_path(p) for p in delete]
    both = set(files) & set(delete)
    if both:
        raise ValueError(f"paths both written and deleted in one unit: {sorted(both)}")
    if len(set(delete)) != len(delete):
        raise ValueError("duplicate paths in delete")
    # bytes as they are; a buffer (a node's delta laid out as its file, delta_file.py) as a read-only
    # view, not copied: valid until `write` returns, so a transport sends or copies it before returning
    return {
        p: d if isinstance(d, bytes) else memoryview(d).cast("B").toreadonly() for p, d in files.items()
    }, delete

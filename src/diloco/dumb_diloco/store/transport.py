"""Where the node and the master find their store: `open_transport` and every name they import.

Invariants: callers only ever see the `Transport` protocol and its errors (`store`); a `namespace/name`
repo_id is a Hub repository (`hub`), a path or `file://` URL a shared directory (`directory`).
Stores, retries and the on-disk scheme: docs/dumb_diloco.md#stores.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from ...files import write_atomic
from .base import (
    FileTooLarge,
    PermanentError,
    ReadsInto,
    RemoteFile,
    RemoteNotFound,
    RevisionConflict,
    TransientError,
    Transport,
    TransportError,
    validate_repo_path,
)
from .directory import DirectoryTransport
from .hub import HUB_REPO_ID_RE, HubTransport, RetryPolicy, deadline, time_left

__all__ = [
    "DirectoryTransport",
    "FileTooLarge",
    "HubTransport",
    "PermanentError",
    "ReadsInto",
    "RemoteFile",
    "RemoteNotFound",
    "RetryPolicy",
    "RevisionConflict",
    "TransientError",
    "Transport",
    "TransportError",
    "deadline",
    "open_transport",
    "time_left",
    "validate_repo_path",
    "write_atomic",
]


def open_transport(
    repo_id: str,
    token: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    endpoint: str | None = None,
    create: bool = True,
    retry: RetryPolicy | None = None,
    timeout_s: float = 60.0,
    keep_old_versions_s: float = 900.0,
) -> Transport:
    """`namespace/name` -> HubTransport; an absolute path, `./...`, `../...`, `~/...` or a
    `file://` URL -> DirectoryTransport. A bare relative path like `runs/x` would be ambiguous
    with a Hub id: write it as `./runs/x`."""
    if repo_id.startswith("file://"):
        parsed = urlparse(repo_id)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URL with a remote host is not supported: {repo_id!r}")
        return DirectoryTransport(
            unquote(parsed.path), create=create, keep_old_versions_s=keep_old_versions_s
        )
    if repo_id.startswith(("/", "./", "../", "~")) or repo_id in (".", ".."):
        return DirectoryTransport(repo_id, create=create, keep_old_versions_s=keep_old_versions_s)
    if HUB_REPO_ID_RE.fullmatch(repo_id):
        return HubTransport(
            repo_id,
            token=token,
            endpoint=endpoint,
            cache_dir=cache_dir,
            create=create,
            retry=retry,
            timeout_s=timeout_s,
        )
    raise ValueError(
        f"repo_id {repo_id!r} is neither a Hub id (namespace/name) nor a local path "
        "(absolute, ./relative, ~/..., or file://...)"
    )

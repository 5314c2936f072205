"""Files that survive a crash: the one atomic-write helper every durable record goes through.

Invariant: after `write_atomic(path, ...)` returns, `path` holds the new content on disk; if the
process dies (or the writer raises) before that, `path` holds its old content (or does not exist)
and no temporary file is left behind by a writer that raised. The steps: write a temporary file in
the same directory, flush and fsync it, rename it over `path` (atomic on POSIX), fsync the directory
so the rename itself is durable (where the platform allows opening a directory).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (a rename, a new link) durable; a no-op where directories cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_durable(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` and fsync it. Not atomic: for staging files no reader sees yet."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic_with(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> None:
    """Replace `path` with what `write(f)` writes to a binary file object (`torch.save(state, f)`)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:16]}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Replace `path` with `data` (a str is written as UTF-8); a crash leaves the old or the new file."""
    blob = data.encode() if isinstance(data, str) else data
    write_atomic_with(path, lambda f: f.write(blob))

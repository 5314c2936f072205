"""A store behind a slow link: the benchmarks' stand-in for a node's uplink to the Hub or a shared disk
(scripts/bench_boundary.py, scripts/bench_utilization.py)."""

from __future__ import annotations

import threading
import time


class ThrottledTransport:
    """A `diloco.dumb_diloco.store.transport.Transport` behind a link of `bytes_per_s` (None: unlimited).

    Every read and write of a file first waits size / bytes_per_s, one transfer at a time per
    direction (a full-duplex link), then delegates to `inner`. Listing and revisions are free (they
    are small requests). Bytes moved are counted in `bytes_up` / `bytes_down`.
    """

    def __init__(self, inner, bytes_per_s: float | None):
        self.inner, self.bytes_per_s = inner, bytes_per_s
        self._up, self._down = threading.Lock(), threading.Lock()
        self.bytes_up = self.bytes_down = 0

    def __repr__(self) -> str:
        return f"ThrottledTransport({self.inner!r}, bytes_per_s={self.bytes_per_s})"

    def _wait(self, lock, n: int) -> None:
        if self.bytes_per_s:
            with lock:
                time.sleep(n / self.bytes_per_s)

    def revision(self) -> str:
        return self.inner.revision()

    def list(self, prefix: str, revision: str | None = None):
        return self.inner.list(prefix, revision)

    def read(self, path: str, revision: str | None = None, max_bytes: int | None = None) -> bytes:
        data = self.inner.read(path, revision, max_bytes)
        self._wait(self._down, len(data))
        self.bytes_down += len(data)
        return data

    def read_header(self, path: str, revision: str | None = None, **kwargs):
        header = self.inner.read_header(path, revision, **kwargs)
        self._wait(self._down, header.payload_offset)
        self.bytes_down += header.payload_offset
        return header

    def write(self, files: dict, delete=(), message: str = "", parent_revision: str | None = None) -> str:
        n = sum(len(b) for b in files.values())
        self._wait(self._up, n)
        self.bytes_up += n
        return self.inner.write(files, delete, message, parent_revision)

    def delete(self, paths) -> str:
        return self.inner.delete(paths)

"""Communication seam of DumbDiLoCo: put/list/get files in a versioned repository.

The coordinator and the master only talk to a `Transport`: a Hugging Face model repository
(`HubTransport`) or a shared directory such as NFS or Lustre (`DirectoryTransport`). Both offer
the same operations: a cheap `revision()`, reads pinned to a revision, and `write`, which makes
several files (and deletions) visible as ONE unit, with optimistic concurrency through
`parent_revision`. Tensor files are parsed by `tensor_format`; this module moves bytes.

Errors: everything a caller should handle derives from `TransportError`: `RemoteNotFound`,
`FileTooLarge`, `RevisionConflict` and `TransientError` (retries exhausted). A file whose
safetensors header is malformed raises `tensor_format.InvalidTensorFile` from `read_header`.

Hub transport
-------------
One `write` is one `HfApi.create_commit` (CommitOperationAdd from bytes plus
CommitOperationDelete, `parent_commit=parent_revision`; a stale parent is answered with HTTP 412
and raised as RevisionConflict). `huggingface_hub` does not retry commits, so this module does:
exponential backoff with jitter on 408/409/429/5xx, connection errors and timeouts, honouring
`Retry-After`, within `RetryPolicy.max_attempts` and `max_total_s`. Other 4xx are not retried.
A commit that failed ambiguously (5xx, dropped connection, timeout: the Hub may have applied it)
is checked before it is sent again: if the repository head already holds exactly the files of
this write, the write counts as done, so a lost response never turns into a duplicate commit or
a spurious RevisionConflict. Reads are plain GETs of the `resolve` URL pinned to a commit sha
(capped by `max_bytes` while streaming); `read_header` fetches only the 8-byte length and the
JSON header with two HTTP Range requests. The Hub limits commits (about 128 per hour per
repository): `commits_last_hour()` counts this process's commits, a warning is logged near the
limit and on every 429, and `check_commit_budget` estimates a run's commit rate up front.
The token is handed to `HfApi` and never logged, put in exception text or in a repr.
Limits of the client (huggingface_hub 2.4): its shared HTTP client has no timeout and
`create_commit`/`list_repo_tree` take none, so only our own GETs and `repo_info` are bounded by
`timeout_s`; the client itself retries `preupload` and tree pages (up to 5 times, 1-8 s) inside
one of our attempts. Large binary files go through LFS/Xet on the real Hub (hf_xet is installed);
the loopback test server answers "regular" for every file, so that path is not tested offline.

Directory transport: on-disk scheme
-----------------------------------
Writers on several hosts share one directory; nothing is ever modified in place::

    <root>/.dumb_diloco/FORMAT                     marker of this scheme
    <root>/.dumb_diloco/HEAD                       hint: latest revision number (may lag)
    <root>/.dumb_diloco/log/<rev>.json             commit record of revision <rev>
    <root>/.dumb_diloco/files/<dir>/<name>@<rev>-<unit>       contents of <dir>/<name> at <rev>
    <root>/.dumb_diloco/files/<dir>/<name>@<rev>-<unit>.del   tombstone: deleted at <rev>
    <root>/<dir>/<name> -> .dumb_diloco/files/<dir>/<name>@<rev>-<unit>   (relative symlink)

A write stages every file (temp name in the same directory, fsync), renames them to their
versioned names for revision head+1 and then commits by creating `log/<head+1>.json` with
`os.link`, which fails if the name exists: an atomic compare-and-swap that also works on NFS.
Losing the race renames the staged files to the next number and tries again (or raises
RevisionConflict when `parent_revision` was given). A version entry counts only if the log record
of its revision names its unit, so files of a crashed or losing writer are never visible, and
a reader pinned to revision R (`revision()` then reads) sees exactly the units committed up to
R: never half of one. `revision()` reads HEAD and probes for newer log records (two small
syscalls). The plain paths of the layout (`global/latest.safetensors`, ...) are symlinks updated
with `os.replace` right after each commit, so `cat` works; they are a convenience view and may
lag a concurrent commit by milliseconds, the transport itself always reads through the log.
Superseded versions and tombstones are deleted `keep_old_versions_s` after the commit that
superseded them (garbage collection runs in the writer, on the directories it touched), so a
reader pinned to an older revision keeps working for that grace period.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import random
import re
import struct
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable
from urllib.parse import unquote, urlparse

from diloco.schema import RetryConfig

from .tensor_format import DEFAULT_MAX_HEADER_BYTES, InvalidTensorFile, SafetensorsHeader, parse_header

__all__ = [
    "DirectoryTransport",
    "FileTooLarge",
    "HubTransport",
    "RemoteFile",
    "RemoteNotFound",
    "RetryPolicy",
    "RevisionConflict",
    "TransientError",
    "Transport",
    "TransportError",
    "check_commit_budget",
    "open_transport",
    "validate_repo_path",
]

logger = logging.getLogger("diloco.dumb_diloco.transport")

HUB_COMMITS_PER_HOUR = 128
T = TypeVar("T")


# --------------------------------------------------------------------------- errors and types


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


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    # identifies this version of the file's contents (Hub: git blob id; directory: its revision);
    # "" if unknown. Lets a reader cache what it learnt from a file's header (part 2).
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
        """The validated safetensors header, without reading the payload."""
        ...

    def write(
        self,
        files: dict[str, bytes],
        delete: Sequence[str] = (),
        message: str = "",
        parent_revision: str | None = None,
    ) -> str:
        """Write `files` and delete `delete` as one atomic unit; returns the new revision.
        RevisionConflict if `parent_revision` is given and is no longer the newest."""
        ...

    def delete(self, paths: Sequence[str]) -> str:
        """Delete `paths` as one unit (RemoteNotFound if one is absent); returns the new revision."""
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
    if parts[0] in (_CTRL, ".git"):
        raise ValueError(f"repository path {path!r} is inside the reserved {parts[0]!r} directory")
    return path


def _validate_prefix(prefix: str) -> str:
    prefix = prefix.strip("/") if prefix else ""
    return validate_repo_path(prefix) if prefix else ""


def check_commit_budget(num_nodes: int, seconds_per_boundary: float, limit_per_hour: int = 128) -> str | None:
    """A warning line when `num_nodes` committing once per `seconds_per_boundary` exceeds the
    Hub's commit limit (about 128 commits per hour per repository), else None."""
    if num_nodes <= 0 or seconds_per_boundary <= 0:
        raise ValueError("num_nodes and seconds_per_boundary must be positive")
    per_hour = num_nodes * 3600.0 / seconds_per_boundary
    if per_hour <= limit_per_hour:
        return None
    return (
        f"{num_nodes} node(s) uploading a delta every {seconds_per_boundary:g}s make ~{per_hour:.0f} commits/hour, "
        f"over the Hub's limit of {limit_per_hour}/hour per repository (plus the master's global commits): "
        f"raise inner_steps so a boundary takes >= {num_nodes * 3600.0 / limit_per_hour:.0f}s, or use a shared directory"
    )


# --------------------------------------------------------------------------- retries


@dataclass
class RetryPolicy(RetryConfig):
    """Exponential backoff with jitter (settings: diloco.schema.RetryConfig). Delay n (1-based) is drawn
    from [d/2, d] with d = min(max_delay_s, base_delay_s * 2**(n-1)), and is at least Retry-After."""

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        d = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        d = d / 2 + rng.uniform(0, d / 2)
        return max(d, retry_after) if retry_after is not None else d


def _parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError):
        return None


# --------------------------------------------------------------------------- Hub transport


_TOKEN_RE = re.compile(r"(hf_|api_org_)[A-Za-z0-9]{6,}")


class _Truncated(Exception):
    """A response ended before its Content-Length: retried like a dropped connection."""


class HubTransport:
    """Transport over a Hugging Face model repository through `huggingface_hub.HfApi`."""

    def __init__(
        self,
        repo_id: str,
        *,
        token: str | None = None,
        endpoint: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        create: bool = True,
        retry: RetryPolicy | None = None,
        timeout_s: float = 60.0,
        commit_limit_per_hour: int = HUB_COMMITS_PER_HOUR,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        from huggingface_hub import HfApi

        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo_id):
            raise ValueError(f"not a Hub repository id (namespace/name): {repo_id!r}")
        self.repo_id = repo_id
        # HF_ENDPOINT is read by huggingface_hub at import; reading it again here lets a caller (or
        # a test) point an already-imported client elsewhere. None keeps the client's default.
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None
        self._token = token  # None: the client's own lookup (HF_TOKEN, token file)
        self._api = HfApi(endpoint=self.endpoint, token=token, library_name="diloco-dumb")
        self.endpoint = self._api.endpoint
        self.cache_dir = str(cache_dir) if cache_dir is not None else None  # reads stream to memory
        self.retry = retry or RetryPolicy()
        self.timeout_s = timeout_s
        self.commit_limit_per_hour = commit_limit_per_hour
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._lock = threading.Lock()
        self._commit_times: collections.deque[float] = collections.deque()
        self._last_rate_warning = float("-inf")
        if create:
            self._call(
                "create repository",
                lambda: self._api.create_repo(repo_id, exist_ok=True, private=True, repo_type="model"),
            )

    def __repr__(self) -> str:
        return f"HubTransport(repo_id={self.repo_id!r}, endpoint={self.endpoint!r})"

    # ---- error handling

    def _scrub(self, text: str) -> str:
        if self._token:
            text = text.replace(self._token, "***")
        return _TOKEN_RE.sub(r"\1***", text)

    def _describe(self, err: BaseException, status: int | None = None) -> str:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        http = f"HTTP {status} " if status is not None else ""
        return self._scrub(f"{http}{type(err).__name__}: {first}")[:400]

    def _classify(self, err: BaseException) -> tuple[str, float | None, int | None]:
        """(kind, retry_after, status) with kind in transient/conflict/not_found/fatal/raise."""
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

        if isinstance(err, TransportError):
            return "raise", None, None
        if isinstance(err, HfHubHTTPError) and getattr(err, "response", None) is not None:
            status = err.response.status_code
            retry_after = _parse_retry_after(err.response.headers.get("Retry-After"))
            if status == 412:
                return "conflict", None, status
            if status == 404:
                return "not_found", None, status
            if status in (408, 409, 429) or status >= 500:
                return "transient", retry_after, status
            return "fatal", None, status
        if isinstance(err, OfflineModeIsEnabled):
            return "fatal", None, None
        if isinstance(err, httpx2.TransportError | ConnectionError | TimeoutError | _Truncated):
            return "transient", None, None
        return "raise", None, None

    def _call(
        self, what: str, fn: Callable[[], T], *, on_transient: Callable[[], T | None] | None = None
    ) -> T:
        """Run `fn` with retries. `on_transient`, if given, runs after an ambiguous failure and
        before the next attempt; a non-None result ends the call with that result."""
        start = time.monotonic()
        attempt = 0
        ambiguous = False
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as err:
                kind, retry_after, status = self._classify(err)
                if kind == "raise":
                    raise
                if on_transient is not None and (ambiguous or (kind == "transient" and status != 429)):
                    # The last attempt may have been applied although its answer was lost.
                    ambiguous = True
                    with contextlib.suppress(Exception):
                        done = on_transient()
                        if done is not None:
                            logger.info(
                                "%s: the previous attempt had been applied; not sending it again", what
                            )
                            return done
                desc = self._describe(err, status)
                if kind == "conflict":
                    raise RevisionConflict(f"{what}: the repository moved on ({desc})") from None
                if kind == "not_found":
                    raise RemoteNotFound(f"{what}: not found ({desc})") from None
                if kind == "fatal":
                    raise TransportError(f"{what} failed: {desc}") from None
                if status == 429:
                    logger.warning(
                        "Hub rate limit (HTTP 429) during %s; this process made %d commit(s) in the last hour "
                        "(Hub limit about %d/hour per repository)",
                        what,
                        self.commits_last_hour(),
                        self.commit_limit_per_hour,
                    )
                elapsed = time.monotonic() - start
                delay = self.retry.delay(attempt, retry_after, self._rng)
                if attempt >= self.retry.max_attempts or elapsed + delay > self.retry.max_total_s:
                    raise TransientError(
                        f"{what} gave up after {attempt} attempt(s) in {elapsed:.1f}s; last error: {desc}"
                    ) from None
                logger.warning(
                    "%s failed (attempt %d/%d): %s; retrying in %.1fs",
                    what,
                    attempt,
                    self.retry.max_attempts,
                    desc,
                    delay,
                )
                self._sleep(delay)

    # ---- commit accounting

    def commits_last_hour(self) -> int:
        with self._lock:
            cutoff = time.time() - 3600.0
            while self._commit_times and self._commit_times[0] < cutoff:
                self._commit_times.popleft()
            return len(self._commit_times)

    def _record_commit(self) -> None:
        with self._lock:
            self._commit_times.append(time.time())
        n = self.commits_last_hour()
        if n >= 0.8 * self.commit_limit_per_hour and time.monotonic() - self._last_rate_warning > 300:
            self._last_rate_warning = time.monotonic()
            logger.warning(
                "this process made %d commits to %s in the last hour; the Hub allows about %d/hour per repository",
                n,
                self.repo_id,
                self.commit_limit_per_hour,
            )

    # ---- Transport API

    def revision(self) -> str:
        info = self._call(
            "read repository revision",
            lambda: self._api.repo_info(self.repo_id, repo_type="model", timeout=self.timeout_s),
        )
        if not info.sha:
            raise TransportError(f"the Hub returned no commit sha for {self.repo_id}")
        return info.sha

    def list(self, prefix: str, revision: str | None = None) -> list[RemoteFile]:
        from huggingface_hub.errors import EntryNotFoundError
        from huggingface_hub.hf_api import RepoFile

        prefix = _validate_prefix(prefix)

        def _list() -> list[RemoteFile]:
            try:
                entries = list(
                    self._api.list_repo_tree(
                        self.repo_id, path_in_repo=prefix or None, recursive=True, revision=revision
                    )
                )
            except EntryNotFoundError:
                return []  # no such folder (yet)
            return [RemoteFile(e.path, int(e.size), getattr(e, "blob_id", "") or "") for e in entries
                    if isinstance(e, RepoFile)]  # fmt: skip

        return sorted(self._call(f"list {prefix or '/'!r}", _list), key=lambda f: f.path)

    def _url(self, path: str, revision: str | None) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, path, revision=revision, endpoint=self.endpoint)

    def _headers(self) -> dict[str, str]:
        from huggingface_hub.utils import build_hf_headers

        headers = build_hf_headers(token=self._token, library_name="diloco-dumb")
        headers["Accept-Encoding"] = "identity"
        return headers

    def _get(self, path: str, revision: str | None, start: int, length: int | None, max_bytes: int | None):
        """GET `length` bytes from `start` (Range request), or the whole file when length is None.
        Reads at most what it needs even if the server ignores the Range header.
        Returns (bytes, total file size or None)."""
        from huggingface_hub.utils import get_session, hf_raise_for_status

        headers = self._headers()
        if length is not None:
            headers["Range"] = f"bytes={start}-{start + length - 1}"
        url = self._url(path, revision)
        with get_session().stream(
            "GET", url, headers=headers, timeout=self.timeout_s, follow_redirects=True
        ) as resp:
            if resp.status_code == 416:  # range past the end: the file is shorter than asked
                m = re.match(r"bytes \*/(\d+)", resp.headers.get("Content-Range", ""))
                return b"", int(m.group(1)) if m else None
            if resp.status_code >= 400:
                resp.read()
                hf_raise_for_status(resp)
            total: int | None = None
            content_length = resp.headers.get("Content-Length")
            if resp.status_code == 206:
                m = re.match(r"bytes \d+-\d+/(\d+)", resp.headers.get("Content-Range", ""))
                total = int(m.group(1)) if m else None
                skip = 0
            else:
                total = int(content_length) if content_length else None
                skip = start  # the server sent the whole file
            if length is None and max_bytes is not None and total is not None and total > max_bytes:
                raise FileTooLarge(f"{path} is {total} bytes, over the cap of {max_bytes}")
            want = length if length is not None else None
            buf = bytearray()
            for chunk in resp.iter_bytes():
                buf += chunk
                if want is not None and len(buf) >= skip + want:
                    break
                if max_bytes is not None and len(buf) > max_bytes:
                    raise FileTooLarge(f"{path} is over the cap of {max_bytes} bytes")
            data = bytes(buf[skip : skip + want]) if want is not None else bytes(buf)
            if want is not None and len(data) < want and (total is None or start + want <= total):
                raise _Truncated(f"short read of {path}")
            if want is None and content_length is not None and len(buf) != int(content_length):
                raise _Truncated(f"{path}: got {len(buf)} of {content_length} bytes")
            return data, total

    def read(self, path: str, revision: str | None = None, max_bytes: int | None = None) -> bytes:
        validate_repo_path(path)
        data, _ = self._call(f"read {path!r}", lambda: self._get(path, revision, 0, None, max_bytes))
        return data

    def read_header(
        self, path: str, revision: str | None = None, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    ) -> SafetensorsHeader:
        validate_repo_path(path)
        prefix, total = self._call(f"read header of {path!r}", lambda: self._get(path, revision, 0, 8, None))
        if len(prefix) < 8:
            raise InvalidTensorFile(f"{path}: file too short for a safetensors header")
        (n,) = struct.unpack("<Q", prefix)
        if n > max_header_bytes or (total is not None and 8 + n > total) or n < 2:
            return parse_header(prefix, file_size=total, max_header_bytes=max_header_bytes)  # raises
        header, _ = self._call(f"read header of {path!r}", lambda: self._get(path, revision, 8, n, None))
        return parse_header(prefix + header, file_size=total, max_header_bytes=max_header_bytes)

    def _landed(self, files: dict[str, bytes], delete: Sequence[str]) -> str | None:
        """Head sha if the head already holds exactly `files` and none of `delete`, else None."""
        from huggingface_hub.hf_api import RepoFile

        head = self._api.repo_info(self.repo_id, repo_type="model", timeout=self.timeout_s).sha
        infos = self._api.get_paths_info(self.repo_id, [*files, *delete], revision=head)
        by_path = {i.path: i for i in infos if isinstance(i, RepoFile)}
        for path, data in files.items():
            info = by_path.get(path)
            if info is None:
                return None
            if info.lfs is not None:
                if info.lfs.sha256 != hashlib.sha256(data).hexdigest():
                    return None
            elif info.blob_id != _git_blob_sha1(data):
                return None
        if any(p in by_path for p in delete):
            return None
        return head

    def write(
        self,
        files: dict[str, bytes],
        delete: Sequence[str] = (),
        message: str = "",
        parent_revision: str | None = None,
    ) -> str:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        files, delete = _check_write_args(files, delete)
        if not files and not delete:
            return self.revision()
        message = message or f"dumb_diloco: write {len(files)} file(s), delete {len(delete)}"

        def _commit() -> str:
            ops: list[Any] = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=d) for p, d in files.items()]
            ops += [CommitOperationDelete(path_in_repo=p) for p in delete]
            info = self._api.create_commit(
                self.repo_id,
                operations=ops,
                commit_message=message,
                repo_type="model",
                parent_commit=parent_revision,
            )
            return info.oid

        sha = self._call(
            f"commit of {len(files)} file(s) and {len(delete)} deletion(s)",
            _commit,
            on_transient=lambda: self._landed(files, delete),
        )
        self._record_commit()
        return sha

    def delete(self, paths: Sequence[str]) -> str:
        return self.write({}, delete=paths, message=f"dumb_diloco: delete {len(paths)} file(s)")


def _git_blob_sha1(data: bytes) -> str:
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def _check_write_args(files: dict[str, bytes], delete: Sequence[str]) -> tuple[dict[str, bytes], list[str]]:
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
    return {p: bytes(d) for p, d in files.items()}, delete


# --------------------------------------------------------------------------- directory transport

_CTRL = ".dumb_diloco"
_VERSION_RE = re.compile(r"^(.+)@(\d{12})-([0-9a-f]{16})(\.del)?$")
_FORMAT_LINE = "dumb-diloco directory repository, format 1\n"


@dataclass(frozen=True)
class _Version:
    name: str
    rev: int
    unit: str
    deleted: bool
    entry: str  # file name inside the index directory


@dataclass
class _LogRecord:
    rev: int
    unit: str
    time: float
    files: dict[str, int] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class DirectoryTransport:
    """Transport over a shared directory; see the module docstring for the on-disk scheme."""

    def __init__(
        self, root: str | os.PathLike[str], *, create: bool = True, keep_old_versions_s: float = 900.0
    ):
        self.root = Path(root).expanduser().absolute()
        self.keep_old_versions_s = keep_old_versions_s
        self._ctrl = self.root / _CTRL
        self._files = self._ctrl / "files"
        self._log_dir = self._ctrl / "log"
        self._tmp = self._ctrl / "tmp"
        self._log_cache: dict[int, _LogRecord] = {}
        self._cache_lock = threading.Lock()
        marker = self._ctrl / "FORMAT"
        if not marker.exists():
            if not create:
                raise RemoteNotFound(f"{self.root} is not a DumbDiLoCo directory repository")
            for d in (self._files, self._log_dir, self._tmp):
                d.mkdir(parents=True, exist_ok=True)
            genesis = self._tmp / f"genesis.{uuid.uuid4().hex}"
            _write_durable(genesis, json.dumps({"rev": 0, "unit": "0" * 16, "time": time.time()}).encode())
            with contextlib.suppress(FileExistsError):
                os.link(genesis, self._log_path(0))
            genesis.unlink()
            tmp_marker = self._tmp / f"FORMAT.{uuid.uuid4().hex}"
            _write_durable(tmp_marker, _FORMAT_LINE.encode())
            os.replace(tmp_marker, marker)
        elif marker.read_text() != _FORMAT_LINE:
            raise TransportError(f"{self.root}: unknown repository format")

    def __repr__(self) -> str:
        return f"DirectoryTransport(root={str(self.root)!r})"

    # ---- log

    def _log_path(self, rev: int) -> Path:
        return self._log_dir / f"{rev:012d}.json"

    def _log(self, rev: int) -> _LogRecord | None:
        rec = self._log_cache.get(rev)
        if rec is not None:
            return rec
        try:
            raw = json.loads(self._log_path(rev).read_bytes())
        except FileNotFoundError:
            return None
        rec = _LogRecord(
            rev=raw["rev"],
            unit=raw["unit"],
            time=raw["time"],
            files=raw.get("files", {}),
            deleted=raw.get("deleted", []),
        )
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

    def _set_head_hint(self, rev: int) -> None:
        tmp = self._tmp / f"HEAD.{uuid.uuid4().hex}"
        tmp.write_text(str(rev))
        os.replace(tmp, self._ctrl / "HEAD")

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

    def _committed(self, v: _Version) -> _LogRecord | None:
        rec = self._log(v.rev)
        return rec if rec is not None and rec.unit == v.unit else None

    def _visible(self, versions: list[_Version], rev: int) -> _Version | None:
        """The version a reader at `rev` sees (None: absent or deleted)."""
        for v in versions:
            if v.rev <= rev and self._committed(v) is not None:
                return None if v.deleted else v
        return None

    def _lookup(self, path: str, rev: int) -> tuple[Path, int]:
        validate_repo_path(path)
        parent, _, name = path.rpartition("/")
        index_dir = self._files / parent if parent else self._files
        v = self._visible(self._versions(index_dir).get(name, []), rev)
        if v is None:
            raise RemoteNotFound(f"{path} does not exist at revision {rev:012d}")
        rec = self._log(v.rev)
        assert rec is not None
        return index_dir / v.entry, int(rec.files.get(path, -1))

    # ---- Transport API

    def revision(self) -> str:
        return f"{self._head():012d}"

    def list(self, prefix: str, revision: str | None = None) -> list[RemoteFile]:
        prefix = _validate_prefix(prefix)
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
                    out.append(RemoteFile(path, int(rec.files[path]), f"{v.rev}:{v.entry}"))
        return sorted(out, key=lambda f: f.path)

    def read(self, path: str, revision: str | None = None, max_bytes: int | None = None) -> bytes:
        file, size = self._lookup(path, self._resolve(revision))
        if max_bytes is not None and size > max_bytes:
            raise FileTooLarge(f"{path} is {size} bytes, over the cap of {max_bytes}")
        try:
            return file.read_bytes()
        except FileNotFoundError:
            raise RemoteNotFound(f"{path}: this version was garbage-collected (revision too old)") from None

    def read_header(
        self, path: str, revision: str | None = None, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    ) -> SafetensorsHeader:
        file, _ = self._lookup(path, self._resolve(revision))
        try:
            with open(file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise InvalidTensorFile(f"{path}: file too short for a safetensors header")
                (n,) = struct.unpack("<Q", prefix)
                if n > max_header_bytes or 8 + n > size:
                    return parse_header(prefix, file_size=size, max_header_bytes=max_header_bytes)  # raises
                return parse_header(prefix + f.read(n), file_size=size, max_header_bytes=max_header_bytes)
        except FileNotFoundError:
            raise RemoteNotFound(f"{path}: this version was garbage-collected (revision too old)") from None

    def write(
        self,
        files: dict[str, bytes],
        delete: Sequence[str] = (),
        message: str = "",
        parent_revision: str | None = None,
    ) -> str:
        files, delete = _check_write_args(files, delete)
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
                _write_durable(tmp, data)
                staged.append((path, index_dir, tmp, path in delete))
            for index_dir in {s[1] for s in staged}:
                _fsync_dir(index_dir)
            rev = self._commit(files, delete, staged, unit, message, parent)
        except BaseException:
            for _, _, tmp, _ in staged:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            raise
        self._set_head_hint(rev)
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
                    self._lookup(path, head)
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
            record = {
                "rev": rev,
                "unit": unit,
                "parent": head,
                "time": time.time(),
                "message": message,
                "files": {p: len(d) for p, d in files.items()},
                "deleted": list(delete),
            }
            tmp = self._tmp / f"log.{unit}.{rev}"
            _write_durable(tmp, json.dumps(record).encode())
            try:
                os.link(tmp, self._log_path(rev))  # the commit point: fails if another writer got here first
            except FileExistsError:
                continue
            finally:
                tmp.unlink()
            _fsync_dir(self._log_dir)
            return rev

    def _check_no_type_clash(self, path: str, head: int) -> None:
        parts = path.split("/")
        for i in range(1, len(parts)):
            with contextlib.suppress(RemoteNotFound):
                self._lookup("/".join(parts[:i]), head)
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
        target = f"{up}{_CTRL}/files/{parent + '/' if parent else ''}{v.entry}"
        link_tmp = view.parent / f".{name}.{uuid.uuid4().hex[:16]}.lnk"
        os.symlink(target, link_tmp)
        os.replace(link_tmp, view)

    def _gc(self, index_dirs: set[Path]) -> None:
        now = time.time()
        grace = self.keep_old_versions_s
        for index_dir in index_dirs:
            for versions in self._versions(index_dir).values():
                newer: _LogRecord | None = None  # commit of the next newer committed version
                for v in versions:  # newest first
                    rec = self._committed(v)
                    if rec is None:
                        # Not committed: a writer still at work, or the leftover of a crashed one.
                        if now - os.stat(index_dir / v.entry).st_mtime > grace:
                            (index_dir / v.entry).unlink()
                        continue
                    superseded = newer is not None and now - newer.time > grace
                    lone_tombstone = newer is None and v.deleted and now - rec.time > grace
                    if superseded or lone_tombstone:
                        (index_dir / v.entry).unlink()
                    newer = rec
            for e in os.scandir(index_dir):
                if e.name.endswith(".tmp") and now - e.stat().st_mtime > max(grace, 3600):
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)


# --------------------------------------------------------------------------- factory


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
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", repo_id):
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

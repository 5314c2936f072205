"""The Hugging Face Hub store: a model repository through `huggingface_hub.HfApi`.

Invariants: one `write` is one commit (`parent_commit` for optimistic concurrency; HTTP 412 is a
RevisionConflict); a commit whose answer was lost is checked before it is sent again, so it never
lands twice; reads are pinned to a commit sha and capped while streaming; retries never sleep past the
caller's `deadline`; the token never appears in a log line, an exception or a repr. Retries, limits
and the client's own: docs/dumb_diloco.md#stores.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import hashlib
import logging
import os
import random
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

from diloco.schema import RetryConfig

from ..wire.tensor_format import DEFAULT_MAX_HEADER_BYTES, SafetensorsHeader, read_header_ranges
from .base import (
    FileTooLarge,
    PermanentError,
    RemoteFile,
    RemoteNotFound,
    RevisionConflict,
    TransientError,
    TransportError,
    check_write_args,
    validate_prefix,
    validate_repo_path,
)
from .budget import HUB_COMMITS_PER_HOUR, HUB_REPO_ID_RE

logger = logging.getLogger("diloco.dumb_diloco.transport")

_TOKEN_RE = re.compile(r"(hf_|api_org_)[A-Za-z0-9]{6,}")
T = TypeVar("T")
# (absolute time on the transport's clock, what it bounds); per thread: a new thread starts without one
_DEADLINE: contextvars.ContextVar[tuple[float, str] | None] = contextvars.ContextVar("deadline", default=None)


@contextlib.contextmanager
def deadline(at: float, what: str = "caller's") -> Iterator[None]:
    """Within this block (this thread), a HubTransport call stops retrying rather than sleep past `at`
    (time.monotonic(), or the transport's `clock`) and clips its HTTP timeouts to the time left. A
    deadline inside another keeps the earlier of the two."""
    outer = _DEADLINE.get()
    token = _DEADLINE.set(outer if outer is not None and outer[0] <= at else (at, what))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def time_left(clock: Callable[[], float] = time.monotonic) -> float | None:
    """Seconds until the current deadline (negative once passed), None without one."""
    current = _DEADLINE.get()
    return None if current is None else current[0] - clock()


@dataclass
class RetryPolicy(RetryConfig):
    """Exponential backoff with jitter (settings: diloco.schema.RetryConfig). Delay n (1-based) is drawn
    from [d/2, d] with d = min(max_delay_s, base_delay_s * 2**(n-1)), and is at least Retry-After."""

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        d = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        d = d / 2 + rng.uniform(0, d / 2)
        return max(d, retry_after) if retry_after is not None else d


def _parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header: delay-seconds or an HTTP date (huggingface_hub's own parser
    reads only the former)."""
    value = (value or "").strip()
    with contextlib.suppress(ValueError):
        return max(0.0, float(value)) if value else None
    with contextlib.suppress(TypeError, ValueError, IndexError):
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    return None


class _Truncated(Exception):
    """A response ended before its Content-Length: retried like a dropped connection."""


def _spooled(stack: contextlib.ExitStack, data: memoryview) -> str:
    """`data` written to a temporary file that `stack` deletes; its path."""
    f = stack.enter_context(tempfile.NamedTemporaryFile(prefix="dumb_diloco_", suffix=".upload"))
    f.write(data)
    f.flush()
    return f.name


def _git_blob_sha1(data: bytes) -> str:
    h = hashlib.sha1(b"blob %d\0" % len(data), usedforsecurity=False)
    h.update(data)
    return h.hexdigest()


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from huggingface_hub import HfApi

        if not HUB_REPO_ID_RE.fullmatch(repo_id):
            raise ValueError(f"not a Hub repository id (namespace/name): {repo_id!r}")
        self.repo_id = repo_id
        # HF_ENDPOINT is read by huggingface_hub at import; reading it again here lets a caller (or
        # a test) point an already-imported client elsewhere. None keeps the client's default.
        endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None
        self._token = token  # None: the client's own lookup (HF_TOKEN, token file)
        self.api = HfApi(endpoint=endpoint, token=token, library_name="diloco-dumb")
        self.endpoint = self.api.endpoint
        self.cache_dir = str(cache_dir) if cache_dir is not None else None  # reads stream to memory
        self.retry = retry or RetryPolicy()
        self.timeout_s = timeout_s
        self.commit_limit_per_hour = commit_limit_per_hour
        self._rng = rng or random.Random()
        self._sleep, self._clock = sleep, clock
        self._lock = threading.Lock()
        self._commit_times: collections.deque[float] = collections.deque()
        self._last_rate_warning = float("-inf")
        if create:  # create_repo takes no timeout (see _call)
            self._call(
                "create repository",
                lambda: self.api.create_repo(repo_id, exist_ok=True, private=True, repo_type="model"),
            )

    def __repr__(self) -> str:
        return f"HubTransport(repo_id={self.repo_id!r}, endpoint={self.endpoint!r})"

    # ---- retries (not http_backoff: it retries one raw request, no jitter/deadline; a commit is several)

    def _describe(self, err: BaseException, status: int | None = None) -> str:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        text = f"{f'HTTP {status} ' if status is not None else ''}{type(err).__name__}: {first}"
        if self._token:
            text = text.replace(self._token, "***")
        return _TOKEN_RE.sub(r"\1***", text)[:400]

    def _classify(self, err: Exception) -> tuple[str | None, float | None, int | None]:
        """(why it is final, None if retryable; Retry-After; HTTP status); re-raises what is not the Hub's."""
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

        if isinstance(err, HfHubHTTPError) and getattr(err, "response", None) is not None:
            status = err.response.status_code
            if status in (408, 409, 429) or status >= 500:
                return None, _parse_retry_after(err.response.headers.get("Retry-After")), status
            return {412: "conflict", 404: "not_found"}.get(status, "fatal"), None, status
        if isinstance(err, OfflineModeIsEnabled):
            return "fatal", None, None
        if isinstance(err, TransportError) or not isinstance(
            err, httpx2.TransportError | ConnectionError | TimeoutError | _Truncated
        ):
            raise err
        return None, None, None

    def _timeout(self) -> float:
        """request_timeout, clipped to the time left before the current `deadline`."""
        left = time_left(self._clock)
        return self.timeout_s if left is None else max(0.01, min(self.timeout_s, left))

    def _call(
        self, what: str, fn: Callable[[], T], *, on_transient: Callable[[], T | None] | None = None
    ) -> T:
        """Run `fn` with retries, until retry.max_attempts or retry.max_total_s, and never past the
        current `deadline`: no attempt starts after it, no backoff ends after it (TransientError). Its
        requests take `_timeout()` where the client accepts a timeout (repo_info, the GETs of `_get`);
        create_repo, create_commit, list_repo_tree and get_paths_info accept none and the client's shared
        HTTP client has none, so one of those that hangs can outlast the deadline. `on_transient`, if
        given, runs after an ambiguous failure and before the next attempt; a non-None result ends the
        call with that result."""
        start, attempt, ambiguous = self._clock(), 0, False
        bound = _DEADLINE.get()
        if bound is not None and bound[0] <= start:
            raise TransientError(f"{what}: not tried, the {bound[1]} deadline has passed")
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as err:
                final, retry_after, status = self._classify(err)
                if on_transient is not None and (ambiguous or (final is None and status != 429)):
                    ambiguous = True  # the last attempt may have been applied although its answer was lost
                    with contextlib.suppress(Exception):
                        if (done := on_transient()) is not None:
                            logger.info(
                                "%s: the previous attempt had been applied; not sending it again", what
                            )
                            return done
                desc = self._describe(err, status)
                if final == "conflict":
                    raise RevisionConflict(f"{what}: the repository moved on ({desc})") from None
                if final == "not_found":
                    raise RemoteNotFound(f"{what}: not found ({desc})") from None
                if final == "fatal" and status in (401, 403):
                    raise PermanentError(f"{what} refused: {desc} (check the token and its access)") from None
                if final == "fatal":
                    raise TransportError(f"{what} failed: {desc}") from None
                if status == 429:
                    logger.warning(
                        "Hub rate limit (HTTP 429) during %s; this process made %d commit(s) in the last "
                        "hour (Hub limit about %d/hour per repository)",
                        *(what, self.commits_last_hour(), self.commit_limit_per_hour),
                    )
                elapsed = self._clock() - start
                delay = self.retry.delay(attempt, retry_after, self._rng)
                if attempt >= self.retry.max_attempts or elapsed + delay > self.retry.max_total_s:
                    raise TransientError(
                        f"{what} gave up after {attempt} attempt(s) in {elapsed:.1f}s; last error: {desc}"
                    ) from None
                if bound is not None and self._clock() + delay > bound[0]:
                    raise TransientError(
                        f"{what} gave up after {attempt} attempt(s) in {elapsed:.1f}s (a retry in "
                        f"{delay:.1f}s would pass the {bound[1]} deadline); last error: {desc}"
                    ) from None
                logger.warning(
                    "%s failed (attempt %d/%d): %s; retrying in %.1fs",
                    *(what, attempt, self.retry.max_attempts, desc, delay),
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
                "this process made %d commits to %s in the last hour; the Hub allows about %d/hour per "
                "repository",
                *(n, self.repo_id, self.commit_limit_per_hour),
            )

    # ---- Transport API

    def revision(self) -> str:
        info = self._call(
            "read repository revision",
            lambda: self.api.repo_info(self.repo_id, repo_type="model", timeout=self._timeout()),
        )
        if not info.sha:
            raise TransportError(f"the Hub returned no commit sha for {self.repo_id}")
        return info.sha

    def list(self, prefix: str, revision: str | None = None) -> list[RemoteFile]:
        from huggingface_hub.errors import EntryNotFoundError
        from huggingface_hub.hf_api import RepoFile

        prefix = validate_prefix(prefix)

        def _list() -> list[RemoteFile]:
            try:
                tree = self.api.list_repo_tree(
                    self.repo_id, path_in_repo=prefix or None, recursive=True, revision=revision
                )
                entries = [e for e in tree if isinstance(e, RepoFile)]
            except EntryNotFoundError:
                return []  # no such folder (yet)
            return [RemoteFile(e.path, int(e.size), getattr(e, "blob_id", "") or "") for e in entries]

        return sorted(self._call(f"list {prefix or '/'!r}", _list), key=lambda f: f.path)

    def _get(self, path: str, revision: str | None, start: int, length: int | None, max_bytes: int | None):
        """GET `length` bytes from `start` (Range request), or the whole file when length is None.
        Reads at most what it needs even if the server ignores the Range header.
        Returns (bytes, total file size or None)."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        headers = build_hf_headers(token=self._token, library_name="diloco-dumb")
        headers["Accept-Encoding"] = "identity"
        if length is not None:
            headers["Range"] = f"bytes={start}-{start + length - 1}"
        url = hf_hub_url(self.repo_id, path, revision=revision, endpoint=self.endpoint)
        with get_session().stream(
            "GET", url, headers=headers, timeout=self._timeout(), follow_redirects=True
        ) as resp:
            if resp.status_code == 416:  # range past the end: the file is shorter than asked
                m = re.match(r"bytes \*/(\d+)", resp.headers.get("Content-Range", ""))
                return b"", int(m.group(1)) if m else None
            if resp.status_code >= 400:
                resp.read()
                hf_raise_for_status(resp)
            content_length = resp.headers.get("Content-Length")
            if resp.status_code == 206:
                m = re.match(r"bytes \d+-\d+/(\d+)", resp.headers.get("Content-Range", ""))
                total, skip = (int(m.group(1)) if m else None), 0
            else:
                total, skip = (int(content_length) if content_length else None), start  # the whole file
            if length is None and max_bytes is not None and total is not None and total > max_bytes:
                raise FileTooLarge(f"{path} is {total} bytes, over the cap of {max_bytes}")
            buf = bytearray()
            for chunk in resp.iter_bytes():
                buf += chunk
                if length is not None and len(buf) >= skip + length:
                    break
                if max_bytes is not None and len(buf) > max_bytes:
                    raise FileTooLarge(f"{path} is over the cap of {max_bytes} bytes")
            if length is None:
                if content_length is not None and len(buf) != int(content_length):
                    raise _Truncated(f"{path}: got {len(buf)} of {content_length} bytes")
                return bytes(buf), total
            data = bytes(buf[skip : skip + length])
            if len(data) < length and (total is None or start + length <= total):
                raise _Truncated(f"short read of {path}")
            return data, total

    def read(self, path: str, revision: str | None = None, max_bytes: int | None = None) -> bytes:
        validate_repo_path(path)
        return self._call(f"read {path!r}", lambda: self._get(path, revision, 0, None, max_bytes))[0]

    def read_header(
        self, path: str, revision: str | None = None, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    ) -> SafetensorsHeader:
        # 2 exact Range reads, not HfApi.parse_safetensors_file_metadata (100 kB, no retries, no file size)
        validate_repo_path(path)

        def read(start: int, length: int) -> tuple[bytes, int | None]:
            return self._call(
                f"read header of {path!r}", lambda: self._get(path, revision, start, length, None)
            )

        return read_header_ranges(path, read, max_header_bytes)

    def _landed(self, files: dict[str, bytes], delete: Sequence[str]) -> str | None:
        """Head sha if the head already holds exactly `files` and none of `delete`, else None."""
        from huggingface_hub.hf_api import RepoFile

        head = self.api.repo_info(self.repo_id, repo_type="model", timeout=self._timeout()).sha
        infos = self.api.get_paths_info(self.repo_id, [*files, *delete], revision=head)
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
        return None if any(p in by_path for p in delete) else head

    def write(
        self,
        files: dict[str, bytes],
        delete: Sequence[str] = (),
        message: str = "",
        parent_revision: str | None = None,
    ) -> str:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        files, delete = check_write_args(files, delete)
        if not files and not delete:
            return self.revision()
        message = message or f"dumb_diloco: write {len(files)} file(s), delete {len(delete)}"

        with contextlib.ExitStack() as spool:
            # a buffer (not bytes) goes by a temporary file in $TMPDIR: bytes(view) would hold a second copy
            # of a delta in memory, and huggingface_hub uploads bytes and paths (not buffers) through Xet
            sources = {p: d if isinstance(d, bytes) else _spooled(spool, d) for p, d in files.items()}

            def _commit() -> str:
                ops: list[Any] = [
                    CommitOperationAdd(path_in_repo=p, path_or_fileobj=d) for p, d in sources.items()
                ]
                ops += [CommitOperationDelete(path_in_repo=p) for p in delete]
                return self.api.create_commit(
                    self.repo_id,
                    operations=ops,
                    commit_message=message,
                    repo_type="model",
                    parent_commit=parent_revision,
                ).oid

            sha = self._call(
                f"commit of {len(files)} file(s) and {len(delete)} deletion(s)",
                _commit,
                on_transient=lambda: self._landed(files, delete),
            )
        self._record_commit()
        return sha

    def delete(self, paths: Sequence[str]) -> str:
        return self.write({}, delete=paths, message=f"dumb_diloco: delete {len(paths)} file(s)")

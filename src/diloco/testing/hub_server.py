"""A loopback Hugging Face Hub for tests and benchmarks: the real `huggingface_hub` client talks to it over
HTTP (127.0.0.1 only). Nothing in the product imports it.

It implements ONLY the subset of the Hub's HTTP API that `huggingface_hub` 2.4 uses for the calls
`diloco.dumb_diloco.store.transport.HubTransport` makes (and `hf_hub_download`) on model repos, and the
read-only subset `datasets.load_dataset(..., streaming=True)` uses on dataset repos (`create_dataset`):

=========================================================  =======================================
POST /api/repos/create                                     create_repo (409 when it exists)
GET  /api/models/<repo>[/revision/<rev>]                   repo_info / model_info (``sha``)
POST /api/models/<repo>/preupload/<rev>                    answers every file ``"regular"``, so the
                                                           client sends contents inline in the
                                                           commit and never tries LFS or Xet
POST /api/models/<repo>/commit/<rev>                       NDJSON: header (parentCommit -> 412 when
                                                           stale), file (base64), deletedFile,
                                                           deletedFolder; lfsFile is refused (400)
GET  /api/models/<repo>/tree/<rev>[/<path>]                list_repo_tree, recursive or not, paged
                                                           with a Link header (``page_size``)
POST /api/models/<repo>/paths-info/<rev>                   get_paths_info
GET  /api/models/<repo>/commits/<rev>                      list_repo_commits
GET  /api/agent-harnesses                                  an empty registry (huggingface_hub's agent
                                                           detection asks for it once a day)
HEAD|GET /<repo>/resolve/<rev>/<path>                      X-Repo-Commit, ETag, Content-Length,
                                                           single Range requests (206 / 416)
=========================================================  =======================================

Dataset repos (read-only, made by `create_dataset(repo_id, files)`) answer the same reads under
``/api/datasets/<repo>/...`` (``revision``, ``tree``, ``paths-info``, ``commits``) and
``/datasets/<repo>/resolve/<rev>/<path>``; their request kinds carry a ``dataset_`` prefix
(``dataset_info``, ``dataset_tree``, ``dataset_paths_info``, ``dataset_commits``,
``dataset_resolve_head``, ``dataset_resolve_get``) so faults aimed at one repo type never hit the other.
The dataset viewer (``datasets-server.<host>``) is another host and is not served.

Every commit makes a new immutable snapshot, so reads pinned to an older sha keep working.
Anything else is answered 404 and recorded in `HubServer.unknown` so a test can assert that the
client made no call this server does not model (Xet token, LFS batch, telemetry, ...).

Fault injection: `fail_next(n, status=..., kinds=..., retry_after=..., drop=..., after_apply=...)`
fails the next n matching requests with an HTTP status (429 with Retry-After, 500, 503, ...) or
by dropping the connection (before or, for commits, after applying them; ``drop_after=k`` sends the
headers and the first k bytes of the body, then drops: a connection lost mid-file); ``path=`` limits a
fault to requests whose path contains that text (one file of a repo);
`fail_fraction(p, status, seed)` fails a seeded-random fraction. `counts` and `bytes_out` count
requests and body bytes by kind (``repo_create``, ``repo_info``, ``preupload``, ``commit``,
``tree``, ``paths_info``, ``commits``, ``resolve_head``, ``resolve_get``); `requests` lists each
request's method, kind, path, Range header and arrival time (time.monotonic()).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import hashlib
import json
import random
import re
import socket
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def _iso(t: float) -> str:
    """The Hub's timestamp format, which huggingface_hub parses strictly."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class Commit:
    sha: str
    parent: str | None
    title: str
    message: str
    time: float
    files: dict[str, bytes]  # the full snapshot after this commit


@dataclass
class Repo:
    repo_id: str
    repo_type: str = "model"  # or "dataset"
    commits: dict[str, Commit] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # oldest first

    @property
    def head(self) -> Commit:
        return self.commits[self.order[-1]]


@dataclass
class _Fault:
    remaining: int
    status: int | None
    kinds: frozenset[str] | None
    retry_after: str | None
    drop: bool
    after_apply: bool
    fraction: float | None = None
    rng: random.Random | None = None
    drop_after: int | None = None  # bytes of the body sent before the connection is dropped
    path: str | None = None  # only requests whose (unquoted) path contains this
    skip: int = 0  # matching requests let through before the first failure


class _Server(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5: with several processes' uploads, polls and outer rounds
    # connecting at once while this process waits for a core on a loaded machine, the connections past
    # the backlog would wait for a SYN retransmission (1 s, then 3 s, ...)
    request_queue_size = 128


class HubServer:
    """Start with `start()` (or use as a context manager); `url` is the endpoint."""

    def __init__(self, *, token: str | Collection[str] | None = None, page_size: int = 1000):
        # if set, every request must carry "Authorization: Bearer <token>" (with one of them, if several)
        self.token = token
        self.page_size = page_size
        self.repos: dict[str, Repo] = {}
        self.datasets: dict[str, Repo] = {}  # dataset repos, by id (read-only: see create_dataset)
        self.counts: collections.Counter[str] = collections.Counter()
        self.bytes_out: collections.Counter[str] = collections.Counter()
        self.requests: list[dict] = []
        self.unknown: list[str] = []
        self._faults: list[_Fault] = []
        self._lock = threading.RLock()
        self._seq = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle

    def start(self) -> HubServer:
        server = self

        class Handler(_Handler):
            hub = server

        self._httpd = _Server(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name="hub-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    # ---- fault injection and accounting

    def fail_next(
        self,
        n: int = 1,
        *,
        status: int | None = 503,
        kinds: str | tuple[str, ...] | None = None,
        retry_after: float | str | None = None,
        drop: bool = False,
        after_apply: bool = False,
        drop_after: int | None = None,
        path: str | None = None,
        skip: int = 0,
    ) -> None:
        """Fail the next `n` requests of `kinds` (all kinds if None) with `status`, or drop the
        connection (`drop=True`). `after_apply=True` (commits only) applies the commit first.
        `drop_after=k` answers normally but drops the connection after k bytes of the body (a file
        download cut mid-way); `path` limits the fault to requests whose path contains it; `skip`
        lets that many matching requests through first (the third block of a file, say)."""
        kinds_set = frozenset([kinds] if isinstance(kinds, str) else kinds) if kinds else None
        ra = None if retry_after is None else str(retry_after)
        with self._lock:
            self._faults.append(
                _Fault(
                    n, status, kinds_set, ra, drop, after_apply, drop_after=drop_after, path=path, skip=skip
                )
            )

    def faults_left(self) -> int:
        """How many `fail_next` failures are still to come (a test asserts its faults were met)."""
        with self._lock:
            return sum(f.remaining for f in self._faults if f.fraction is None)

    def fail_fraction(
        self, fraction: float, *, status: int = 503, seed: int = 0, kinds: str | tuple[str, ...] | None = None
    ) -> None:
        kinds_set = frozenset([kinds] if isinstance(kinds, str) else kinds) if kinds else None
        with self._lock:
            self._faults.append(
                _Fault(-1, status, kinds_set, None, False, False, fraction=fraction, rng=random.Random(seed))
            )

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take_fault(self, kind: str, path: str = "") -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if f.kinds is not None and kind not in f.kinds:
                    continue
                if f.path is not None and f.path not in path:
                    continue
                if f.skip > 0 and f.remaining > 0:
                    f.skip -= 1
                    continue
                if f.fraction is not None:
                    assert f.rng is not None
                    if f.rng.random() < f.fraction:
                        return f
                    continue
                if f.remaining > 0:
                    f.remaining -= 1
                    return f
            return None

    def reset_counters(self) -> None:
        with self._lock:
            self.counts.clear()
            self.bytes_out.clear()
            self.requests.clear()

    # ---- repository state

    def create_repo(self, repo_id: str) -> Repo:
        with self._lock:
            repo = Repo(repo_id)
            self.repos[repo_id] = repo
            self._add_commit(repo, None, "initial commit", "", {".gitattributes": GITATTRIBUTES})
            return repo

    def _add_commit(
        self, repo: Repo, parent: str | None, title: str, message: str, files: dict[str, bytes]
    ) -> Commit:
        self._seq += 1
        sha = hashlib.sha1(f"{repo.repo_id}|{parent}|{self._seq}|{time.time()}".encode()).hexdigest()
        commit = Commit(sha, parent, title, message, time.time(), files)
        repo.commits[sha] = commit
        repo.order.append(sha)
        return commit

    def create_dataset(self, repo_id: str, files: dict[str, bytes]) -> Repo:
        """A dataset repository holding `files` (path -> bytes) in one commit after the initial one."""
        with self._lock:
            repo = Repo(repo_id, repo_type="dataset")
            self.datasets[repo_id] = repo
            first = self._add_commit(repo, None, "initial commit", "", {".gitattributes": GITATTRIBUTES})
            self._add_commit(
                repo, first.sha, "add data files", "", {".gitattributes": GITATTRIBUTES, **files}
            )
            return repo

    def snapshot(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        with self._lock:
            repo = self.repos[repo_id]
            return dict((repo.head if revision == "main" else repo.commits[revision]).files)


class _HttpError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.error_code, self.headers = status, message, error_code, headers or {}


_API_RE = re.compile(
    r"^/api/(?P<type>models|datasets)/(?P<repo>[^/]+/[^/]+)"
    r"(?:/(?P<op>revision|preupload|commit|tree|paths-info|commits)/(?P<rev>[^/]+)(?P<rest>/.*)?)?$"
)
_RESOLVE_RE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_DATASET_RESOLVE_RE = re.compile(r"^/datasets/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def _resolve_match(path: str) -> tuple[str, re.Match] | None:
    """("dataset" | "model", match) for a /resolve/ URL, else None."""
    if m := _DATASET_RESOLVE_RE.match(path):
        return "dataset", m
    if m := _RESOLVE_RE.match(path):
        return "model", m
    return None


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else small keep-alive responses wait for delayed ACKs (~40 ms)

    def log_message(self, format, *args):  # noqa: A002 - stdlib signature
        pass

    # ---- plumbing

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(
        self,
        status: int,
        body: bytes = b"",
        headers: dict | None = None,
        kind: str = "",
        head=False,
        cut: int | None = None,
    ):
        """Answer; with `cut`, announce the whole body but send only its first `cut` bytes and drop."""
        head = head or self.command == "HEAD"  # an error answer to a HEAD has no body either
        self.send_response(status)
        headers = dict(headers or {})
        headers.setdefault("Content-Type", "application/json")
        headers.setdefault("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if cut is not None:
            with self.hub._lock:
                self.hub.bytes_out[kind] += min(cut, len(body))
            self.wfile.write(body[:cut])
            self.wfile.flush()
            return self._drop()
        if body and not head:
            with self.hub._lock:  # counted before sending, so a client never outruns the count
                self.hub.bytes_out[kind] += len(body)
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None, kind: str = ""):
        self._send(status, json.dumps(obj).encode(), headers, kind)

    def _drop(self):
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _kind(self, method: str, path: str) -> str:
        m = _API_RE.match(path)
        if m:
            base = {
                None: "repo_info",
                "revision": "repo_info",
                "preupload": "preupload",
                "commit": "commit",
                "tree": "tree",
                "paths-info": "paths_info",
                "commits": "commits",
            }[m.group("op")]
            if m.group("type") == "datasets":
                return "dataset_info" if base == "repo_info" else "dataset_" + base
            return base
        if path == "/api/repos/create":
            return "repo_create"
        if path == "/api/agent-harnesses":
            return "agent_harnesses"
        if resolved := _resolve_match(path):
            prefix = "dataset_" if resolved[0] == "dataset" else ""
            return prefix + ("resolve_head" if method == "HEAD" else "resolve_get")
        return "unknown"

    def _handle(self, method: str):
        split = urlsplit(self.path)
        path = split.path
        query = parse_qs(split.query)
        body = self._body() if method in ("POST", "PUT") else b""
        kind = self._kind(method, path)
        hub = self.hub
        with hub._lock:
            hub.counts[kind] += 1
            hub.requests.append(
                {
                    "method": method,
                    "kind": kind,
                    "path": unquote(path),
                    "range": self.headers.get("Range"),
                    "time": time.monotonic(),
                }
            )
            if kind == "unknown":
                hub.unknown.append(f"{method} {self.path}")
        fault = hub._take_fault(kind, unquote(path))
        if fault is not None and not fault.after_apply and fault.drop_after is None:
            if fault.drop:
                return self._drop()
            headers = {"Retry-After": fault.retry_after} if fault.retry_after is not None else {}
            return self._json(fault.status or 503, {"error": f"injected HTTP {fault.status}"}, headers)
        try:
            tokens = [hub.token] if isinstance(hub.token, str) else hub.token
            allowed = None if tokens is None else [f"Bearer {t}" for t in tokens]
            if allowed is not None and self.headers.get("Authorization") not in allowed:
                raise _HttpError(401, "Invalid credentials in Authorization header")
            status, obj, headers, raw = self._route(method, path, query, body, kind)
        except _HttpError as err:
            headers = dict(err.headers)
            if err.error_code:
                headers["X-Error-Code"] = err.error_code
            headers["X-Error-Message"] = err.message
            return self._json(err.status, {"error": err.message}, headers)
        if fault is not None and fault.drop_after is not None and raw is not None and method == "GET":
            return self._send(status, raw, headers, kind=kind, cut=fault.drop_after)
        if fault is not None:  # after_apply: the change happened, the answer is lost
            return self._drop()
        if raw is not None:
            return self._send(status, raw, headers, kind=kind, head=method == "HEAD")
        return self._json(status, obj, headers, kind=kind)

    def do_GET(self):
        self._handle("GET")

    def do_HEAD(self):
        self._handle("HEAD")

    def do_POST(self):
        self._handle("POST")

    # ---- routes

    def _repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        repo = (self.hub.datasets if repo_type == "dataset" else self.hub.repos).get(repo_id)
        if repo is None:
            raise _HttpError(404, f"Repository not found: {repo_id}", "RepoNotFound")
        return repo

    def _commit_at(self, repo: Repo, rev: str) -> Commit:
        rev = unquote(rev)
        if rev == "main":
            return repo.head
        if rev in repo.commits:
            return repo.commits[rev]
        raise _HttpError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def _route(self, method, path, query, body, kind):
        hub = self.hub
        base = hub.url
        with hub._lock:
            if kind == "repo_create" and method == "POST":
                payload = json.loads(body or b"{}")
                org, name = payload.get("organization"), payload.get("name")
                repo_id = f"{org}/{name}" if org else f"user/{name}"
                if repo_id in hub.repos:
                    raise _HttpError(409, "You already created this model repo", headers={})
                hub.create_repo(repo_id)
                return 200, {"url": f"{base}/{repo_id}", "name": repo_id, "id": repo_id}, {}, None
            if kind == "agent_harnesses" and method == "GET":  # huggingface_hub's agent detection
                return 200, {"standardEnvVars": [], "harnesses": {}}, {}, None

            if kind.endswith(("resolve_head", "resolve_get")):
                repo_type, m = _resolve_match(path)
                repo = self._repo(m.group("repo"), repo_type)
                commit = self._commit_at(repo, m.group("rev"))
                file_path = unquote(m.group("path"))
                data = commit.files.get(file_path)
                if data is None:
                    raise _HttpError(
                        404, "Entry not found", "EntryNotFound", headers={"X-Repo-Commit": commit.sha}
                    )
                return self._resolve(commit, data)

            m = _API_RE.match(path)
            if m is None:
                raise _HttpError(404, f"Not implemented by the loopback Hub: {method} {path}")
            repo = self._repo(m.group("repo"), "dataset" if m.group("type") == "datasets" else "model")
            op, rev = m.group("op"), m.group("rev")
            if kind in ("repo_info", "dataset_info") and method == "GET":
                return 200, self._info(repo, rev), {}, None
            if repo.repo_type == "dataset" and op in ("preupload", "commit"):
                raise _HttpError(403, "the loopback Hub's dataset repos are read-only")
            if op == "preupload" and method == "POST":
                return 200, self._preupload(repo, rev, body), {}, None
            if op == "commit" and method == "POST":
                return self._commit(repo, unquote(rev), body)
            if op == "tree" and method == "GET":
                commit = self._commit_at(repo, rev)
                sub = unquote(m.group("rest") or "").strip("/")
                return self._tree(repo, commit, rev, sub, query)
            if op == "paths-info" and method == "POST":
                return 200, self._paths_info(repo, rev, body), {}, None
            if op == "commits" and method == "GET":
                return 200, self._history(repo, rev), {}, None
            raise _HttpError(404, f"Not implemented by the loopback Hub: {method} {path}")

    def _info(self, repo: Repo, rev: str | None) -> dict:
        """repo_info / model_info / dataset_info: the repository at `rev` (its head without one)."""
        commit = self._commit_at(repo, rev) if rev else repo.head
        info = {
            "id": repo.repo_id,
            "sha": commit.sha,
            "private": repo.repo_type == "model",
            "lastModified": _iso(commit.time),
            "siblings": [{"rfilename": p} for p in sorted(commit.files)],
        }
        if repo.repo_type == "model":
            info["modelId"] = repo.repo_id
        else:
            info |= {"author": repo.repo_id.split("/")[0], "gated": False, "disabled": False}
        return info

    def _preupload(self, repo: Repo, rev: str, body: bytes) -> dict:
        """Every file is "regular": the client sends contents inline in the commit, never LFS or Xet."""
        commit = self._commit_at(repo, rev)
        out = []
        for f in json.loads(body)["files"]:
            entry = {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
            if f["path"] in commit.files:
                entry["oid"] = git_blob_sha1(commit.files[f["path"]])
            out.append(entry)
        return {"files": out, "commitOid": commit.sha}

    def _paths_info(self, repo: Repo, rev: str, body: bytes) -> list[dict]:
        commit = self._commit_at(repo, rev)
        out = []
        for p in parse_qs(body.decode()).get("paths", []):
            if p in commit.files:
                out.append(self._file_entry(p, commit.files[p]))
            elif any(f.startswith(p.rstrip("/") + "/") for f in commit.files):
                out.append(self._dir_entry(p))
        return out

    def _history(self, repo: Repo, rev: str) -> list[dict]:
        """list_repo_commits: from `rev` back to the first commit."""
        history = []
        c: Commit | None = self._commit_at(repo, rev)
        while c is not None:
            entry = {"id": c.sha, "authors": [{"user": "loopback"}], "date": _iso(c.time)}
            history.append(entry | {"title": c.title, "message": c.message})
            c = repo.commits.get(c.parent) if c.parent else None
        return history

    @staticmethod
    def _file_entry(path: str, data: bytes) -> dict:
        return {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}

    @staticmethod
    def _dir_entry(path: str) -> dict:
        return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}

    def _tree(self, repo: Repo, commit: Commit, rev: str, sub: str, query: dict):
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        prefix = sub + "/" if sub else ""
        under = [p for p in commit.files if p.startswith(prefix)]
        if sub and not under:
            raise _HttpError(404, f"File not found: {sub}", "EntryNotFound")
        entries: dict[str, dict] = {}
        for p in under:
            rel = p[len(prefix) :].split("/")
            depth = len(rel) if recursive else 1
            for i in range(1, min(depth, len(rel) - 1) + 1):  # folders on the way
                d = prefix + "/".join(rel[:i])
                entries.setdefault(d, self._dir_entry(d))
            if recursive or len(rel) == 1:
                entries[p] = self._file_entry(p, commit.files[p])
        ordered = [entries[k] for k in sorted(entries)]
        cursor = int(query.get("cursor", ["0"])[0])
        page = ordered[cursor : cursor + self.hub.page_size]
        headers = {}
        if cursor + self.hub.page_size < len(ordered):
            params = {k: v[0] for k, v in query.items()}
            params["cursor"] = str(cursor + self.hub.page_size)
            enc = "/" + quote(sub, safe="") if sub else ""
            nxt = f"{self.hub.url}/api/{repo.repo_type}s/{repo.repo_id}/tree/{rev}{enc}?{urlencode(params)}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        return 200, page, headers, None

    def _commit(self, repo: Repo, rev: str, body: bytes):
        if rev != "main":
            raise _HttpError(400, f"the loopback Hub only commits to main, not {rev!r}")
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise _HttpError(400, "first NDJSON line must be the header")
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent is not None and parent != repo.head.sha:
            raise _HttpError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(repo.head.files)
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            if key == "file":
                if value.get("encoding") != "base64":
                    raise _HttpError(400, "only base64 file contents are supported")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if value["path"] not in files:
                    raise _HttpError(404, "A file with this name doesn't exist", "EntryNotFound")
                del files[value["path"]]
            elif key == "deletedFolder":
                folder = value["path"].rstrip("/") + "/"
                gone = [p for p in files if p.startswith(folder)]
                if not gone:
                    raise _HttpError(404, "A folder with this name doesn't exist", "EntryNotFound")
                for p in gone:
                    del files[p]
            elif key == "lfsFile":
                raise _HttpError(
                    400, "the loopback Hub answered 'regular' for every file; LFS is not supported"
                )
            else:
                raise _HttpError(400, f"unknown commit operation {key!r}")
        commit = self.hub._add_commit(
            repo, repo.head.sha, header.get("summary", ""), header.get("description", ""), files
        )
        return (
            200,
            {
                "success": True,
                "commitOid": commit.sha,
                "commitUrl": f"{self.hub.url}/{repo.repo_id}/commit/{commit.sha}",
                "hookOutput": "",
            },
            {},
            None,
        )

    def _resolve(self, commit: Commit, data: bytes):
        headers = {
            "X-Repo-Commit": commit.sha,
            "ETag": f'"{git_blob_sha1(data)}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        size = len(data)
        rng = self.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip()) if rng else None
        if m is None or (not m.group(1) and not m.group(2)):
            return 200, None, headers, data
        if m.group(1):
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
        else:  # suffix range: the last n bytes
            start, end = max(0, size - int(m.group(2))), size - 1
        if start >= size or start > end:
            raise _HttpError(
                416, "Requested Range Not Satisfiable", headers={"Content-Range": f"bytes */{size}"}
            )
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        return 206, None, headers, data[start : end + 1]

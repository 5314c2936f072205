"""Steps 1-4 of the master's outer loop: list the delta files, read each header once per file version
(the delta's identity: node_id, local_step, payload SHA-256), download and validate the payload.

Invariants: a file is identified before it is downloaded; a delta is rejected with one reason (path,
size, header, metadata, keys, shapes, float32, finite, SHA-256) or accepted whole; a transport error only
postpones a file to the next poll (`transient`). Prose: docs/dumb_diloco.md ("Master outer loop").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .recovery import LedgerEntry
from .tensor_format import NODES_DIR, DeltaMeta, InvalidTensorFile, decode, parse_delta_path
from .transport import FileTooLarge, RemoteNotFound, Transport, TransportError

log = logging.getLogger("diloco.dumb_diloco")


@dataclass
class Candidate:
    path: str
    node_id: str
    local_step: int
    sha256: str  # from the header (verified against the payload when downloaded)
    meta: DeltaMeta | None = None
    reason: str = ""  # non-empty: already known to be invalid

    @property
    def identity(self) -> tuple[str, int, str]:
        return (self.node_id, self.local_step, self.sha256)

    def entry(self, status: str, outer_step: int, reason: str = "", staleness: int = -1) -> LedgerEntry:
        base = self.meta.base_outer_step if self.meta else -1
        return LedgerEntry(
            self.node_id, self.local_step, self.sha256, status, outer_step, base, reason, staleness
        )


class Intake:
    """The master's view of nodes/: what to consider, who sent it, and whether it is a valid delta."""

    def __init__(
        self, transport: Transport, layout: dict, max_file_bytes: int, allowed: frozenset[str] | None
    ):
        self.transport, self.layout, self.max_file_bytes = transport, layout, max_file_bytes
        self.allowed = allowed  # None: every node (no distributed.collaborators)
        self.ignored_nodes: set[str] = set()
        self.headers: dict[tuple[str, str], Candidate] = {}  # (path, version) -> identity from its header
        self.transient = False  # this round skipped something after a transport error (retried next poll)
        self.refused: list[tuple[str, int, str, str]] = []  # (node, step, tag, reason) from the last listing
        self.bytes_downloaded = 0

    def list(self, revision: str) -> list:
        """The delta files to consider; files refused from their path alone (past the spec: a node
        outside `collaborators`, a path-unsafe node directory) go to `self.refused` for the ledger."""
        out, self.refused = [], []
        for f in self.transport.list(NODES_DIR, revision):
            parsed = parse_delta_path(f.path)
            if parsed is None:
                self._refuse_unsafe(f.path)
            elif self.allowed is not None and parsed[0] not in self.allowed:
                if parsed[0] not in self.ignored_nodes:
                    self.ignored_nodes.add(parsed[0])
                    log.warning("master: ignoring deltas of %r: not in distributed.collaborators", parsed[0])
                # identity without the payload hash: a later master with a wider list still takes the delta
                reason = "node is not in distributed.collaborators"
                self.refused.append((parsed[0], parsed[1], "not-a-collaborator", reason))
            else:
                out.append(f)
        return out

    def _refuse_unsafe(self, path: str) -> None:
        """nodes/<dir>/delta_<n>.safetensors whose <dir> is not a valid node id (e.g. '..', spaces)."""
        parts = path.split("/")
        if len(parts) < 3 or not parts[-1].startswith("delta_") or not parts[-1].endswith(".safetensors"):
            return  # not shaped like a delta (a README, a stray file): ignored
        step, node = parts[-1].removeprefix("delta_").removesuffix(".safetensors"), "/".join(parts[1:-1])
        reason = f"path-unsafe node directory {node!r} in {path}"
        self.refused.append((node, int(step) if step.isdigit() else -1, f"unsafe-path:{path}", reason))

    def candidate(self, f, revision: str) -> Candidate | None:
        """The delta's identity from its path and header (the header only once per file version)."""
        key = (f.path, getattr(f, "version", ""))
        if key[1] and key in self.headers:
            return self.headers[key]
        c = self._read_candidate(f, revision)
        if key[1] and c is not None:
            self.headers[key] = c
        return c

    def _read_candidate(self, f, revision: str) -> Candidate | None:
        node_id, local_step = parse_delta_path(f.path)  # type: ignore[misc]
        if f.size > self.max_file_bytes:  # refused from the listing: not even its header is read
            reason = f"file is {f.size} bytes, over the cap of {self.max_file_bytes} (max_file_bytes)"
            return Candidate(f.path, node_id, local_step, f"oversized-{f.size}", reason=reason)
        try:
            header = self.transport.read_header(f.path, revision)
        except InvalidTensorFile as err:  # no readable header, so no hash: identify it by its size
            return Candidate(f.path, node_id, local_step, f"unreadable-{f.size}", reason=err.reason)
        except RemoteNotFound:
            return None
        except TransportError as err:  # transient: try again next poll
            log.warning("master: cannot read the header of %s (%s); will retry", f.path, err)
            self.transient = True
            return None
        sha = header.metadata.get("payload_sha256", "")
        if not sha:
            return Candidate(
                f.path, node_id, local_step, f"no-sha-{f.size}", reason="metadata has no payload_sha256"
            )
        try:
            return Candidate(f.path, node_id, local_step, sha, DeltaMeta.from_header(header.metadata))
        except InvalidTensorFile as err:
            return Candidate(f.path, node_id, local_step, sha, reason=err.reason)

    def download(self, c: Candidate, revision: str) -> dict[str, torch.Tensor] | str | None:
        """The delta's tensors, a rejection reason (str), or None (transient failure: retried next poll)."""
        if c.reason:
            return c.reason
        assert c.meta is not None
        if (c.meta.node_id, c.meta.local_step) != (c.node_id, c.local_step):
            said, path = f"{c.meta.node_id}@{c.meta.local_step}", f"{c.node_id}@{c.local_step}"
            return f"metadata says {said} but the path says {path}"
        if c.meta.dtype != "float32":
            return f"delta dtype is {c.meta.dtype}, expected float32"
        try:
            blob = self.transport.read(c.path, revision, max_bytes=self.max_file_bytes)
        except FileTooLarge as err:
            return f"{err} (max_file_bytes)"
        except RemoteNotFound:
            return None
        except TransportError as err:
            log.warning("master: cannot download %s (%s); will retry", c.path, err)
            self.transient = True
            return None
        self.bytes_downloaded += len(blob)
        try:
            tensors, meta = decode(blob, max_bytes=self.max_file_bytes, expected=self.layout)
        except InvalidTensorFile as err:
            return err.reason
        if meta.get("payload_sha256") != c.sha256:
            return "the file changed between its header and its download"
        return tensors

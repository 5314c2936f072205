"""Steps 1-4 of the master's outer loop: list the delta files, read each header once per file version
(the delta's identity: node_id, local_step, payload SHA-256), download and validate the payload.

Invariants: a file is identified before it is downloaded; a delta is rejected with one reason (path,
size, header, metadata, keys, shapes, float32 or int8/int4 payload sizes, finite, SHA-256) or accepted
whole, as float32 (delta_codec: a quantized one dequantized); a transport error only postpones a file to
the next poll (`transient`). Prose: docs/dumb_diloco.md ("Master outer loop").
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch

from ..store.transport import FileTooLarge, ReadsInto, RemoteNotFound, Transport, TransportError
from ..wire.delta_codec import WIRE_DTYPES, to_float32, wire_layout
from ..wire.repo_paths import NODES_DIR, is_node_id, marker_node, parse_delta_path
from ..wire.tensor_format import DeltaMeta, InvalidTensorFile, decode
from .recovery import Ledger, LedgerEntry

log = logging.getLogger("diloco.dumb_diloco")
MARKER_MAX_BYTES = 2**16


def parse_final_marker(raw: bytes, node_id: str) -> tuple[int, str] | None:
    """(local step, payload SHA-256) of the last delta a finished node names (-1, "" if it sent none);
    None while it runs, or if the marker is not a valid one of `node_id`."""
    try:
        m = json.loads(raw)
        step, sha = m["last_local_step"], m["last_delta_sha256"]
        if m["node_id"] != node_id or m.get("state") != "finished":
            return None
        if isinstance(step, bool) or not isinstance(step, int) or step < -1:
            return None
        return (step, sha) if isinstance(sha, str) else None
    except (ValueError, UnicodeDecodeError, KeyError, TypeError):
        return None


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
        base, micros = (self.meta.base_outer_step, self.meta.step_micros) if self.meta else (-1, 0)
        return LedgerEntry(
            self.node_id, self.local_step, self.sha256, status, outer_step, base, reason, staleness, micros
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
        self.markers: dict[str, object] = {}  # node -> its nodes/<node>/final.json (RemoteFile), last listing
        self.all_finished = False  # at the last `unfinished`: every node had written its final marker
        self._marker_cache: dict[tuple[str, str], tuple[int, str] | None] = {}  # (path, version) -> parsed
        self.bytes_downloaded = 0
        self.buffer: bytearray | None = None  # a store that `ReadsInto`: one file buffer, reused (`download`)

    def candidates(self, revision: str) -> list[Candidate]:
        """Steps 1 and 2 of a round (it starts here: `transient` cleared): the delta files listed now, each
        with its identity from its header; a header is remembered only while its file version is listed."""
        self.transient = False
        listed = self.list(revision)
        live = {(f.path, getattr(f, "version", "")) for f in listed}
        self.headers = {k: c for k, c in self.headers.items() if k in live}
        return [c for f in listed if (c := self.candidate(f, revision)) is not None]

    def end_round(self) -> None:
        """The round's file buffer goes: no model-sized bytes are held between polls."""
        self.buffer = None

    def list(self, revision: str) -> list:
        """The delta files to consider. Files refused from their path alone (past the spec: a node outside
        `collaborators`, anything under nodes/ that is not a delta) go to `self.refused` for the ledger;
        final markers to `self.markers`."""
        out, self.refused, self.markers = [], [], {}
        for f in self.transport.list(NODES_DIR, revision):
            parsed = parse_delta_path(f.path)
            if parsed is None and (marker := marker_node(f.path)) is not None:
                self.markers[marker] = f
            elif parsed is None:
                self._refuse(f)
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

    def _refuse(self, f) -> None:
        """A file under nodes/ that is not nodes/<node_id>/delta_<n>.safetensors nor a final marker: on
        the record (one ledger entry per path and version) and never read."""
        parts, version = f.path.split("/"), getattr(f, "version", "") or f"{f.size}"
        node = "/".join(parts[1:-1]) or "(none)"
        name = parts[-1].removeprefix("delta_").removesuffix(".safetensors")
        if not is_node_id(node):
            reason = f"path-unsafe node directory {node!r} in {f.path}"
        else:
            reason = (
                f"not a delta file name: {f.path} (expected {NODES_DIR}/<node_id>/delta_<step>.safetensors)"
            )
        step = int(name) if name.isdigit() and len(name) < 19 else -1
        self.refused.append((node, step, f"bad-path:{f.path}@{version}", reason))

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
            return Candidate(f.path, node_id, local_step, _tag("oversized", f), reason=reason)
        try:
            header = self.transport.read_header(f.path, revision)
        except InvalidTensorFile as err:  # no readable header, so no hash: identify it by its version
            return Candidate(f.path, node_id, local_step, _tag("unreadable", f), reason=err.reason)
        except RemoteNotFound:
            return None
        except TransportError as err:  # transient: try again next poll
            log.warning("master: cannot read the header of %s (%s); will retry", f.path, err)
            self.transient = True
            return None
        sha = header.metadata.get("payload_sha256", "")
        if not sha:
            return Candidate(
                f.path, node_id, local_step, _tag("no-sha", f), reason="metadata has no payload_sha256"
            )
        try:
            return Candidate(f.path, node_id, local_step, sha, DeltaMeta.from_header(header.metadata))
        except InvalidTensorFile as err:
            return Candidate(f.path, node_id, local_step, sha, reason=err.reason)

    def download(self, c: Candidate, revision: str) -> dict[str, torch.Tensor] | str | None:
        """The delta's tensors, a rejection reason (str), or None (transient failure: retried next poll).
        float32: read-only views of the downloaded bytes (one copy of the file in memory, none made by
        loading; from a store that `ReadsInto`, in `self.buffer`, which the next download overwrites);
        int8/int4: one dequantized float32 copy. Read them, add them into a sum, drop them."""
        if c.reason:
            return c.reason
        assert c.meta is not None
        if (c.meta.node_id, c.meta.local_step) != (c.node_id, c.local_step):
            said, path = f"{c.meta.node_id}@{c.meta.local_step}", f"{c.node_id}@{c.local_step}"
            return f"metadata says {said} but the path says {path}"
        if c.meta.dtype not in WIRE_DTYPES:
            return f"delta dtype is {c.meta.dtype}, expected {', '.join(WIRE_DTYPES)}"
        try:
            if isinstance(self.transport, ReadsInto):  # no fresh buffer (and its page faults) per file
                blob = self.transport.read_into(c.path, self.buffer, revision, max_bytes=self.max_file_bytes)
                self.buffer = blob.obj  # type: ignore[assignment]
            else:
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
            expected = wire_layout(self.layout, c.meta)  # float32: the model's; int8/int4: payload sizes
            tensors, meta = decode(blob, max_bytes=self.max_file_bytes, expected=expected, views=True)
            if meta.get("payload_sha256") != c.sha256:
                return "the file changed between its header and its download"
            return to_float32(tensors, c.meta, self.layout)  # quantized: dequantized, NaN/Inf refused
        except InvalidTensorFile as err:
            return err.reason

    # ---- duplicates, and the end of a run

    def duplicate_of(self, c: Candidate, ledger: Ledger, seen: dict[str, str]) -> str | None:
        """Why `c` is a duplicate: its payload SHA-256 was applied, or is pending (`seen`: sha -> who),
        under another identity (a copy uploaded under another node or step). None if it is not one."""
        if c.reason or not c.meta:
            return None
        if (e := ledger.applied_payload(c.sha256)) is not None:
            return f"same payload (SHA-256) as {e.node_id}@{e.local_step}, {e.status} at outer step {e.outer_step}"
        if c.sha256 in seen:
            return f"same payload (SHA-256) as {seen[c.sha256]}, pending in this round"
        return None

    def unfinished(
        self, listed: list[Candidate], ledger: Ledger, master: str, revision: str
    ) -> dict[str, str]:
        """At the end of a run: every node whose final delta is not processed yet, and why. The nodes are
        `collaborators` (and the master), or else every node with a delta or a final marker in nodes/; a
        node is finished when its marker (nodes/<node>/final.json, written after its last upload) names a
        processed delta and nothing newer of it waits."""
        nodes = set(self.allowed) if self.allowed else {c.node_id for c in listed} | set(self.markers)
        out, self.all_finished = {}, True  # all_finished: every node's marker says so (nothing new will come)
        for node in sorted(nodes | {master}):
            mine = [c for c in listed if c.node_id == node]
            waiting = [c for c in mine if c.identity not in ledger]
            final = self._read_marker(node, revision)
            if final is None or any(c.local_step > final[0] for c in mine):
                self.all_finished = False
                out[node] = "not finished yet" + (f", {len(waiting)} delta(s) waiting" if waiting else "")
            elif waiting:
                out[node] = f"{len(waiting)} delta(s) waiting: " + ", ".join(c.path for c in waiting[:3])
            elif (
                final[0] >= 0
                and (node, *final) not in ledger
                and not any(c.local_step == final[0] for c in mine)
            ):
                out[node] = f"its final delta (local step {final[0]}) is not in the repository yet"
        return out

    def finished(self, revision: str) -> set[str]:
        """The nodes (of the last listing) whose marker says they finished: they send no more deltas."""
        nodes = self.markers if self.allowed is None else [n for n in self.markers if n in self.allowed]
        return {n for n in nodes if self._read_marker(n, revision) is not None}

    def _read_marker(self, node: str, revision: str) -> tuple[int, str] | None:
        """(last local step, its payload SHA-256) from the node's final marker; None without a valid one."""
        f = self.markers.get(node)
        if f is None:
            return None
        key = (f.path, getattr(f, "version", "") or str(f.size))
        if key not in self._marker_cache:
            try:
                raw = self.transport.read(f.path, revision, max_bytes=MARKER_MAX_BYTES)
            except TransportError as err:
                log.warning("master: cannot read %s (%s); will retry", f.path, err)
                return None
            self._marker_cache[key] = parse_final_marker(raw, node)
        return self._marker_cache[key]


def _tag(kind: str, f) -> str:
    """The identity of a file with no usable payload hash: its kind, size and version (one entry each)."""
    return f"{kind}-{f.size}-{getattr(f, 'version', '')}".rstrip("-")

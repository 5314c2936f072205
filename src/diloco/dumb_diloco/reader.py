"""Reading the global model from the repository, for a worker's poll and a master's start-up.

Invariants: global/step_count.json and global/latest.safetensors are read at one revision; a global
is returned only if newer than what the node holds and fully validated (the model's keys, shapes and
dtypes, finite, SHA-256, the same outer step in both files); a rejected global is remembered by
(outer step, SHA-256) and not downloaded again. Prose: docs/dumb_diloco.md ("Node lifecycle").
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from .recovery import GlobalSnapshot
from .tensor_format import GLOBAL_STEP_PATH, GLOBAL_WEIGHTS_PATH, InvalidTensorFile, decode, parse_header
from .transport import RemoteNotFound, Transport

STEP_FILE_MAX_BYTES = 16 * 2**20
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


class GlobalMismatch(InvalidTensorFile):
    """A well-formed global of another model (keys, shapes or dtypes): waiting will not fix it."""


def parse_step_info(raw: bytes) -> dict:
    """global/step_count.json, checked (InvalidTensorFile with one line on anything odd)."""
    try:
        info = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidTensorFile(f"{GLOBAL_STEP_PATH} is not JSON ({err})") from None
    step = info.get("outer_step") if isinstance(info, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidTensorFile(f"{GLOBAL_STEP_PATH} has no valid outer_step: {str(info)[:80]}")
    if not isinstance(info.get("deltas", []), list):
        raise InvalidTensorFile(f"{GLOBAL_STEP_PATH}: deltas must be a list")
    return info


class GlobalReader:
    def __init__(self, layout: Layout, max_file_bytes: int, on_bytes: Callable[[int], None]):
        self.layout, self.max_file_bytes, self.on_bytes = layout, max_file_bytes, on_bytes
        self.seen_revision: str | None = None
        self.rejected: set[tuple[int, str]] = set()  # (outer_step, global_sha256) that failed validation
        self.step_info: dict = {}  # step_count.json of the newest global fetched

    def fetch(self, transport: Transport, newer_than: int) -> GlobalSnapshot | None:
        """A global newer than `newer_than`, or None. Raises TransportError, or InvalidTensorFile
        (GlobalMismatch for another model's) for a global that fails validation."""
        revision = transport.revision()
        if revision == self.seen_revision:
            return None
        try:
            raw = transport.read(GLOBAL_STEP_PATH, revision, max_bytes=STEP_FILE_MAX_BYTES)
        except RemoteNotFound:
            self.seen_revision = revision
            return None
        self.on_bytes(len(raw))
        info = parse_step_info(raw)
        outer_step, sha = info["outer_step"], info.get("global_sha256", "")
        if outer_step <= newer_than or (outer_step, sha) in self.rejected:
            self.seen_revision = revision
            return None
        blob = transport.read(GLOBAL_WEIGHTS_PATH, revision, max_bytes=self.max_file_bytes)
        self.on_bytes(len(blob))
        self.seen_revision = revision
        try:
            tensors, meta = decode(blob, max_bytes=self.max_file_bytes, expected=self.layout)
            if meta.get("outer_step") != str(outer_step):
                raise InvalidTensorFile(
                    f"global file is outer step {meta.get('outer_step')!r} but step_count.json says {outer_step}"
                )
        except InvalidTensorFile as err:
            self.rejected.add((outer_step, sha))
            kind = GlobalMismatch if self._is_other_model(blob) else InvalidTensorFile
            raise kind(f"global outer step {outer_step}: {err.reason}") from None
        self.step_info = info
        peers = len({d.get("node_id") for d in info.get("deltas", []) if isinstance(d, dict)})
        return GlobalSnapshot(outer_step, tensors, source="repo", num_peers=peers)

    def _is_other_model(self, blob: bytes) -> bool:
        """True for a well-formed file whose keys, shapes or dtypes differ from this model's."""
        try:
            parse_header(blob, file_size=len(blob))
        except InvalidTensorFile:
            return False  # corrupt, not another model
        try:
            decode(blob, max_bytes=len(blob), expected=self.layout, require_finite=False, verify_sha=False)
        except InvalidTensorFile:
            return True
        return False

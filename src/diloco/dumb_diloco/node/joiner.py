"""How a node joins a run: reading the global model (`GlobalReader`) and the `Joiner` (a worker's wait for
the master's first global, the init-weights check, a master's quorum wait); a master's start from the
newest state it can trust (`take_lease`, `recover_outer_loop`, `open_outer_loop`) is master/startup.py.

Invariants: step_count.json and latest.safetensors are read at one revision; a global is returned only
if newer than what the node holds and fully validated (the model's keys, shapes and dtypes, finite,
SHA-256, one outer step in both files); a rejected global is not downloaded again; a worker never
joins a master built from other initial weights; both run under the start-up deadline of
`DumbDiLoCo.start` (startup_timeout, retries included). Prose: docs/dumb_diloco.md ("Node lifecycle",
"Restarts and checkpoints").
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import torch

from diloco.errors import ConfigError

from ..settings import DumbDiLoCoError, Settings
from ..store.transport import (
    RemoteNotFound,
    TransientError,
    Transport,
    TransportError,
    open_transport,
    time_left,
)
from ..wire.global_state import GlobalSnapshot
from ..wire.repo_paths import GLOBAL_STEP_PATH, GLOBAL_WEIGHTS_PATH, announced_nodes
from ..wire.tensor_format import GlobalMismatch, InvalidTensorFile, decode, parse_header

log = logging.getLogger("diloco.dumb_diloco")
STEP_FILE_MAX_BYTES = 16 * 2**20
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


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
        self.layout = layout
        self.max_file_bytes = max_file_bytes
        self.on_bytes = on_bytes
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
            # read-only views of the downloaded bytes: one copy of the global in memory (a global is never
            # written: it is copied into the live model, and the node's baseline refers to it as it is)
            tensors, meta = decode(blob, max_bytes=self.max_file_bytes, expected=self.layout, views=True)
            if meta.get("outer_step") != str(outer_step):
                raise InvalidTensorFile(
                    f"global file is outer step {meta.get('outer_step')!r} but step_count.json says "
                    f"{outer_step}"
                )
        except InvalidTensorFile as err:
            self.rejected.add((outer_step, sha))
            kind = GlobalMismatch if self._is_other_model(blob) else InvalidTensorFile
            raise kind(f"global outer step {outer_step}: {err.reason}") from None
        self.step_info = info
        peers = len({d.get("node_id") for d in info.get("deltas", []) if isinstance(d, dict)})
        included, micros = (_int_map(info.get(key)) for key in ("included", "step_micros"))
        return GlobalSnapshot(outer_step, tensors, "repo", peers, included, micros)

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


class Joiner:
    """How one node joins a run: it opens the store (`transport`), reads the globals (`reader`), waits
    for the master's first global, refuses a master of other initial weights and (a master) waits for
    its quorum."""

    def __init__(
        self,
        settings: Settings,
        reader: GlobalReader,
        init_sha256: str,
        transport: Transport | None = None,
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        wrap_transport: Callable[[Transport], Transport] | None = None,
    ):
        self.s = settings
        self.reader = reader
        self.init_sha256 = init_sha256
        self.transport = transport
        self.wrap_transport = wrap_transport  # applied to the store `_open` opens (a throttled link, ...)
        self.clock, self.sleep = clock, sleep

    def fetch(self, newer_than: int) -> GlobalSnapshot | None:
        """A global newer than `newer_than` (GlobalReader.fetch), None if there is none."""
        return self.reader.fetch(self.transport, newer_than)

    def connect(
        self, fetch: Callable[[], GlobalSnapshot | None], holding_a_global: bool
    ) -> GlobalSnapshot | None:
        """Open the repository. A worker waits (up to startup_timeout, and never past the deadline that
        `DumbDiLoCo.start` sets) for the master's first global (`fetch`) and returns it, to be staged;
        the master creates the repository (private, on the Hub). None when already connected (and, a
        worker, `holding_a_global`) or a master."""
        s = self.s
        if self.transport is not None and (s.is_master or holding_a_global):
            return None
        deadline = self.clock() + s.startup_timeout
        announced = False
        rejected = ""
        waiting_for = ""
        while True:
            if waiting_for and _start_deadline_passed():  # no attempt after start()'s deadline
                raise self._no_global(waiting_for)
            try:
                if self.transport is None:
                    self.transport = self._open()
                if s.is_master:
                    return None
                snapshot = fetch()
                if snapshot is not None:
                    self.check_same_start()
                    return snapshot
                waiting_for = "the master's first global model"
            except (RemoteNotFound, TransientError) as err:
                if s.is_master:
                    raise s.error(f"cannot open {s.repo_id}: {err}") from None
                waiting_for = f"the repository ({err})"
            except TransportError as err:
                raise s.error(f"cannot {'open' if s.is_master else 'read'} {s.repo_id}: {err}") from None
            except GlobalMismatch as err:
                raise s.error(
                    f"the global model in {s.repo_id} is not this model ({err.reason}); use the same model "
                    "config as the master, or another repo_id"
                ) from None
            except InvalidTensorFile as err:
                rejected = err.reason
            if rejected:
                waiting_for = f"a valid global model (the newest was rejected: {rejected})"
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise self._no_global(waiting_for)
            if not announced:
                log.info("node %s: waiting for %s in %s", s.node_id, waiting_for, s.repo_id)
                announced = True
            wait = min(s.poll_interval, 2.0, remaining)
            left = time_left()
            if left is not None:
                wait = min(wait, max(left, 0.0))
            self.sleep(wait)

    def _open(self) -> Transport:
        s = self.s
        try:
            transport = open_transport(
                s.repo_id, token=s.token, create=s.is_master, retry=s.retry, timeout_s=s.request_timeout
            )
        except ValueError as err:
            raise ConfigError(f"distributed.repo_id: {err}") from None
        return self.wrap_transport(transport) if self.wrap_transport is not None else transport

    def _no_global(self, waiting_for: str) -> DumbDiLoCoError:
        s = self.s
        return s.error(
            f"no global model in {s.repo_id} after {s.startup_timeout:g}s (waiting for {waiting_for}); "
            "start the master (distributed.role=master) with the same distributed.repo_id, or raise "
            "distributed.startup_timeout"
        )

    def check_same_start(self) -> None:
        """A worker built with other initial weights than the master's (another seed, model config or
        transformers version) would compute deltas for another model: stop, naming both hashes."""
        theirs = self.reader.step_info.get("init_sha256")
        if theirs is not None and theirs != self.init_sha256:
            raise self.s.error(
                f"initial weights differ from the master's (sha256 {self.init_sha256} here, {theirs} on "
                f"{self.reader.step_info.get('master', 'the master')}): use the master's seed, model config "
                "and transformers version"
            )

    def await_quorum(self, outer_step: int) -> None:
        """Past the spec: a master starting a run (`outer_step` 0) with a quorum of N nodes trains only
        once N nodes (itself included) have announced themselves (nodes/<id>/final.json), at most until
        the start-up deadline. Without it the master, which needs no first global, starts a few seconds
        early and its deltas stay a round ahead of everyone else's for the whole run (tiny family: 3 s
        of start-up is a whole round)."""
        s = self.s
        if not s.is_master or s.min_deltas_per_round <= 1 or outer_step > 0:
            return
        allowed = set(s.collaborators) | {s.node_id} if s.collaborators else None
        while True:
            try:
                running = announced_nodes(self.transport, self.transport.revision())
            except TransportError:
                running = set()
            running = (running if allowed is None else running & allowed) | {s.node_id}
            if len(running) >= s.min_deltas_per_round:
                log.info(
                    f"master: {len(running)} node(s) running, the quorum of {s.min_deltas_per_round}: starting"
                )
                return
            left = time_left()
            if left is not None and left < s.poll_interval + 5:
                log.warning(
                    f"master: starting with {len(running)} of the quorum's {s.min_deltas_per_round} nodes "
                    "running"
                )
                return
            time.sleep(s.poll_interval)


def _start_deadline_passed() -> bool:
    left = time_left()
    return left is not None and left <= 0


def _int_map(value: object) -> dict[str, int]:
    """A step_count.json map of node -> int, its other entries dropped (a hostile file cannot break a node)."""
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool)}

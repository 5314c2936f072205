"""What a DumbDiLoCo master writes: the files of one publication (steps 7 and 8, one transport write:
global/latest.safetensors and global/step_count.json; past the spec the ledger, the outer momentum and the
model's transformers config beside them), the ledger on its own, and the single-master lease; the
`Publisher` that writes them, fences itself off when another process holds the lease, and knows what the
repository holds from this master.

Invariants: every file of a publication names the same outer step and global SHA-256; the lease names the
process (its instance token), not only the node id. Formats: docs/dumb_diloco.md ("Repository layout").
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field

from ..store.base import why_permanent
from ..store.budget import LEDGER_EVERY_S
from ..store.transport import Transport, TransportError
from ..wire.repo_paths import (
    GLOBAL_LEDGER_PATH,
    GLOBAL_MOMENTUM_PATH,
    GLOBAL_STEP_PATH,
    GLOBAL_WEIGHTS_PATH,
    LEASE_PATH,
    utc_now,
)
from ..wire.tensor_format import encode, parse_header
from .recovery import LedgerEntry, MasterState, read_lease

log = logging.getLogger("diloco.dumb_diloco")

HF_CONFIG_PATH = "config.json"
HF_INDEX_PATH = "model.safetensors.index.json"


def global_files(
    state: MasterState,
    master: str,
    outer: dict,
    applied: Iterable[LedgerEntry],
    publish_state: bool,
    hf_config: dict | None,
) -> tuple[dict[str, bytes], dict]:
    """The files of one publication of `state` (call it under the lock that guards the state), and their
    common fields (outer_step, created_at, master, global_sha256). `outer`: outer_lr, outer_momentum and
    init_sha256 for step_count.json; `hf_config`: also write config.json and the weight index."""
    weights = state.published(share=True)  # float32 entries: the state's own tensors, only encoded here
    common = {"outer_step": state.outer_step, "created_at": utc_now(), "master": master}
    meta = {k: str(v) for k, v in common.items()}
    blob = encode(weights, meta | {"kind": "dumb_diloco_global", "format": "pt"})
    common["global_sha256"] = parse_header(blob).metadata["payload_sha256"]
    step_info = common | {"format_version": "1"} | {k: v for k, v in outer.items() if v is not None}
    step_info["deltas"] = [
        {
            "node_id": e.node_id,
            "local_step": e.local_step,
            "sha256": e.sha256,
            "base_outer_step": e.base_outer_step,
        }
        for e in applied
    ]
    step_info["included"] = dict(sorted(state.ledger.included.items()))  # node -> newest applied local step
    if state.ledger.step_micros:  # node -> busy microseconds per step (dynamic local steps)
        step_info["step_micros"] = dict(sorted(state.ledger.step_micros.items()))
    files = {GLOBAL_WEIGHTS_PATH: blob, GLOBAL_STEP_PATH: json.dumps(step_info, indent=1).encode()}
    if publish_state:
        files[GLOBAL_LEDGER_PATH] = ledger_blob(common, state.ledger.to_json())
        momentum = {f"momentum/{k}": t for k, t in state.momentum.items()}
        momentum |= {f"delayed/{k}": t for k, t in state.delayed.items()}
        meta = {k: str(v) for k, v in common.items()} | {"kind": "dumb_diloco_outer_momentum"}
        files[GLOBAL_MOMENTUM_PATH] = encode(momentum, meta | {"delayed_count": str(state.delayed_count)})
    if hf_config is not None:
        files[HF_CONFIG_PATH] = json.dumps(hf_config, indent=2).encode()
        size = sum(t.numel() * t.element_size() for t in weights.values())
        index = {"metadata": {"total_size": size}, "weight_map": dict.fromkeys(weights, GLOBAL_WEIGHTS_PATH)}
        files[HF_INDEX_PATH] = json.dumps(index, indent=1).encode()
    return files, common


def ledger_blob(common: dict, rows: list[dict]) -> bytes:
    """global/ledger.json: every processed delta, under the outer step and SHA-256 of the global beside it."""
    return json.dumps(common | {"format_version": "1", "entries": rows}, separators=(",", ":")).encode()


def lease_blob(
    master: str, instance: str, heartbeat: float, lease_seconds: float, outer_step: int, released: bool
):
    """global/master_lease.json: who holds the repository (node id and process instance) and since when."""
    lease = {"master": master, "instance": instance, "heartbeat": heartbeat, "lease_seconds": lease_seconds}
    return json.dumps(
        lease | {"heartbeat_utc": utc_now(), "outer_step": outer_step, "released": released}
    ).encode()


def garbage(processed: dict[str, tuple[str, int]], keep: int) -> list[str]:
    """Processed deltas (path -> node, local step) beyond the `keep` most recent of each node (0: none)."""
    if keep <= 0:
        return []
    by_node: dict[str, list[tuple[int, str]]] = {}
    for path, (node, step) in processed.items():
        by_node.setdefault(node, []).append((step, path))
    return sorted(p for items in by_node.values() for _, p in sorted(items, reverse=True)[keep:])


@dataclass
class Cadence:
    """When the master's small writes between publications are due, from when each was last written
    (monotonic seconds): the lease when none renewed it for lease_seconds / 3; the ledger when rejections
    wait for it (`ledger_dirty`), riding with the lease when there is one, else at most once per
    `ledger_every_s`. A publication carries both, so it counts as either write."""

    lease_seconds: float
    ledger_every_s: float = LEDGER_EVERY_S
    clock: Callable[[], float] = time.monotonic
    last_lease: float = -math.inf
    last_ledger: float = -math.inf
    ledger_dirty: bool = False  # rejections not yet in a published ledger

    def lease_due(self, final: bool = False) -> bool:
        if self.lease_seconds <= 0:
            return False
        return final or self.clock() - self.last_lease >= self.lease_seconds / 3

    def ledger_due(self, final: bool, with_lease: bool) -> bool:
        """`with_lease`: this write holds the lease (with a lease, the ledger writes only beside it)."""
        if final:
            return True
        if self.lease_seconds > 0:
            return self.ledger_dirty and with_lease
        return self.ledger_dirty and self.clock() - self.last_ledger >= self.ledger_every_s

    def wrote(self, files: dict[str, bytes]) -> None:
        if LEASE_PATH in files:
            self.last_lease = self.clock()
        if GLOBAL_LEDGER_PATH in files:
            self.ledger_dirty, self.last_ledger = False, self.clock()


@dataclass(eq=False)
class Publisher:
    """The master's writes to the repository and what it knows of them: steps 7 and 8 (`publish`), the small
    writes between publications (`heartbeat`), the single-master lease and fencing. It owns what the
    repository holds from this master (`published_step`, `published_sha256`), whether the last publication
    failed (`unpublished`, retried before the next round), `fenced` (another process holds the lease) and
    `dead` (a refused token). It reads `state` under `lock`, the outer loop's lock."""

    transport: Transport
    state: MasterState
    lock: threading.Lock
    _: KW_ONLY
    node_id: str
    outer: dict  # outer_lr, outer_momentum and init_sha256, for step_count.json
    publish_state: bool = True  # the ledger and outer momentum beside the global
    hf_config: dict | None = None  # the model's transformers config, written with the first publication
    keep_deltas: int = 0  # processed deltas kept per node (0: keep all)
    lease_seconds: float = 0.0  # 0: no lease
    wall_clock: Callable[[], float] = time.time
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)  # this process, in the lease
    published_step: int = -1  # the global in the repository, as this master published or found it
    published_sha256: str = ""

    def __post_init__(self):
        self.cadence = Cadence(self.lease_seconds)  # when the lease and the ledger are due between rounds
        self.unpublished = False  # the last publication failed: the outer loop retries it
        self.fenced = ""  # non-empty: another master holds the lease; this one no longer publishes
        self.dead = ""  # non-empty: a write was refused for good (PermanentError)
        self.errors = 0  # failed publications
        self.bytes_uploaded = 0
        self._hf_config_written = False

    def publish(
        self, applied: Iterable[LedgerEntry], processed: dict[str, tuple[str, int]]
    ) -> list[str] | None:
        """Steps 7 and 8 in one write: the full global weights and global/step_count.json; past the spec,
        in the same write, the ledger and outer momentum (`publish_state`), the lease, and the deletion of
        `processed` deltas (path -> node, local step) beyond `keep_deltas` per node. Returns the deleted
        paths, or None when nothing was written (fenced, or the write failed: `unpublished`)."""
        if self._fenced_before_write():
            log.error("master: not publishing: %s", self.fenced)
            return None
        hf_config = None if self._hf_config_written else self.hf_config
        with self.lock:
            files, common = global_files(
                self.state, self.node_id, self.outer, applied, self.publish_state, hf_config
            )
        if self.lease_seconds > 0:
            files[LEASE_PATH] = self.lease_blob()
        delete = self._write_global(files, garbage(processed, self.keep_deltas), common["outer_step"])
        if delete is None:
            return None
        self.published_step, self.published_sha256 = common["outer_step"], common["global_sha256"]
        self.cadence.wrote(files)
        self._hf_config_written = self._hf_config_written or HF_CONFIG_PATH in files
        self.bytes_uploaded += sum(len(b) for b in files.values())
        if delete:
            log.info(
                f"master: garbage-collected {len(delete)} processed delta(s), keep_deltas={self.keep_deltas}"
            )
        return delete

    def _write_global(self, files: dict[str, bytes], delete: list[str], outer_step: int) -> list[str] | None:
        """One publication's write (without garbage collection if a delta to collect is gone already:
        another master, a user); the paths deleted, or None when it failed."""
        message = f"{self.node_id}: global outer step {outer_step}"
        try:
            try:
                self.transport.write(files, delete, message=message)
            except TransportError:
                if not delete:
                    raise
                delete = []
                self.transport.write(files, message=message)
        except TransportError as err:
            self.unpublished, self.dead = True, self.dead or why_permanent(err)
            self.errors += 1
            log.error(f"master: publishing outer step {outer_step} failed ({err}); retrying at the next poll")
            return None
        self.unpublished = False
        return delete

    def rejected(self) -> None:
        """Rejections the published ledger does not hold yet: the next heartbeat writes it."""
        self.cadence.ledger_dirty = True

    # ---- the single-master lease (past the spec; recovery.py reads it) and the small writes between rounds

    def lease_blob(self, released: bool = False) -> bytes:
        now, step = self.wall_clock(), self.state.outer_step
        return lease_blob(self.node_id, self.instance, now, self.lease_seconds, step, released)

    def _fenced_before_write(self) -> bool:
        """Fencing: before every write, the lease must still name this process (its instance token), else
        another master took over (even one with this node id) and this one stops publishing for good. A
        transport error while reading it: not fenced (the write itself will fail or go through)."""
        if self.lease_seconds <= 0 or self.fenced:
            return bool(self.fenced)
        with contextlib.suppress(TransportError):
            lease = read_lease(self.transport)
            if lease is not None and lease.get("instance") != self.instance:
                age = self.wall_clock() - float(lease.get("heartbeat") or 0)
                self.fenced = (
                    f"master {lease.get('master')!r} (another process) holds the lease of this repository "
                    f"(heartbeat {age:.0f}s ago); this master stops publishing"
                )
                log.error("master %s: %s", self.node_id, self.fenced)
        return bool(self.fenced)

    def heartbeat(self, final: bool = False) -> None:
        """One small write between publications: the lease when no publication renewed it for
        lease_seconds/3, and the ledger when rejections since the last publication are waiting: with a
        lease, in that same write (no commit of its own: docs/dumb_diloco.md "Hub budget"), without one at
        most once per LEDGER_EVERY_S. `final`: both, always, with the ledger marked final and the lease
        released. Nothing once fenced."""
        files = {}
        if self.cadence.lease_due(final):
            files[LEASE_PATH] = self.lease_blob(released=final)
        current = not self.unpublished and self.published_step == self.state.outer_step
        due = self.cadence.ledger_due(final, with_lease=LEASE_PATH in files)
        if self.publish_state and current and self.published_sha256 and due:
            with self.lock:
                rows = self.state.ledger.to_json()
            common = {"outer_step": self.published_step, "created_at": utc_now(), "master": self.node_id}
            common["global_sha256"] = self.published_sha256
            files[GLOBAL_LEDGER_PATH] = ledger_blob(common | {"final": final}, rows)
        if not files or self._fenced_before_write():
            return
        what = "the final ledger and lease" if final else " and ".join(p.split("/")[-1] for p in files)
        try:
            self.transport.write(files, message=f"{self.node_id}: {what}")
            self.cadence.wrote(files)
        except TransportError as err:
            self.dead = self.dead or why_permanent(err)
            log.warning("master: writing %s failed (%s); will retry", what, err)

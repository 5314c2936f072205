"""The end of a node's run (past the spec, which loses the last deltas): its final marker and what became of
its final delta (the uploader, uploader.py, sends both). A node announces itself when it
starts (nodes/<node_id>/final.json saying "running"); at its end it uploads the progress made since its
last boundary, then rewrites the marker as "finished", naming its last delta. The master (master/loop.py) keeps
aggregating until every announced node's marker names a processed delta, or drain_timeout passes; a
worker reads the published ledger until it says what became of its final delta.

Invariants: "finished" is written only after the last upload succeeded or failed for good, so it never
names a delta that may still arrive; a (re)started node replaces its old marker before it trains.
Prose: docs/dumb_diloco.md ("Guarantees").
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from ..store.transport import RemoteNotFound, Transport, TransportError
from ..wire.repo_paths import (
    GLOBAL_LEDGER_PATH,
    GLOBAL_STEP_PATH,
    LEASE_PATH,
    LEDGER_FILE_MAX_BYTES,
    final_marker_path,
    utc_now,
)
from .joiner import STEP_FILE_MAX_BYTES

log = logging.getLogger("diloco.dumb_diloco")


def write_marker(transport: Transport, node_id: str, fields: dict, what: str, otherwise: str) -> None:
    """nodes/<node_id>/final.json with `fields`; a failed write is logged (`otherwise`: what follows)."""
    marker = {"node_id": node_id} | fields | {"created_at": utc_now()}
    path = final_marker_path(node_id)
    try:
        transport.write({path: json.dumps(marker, indent=1).encode()}, message=f"{node_id}: {what}")
    except TransportError as err:
        log.warning(f"node {node_id}: writing {path} ({what}) failed ({err}); {otherwise}")


def await_final_status(
    transport: Transport,
    identity: tuple[str, int, str] | None,
    deadline: float,
    *,
    poll_interval: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> str:
    """What the master did with the final delta `identity` (node id, local step, payload SHA-256; None:
    this node uploaded none), from the published ledger (or the newest global's step_count.json):
    "applied at outer step K", "rejected: ...", "not applied: ..." once the master's final ledger or
    released lease shows it finished without it, or "unknown: ..." at `deadline` (`clock` time)."""
    if identity is None:
        return "none: this node uploaded no delta"
    while True:
        try:
            status, finished = _published_status(transport, identity)
        except TransportError as err:
            status, finished = "", False
            log.warning(f"node {identity[0]}: reading the ledger failed ({err}); will retry")
        if status:
            return status
        if finished:
            return "not applied: the master finished without it"
        remaining = deadline - clock()
        if remaining <= 0:
            return "unknown: not in the published ledger within shutdown_timeout"
        sleep(min(poll_interval, 2.0, remaining))


def _published_status(transport: Transport, identity: tuple[str, int, str]) -> tuple[str, bool]:
    """(status of `identity` in the published ledger, "" if absent; whether the master has finished)."""
    revision = transport.revision()
    try:
        ledger = json.loads(transport.read(GLOBAL_LEDGER_PATH, revision, max_bytes=LEDGER_FILE_MAX_BYTES))
    except (RemoteNotFound, ValueError, UnicodeDecodeError):
        ledger = {}
    for e in ledger.get("entries", []) if isinstance(ledger, dict) else []:
        if isinstance(e, dict) and (e.get("node_id"), e.get("local_step"), e.get("sha256")) == identity:
            reason = f": {e.get('reason')}" if e.get("reason") else ""
            return f"{e.get('status')} at outer step {e.get('outer_step')}{reason}", True
    try:  # without a published ledger (publish_master_state: false), the newest global's deltas
        info = json.loads(transport.read(GLOBAL_STEP_PATH, revision, max_bytes=STEP_FILE_MAX_BYTES))
    except (RemoteNotFound, ValueError, UnicodeDecodeError):
        info = {}
    for d in info.get("deltas", []) if isinstance(info, dict) else []:
        if isinstance(d, dict) and (d.get("node_id"), d.get("local_step"), d.get("sha256")) == identity:
            return f"applied at outer step {info.get('outer_step')}", True
    try:
        lease = json.loads(transport.read(LEASE_PATH, revision, max_bytes=2**16))
    except (RemoteNotFound, ValueError, UnicodeDecodeError):
        lease = {}
    finished = bool(isinstance(ledger, dict) and ledger.get("final"))
    return "", finished or bool(isinstance(lease, dict) and lease.get("released"))

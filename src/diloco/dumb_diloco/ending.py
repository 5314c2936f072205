"""The end of a node's run (past the spec, which loses the last deltas). A node announces itself when it
starts (nodes/<node_id>/final.json saying "running"); at its end it uploads the progress made since its
last boundary, then rewrites the marker as "finished", naming its last delta. The master (master.py) keeps
aggregating until every announced node's marker names a processed delta, or drain_timeout passes; a
worker reads the published ledger until it says what became of its final delta.

Invariants: "finished" is written only after the last upload succeeded or failed for good, so it never
names a delta that may still arrive; a (re)started node replaces its old marker before it trains.
Prose: docs/dumb_diloco.md ("Guarantees").
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

from .intake import final_marker_path
from .recovery import GLOBAL_LEDGER_PATH, LEASE_PATH, LEDGER_FILE_MAX_BYTES, utc_now
from .repo_paths import GLOBAL_STEP_PATH
from .startup import STEP_FILE_MAX_BYTES
from .transport import RemoteNotFound, TransportError

if TYPE_CHECKING:
    from .node import Node

log = logging.getLogger("diloco.dumb_diloco")


def announce(node: Node) -> None:
    """A node (re)starting: "running" in its marker, so that the master waits for it at the end (even
    before its first delta) and an earlier run's "finished" no longer counts."""
    _write_marker(node, {"state": "running"}, "running", "the master may not wait for it at the end")


def _write_marker(node: Node, fields: dict, what: str, otherwise: str) -> None:
    """nodes/<node_id>/final.json with `fields`; a failed write is logged (`otherwise`: what follows)."""
    marker = {"node_id": node.s.node_id} | fields | {"created_at": utc_now()}
    path = final_marker_path(node.s.node_id)
    try:
        node.transport.write(
            {path: json.dumps(marker, indent=1).encode()}, message=f"{node.s.node_id}: {what}"
        )
    except TransportError as err:
        log.warning(f"node {node.s.node_id}: writing {path} ({what}) failed ({err}); {otherwise}")


def send_final(node: Node, deadline: float) -> None:
    """The steps since the last boundary (and a failed upload's progress) as one last delta, then the
    marker; each wait bounded by `deadline` (node.clock time)."""
    if node.closed or not node.started:
        return
    if not wait_upload(node, deadline):
        return
    if node._steps_since_capture > 0 or node._carry is not None:
        node._dispatch(node._capture(node.local_step))
        if not wait_upload(node, deadline):
            return
    step, sha = node.last_uploaded or (-1, "")
    marker = {"state": "finished", "last_local_step": step, "last_delta_sha256": sha}
    marker |= {"local_step": node.local_step, "uploads": node.uploads}
    if node._carry is not None:
        marker["steps_never_uploaded"] = node._carry.steps
    what = f"final marker (last delta at local step {step})"
    _write_marker(node, marker, what, "the master waits for it until drain_timeout")


def wait_upload(node: Node, deadline: float) -> bool:
    """Wait for the upload in flight (if any) until `deadline`; True when none is in flight any more."""
    if node._upload is not None:
        wait_futures([node._upload[1]], max(0.0, deadline - node.clock()))
    node._collect_lanes()
    if node.uploading:
        job = node._upload[0]
        log.warning(
            f"node {node.s.node_id}: {job.path} ({job.steps} step(s)) was still uploading after "
            f"shutdown_timeout {node.s.shutdown_timeout:g}s; leaving it (it may not arrive)"
        )
    return not node.uploading


def await_final_status(node: Node, deadline: float) -> str:
    """What the master did with this node's final delta, from the published ledger (or the newest global's
    step_count.json): "applied at outer step K", "rejected: ...", "not applied: ..." once the master's final
    ledger or released lease shows it finished without it, or "unknown: ..." at `deadline`."""
    if node.last_uploaded is None:
        return "none: this node uploaded no delta"
    identity = (node.s.node_id, *node.last_uploaded)
    while True:
        try:
            status, finished = _published_status(node, identity)
        except TransportError as err:
            status, finished = "", False
            log.warning(f"node {node.s.node_id}: reading the ledger failed ({err}); will retry")
        if status:
            return status
        if finished:
            return "not applied: the master finished without it"
        if (remaining := deadline - node.clock()) <= 0:
            return "unknown: not in the published ledger within shutdown_timeout"
        node.sleep(min(node.s.poll_interval, 2.0, remaining))


def _published_status(node: Node, identity: tuple[str, int, str]) -> tuple[str, bool]:
    """(status of `identity` in the published ledger, "" if absent; whether the master has finished)."""
    revision = node.transport.revision()
    try:
        ledger = json.loads(
            node.transport.read(GLOBAL_LEDGER_PATH, revision, max_bytes=LEDGER_FILE_MAX_BYTES)
        )
    except (RemoteNotFound, ValueError, UnicodeDecodeError):
        ledger = {}
    for e in ledger.get("entries", []) if isinstance(ledger, dict) else []:
        if isinstance(e, dict) and (e.get("node_id"), e.get("local_step"), e.get("sha256")) == identity:
            reason = f": {e.get('reason')}" if e.get("reason") else ""
            return f"{e.get('status')} at outer step {e.get('outer_step')}{reason}", True
    try:  # without a published ledger (publish_master_state: false), the newest global's deltas
        info = json.loads(node.transport.read(GLOBAL_STEP_PATH, revision, max_bytes=STEP_FILE_MAX_BYTES))
    except (RemoteNotFound, ValueError, UnicodeDecodeError):
        info = {}
    for d in info.get("deltas", []) if isinstance(info, dict) else []:
        if isinstance(d, dict) and (d.get("node_id"), d.get("local_step"), d.get("sha256")) == identity:
            return f"applied at outer step {info.get('outer_step')}", True
    try:
        lease = json.loads(node.transport.read(LEASE_PATH, revision, max_bytes=2**16))
    except (RemoteNotFound, ValueError, UnicodeDecodeError):
        lease = {}
    finished = bool(isinstance(ledger, dict) and ledger.get("final"))
    return "", finished or bool(isinstance(lease, dict) and lease.get("released"))

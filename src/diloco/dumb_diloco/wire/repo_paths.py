"""Where DumbDiLoCo's files live in a repository: the global's paths, nodes/<node_id>/delta_<n>.safetensors.

Invariants: a node id is one path-safe component (no '/', '..', whitespace or control characters), so a
delta's path never leaves nodes/<node_id>/; `parse_delta_path` is None for anything else.
Layout: docs/dumb_diloco.md ("Repository layout").
"""

from __future__ import annotations

import contextlib
import re
from datetime import datetime, timezone

GLOBAL_WEIGHTS_PATH = "global/latest.safetensors"
GLOBAL_STEP_PATH = "global/step_count.json"
NODES_DIR = "nodes"

_NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_DELTA_NAME_RE = re.compile(r"^delta_(0|[1-9][0-9]*)\.safetensors$")


def validate_node_id(node_id: str) -> str:
    """Return `node_id` if it is a safe path component, else raise ValueError (one line)."""
    if not isinstance(node_id, str) or not node_id:
        raise ValueError("node_id must be a non-empty string")
    if len(node_id) > 64:
        raise ValueError(f"node_id is {len(node_id)} characters long; at most 64 are allowed")
    if ".." in node_id:
        raise ValueError(f"node_id {node_id!r} contains '..'")
    if not _NODE_ID_RE.fullmatch(node_id):
        raise ValueError(
            f"node_id {node_id!r} is not path-safe: use letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no '/', whitespace or control characters)"
        )
    return node_id


def delta_path(node_id: str, local_step: int) -> str:
    """`nodes/<node_id>/delta_<local_step>.safetensors`."""
    validate_node_id(node_id)
    if isinstance(local_step, bool) or not isinstance(local_step, int) or local_step < 0:
        raise ValueError(f"local_step must be an int >= 0, got {local_step!r}")
    return f"{NODES_DIR}/{node_id}/delta_{local_step}.safetensors"


def parse_delta_path(path: str) -> tuple[str, int] | None:
    """(node_id, local_step) for a delta path, None for anything else."""
    parts = path.split("/")
    m = _DELTA_NAME_RE.fullmatch(parts[2]) if len(parts) == 3 and parts[0] == NODES_DIR else None
    with contextlib.suppress(ValueError):
        return (validate_node_id(parts[1]), int(m.group(1))) if m else None
    return None


# past the spec: published in the same transport write (one Hub commit) as the global weights
GLOBAL_LEDGER_PATH = "global/ledger.json"  # the processed-delta ledger, outer step, global_sha256
GLOBAL_MOMENTUM_PATH = "global/outer_momentum.safetensors"  # momentum (+ delayed-Nesterov accumulator)
LEASE_PATH = "global/master_lease.json"  # single-master lease: master id + heartbeat time
LEDGER_FILE_MAX_BYTES = 256 * 2**20
FINAL_MARKER = (
    "final.json"  # nodes/<node_id>/final.json: the node's last delta, written after it (not the spec)
)


def final_marker_path(node_id: str) -> str:
    return f"{NODES_DIR}/{node_id}/{FINAL_MARKER}"


def marker_node(path: str) -> str | None:
    """The node id of a final marker's path (nodes/<node_id>/final.json); None for any other path."""
    parts = path.split("/")
    return parts[1] if len(parts) == 3 and parts[2] == FINAL_MARKER and is_node_id(parts[1]) else None


def announced_nodes(transport, revision: str) -> set[str]:
    """The nodes that have announced themselves: those with a final marker (a node writes it, "running",
    when it starts). Raises what `transport.list` raises."""
    return {n for f in transport.list(NODES_DIR, revision) if (n := marker_node(f.path)) is not None}


def is_node_id(name: str) -> bool:
    try:
        validate_node_id(name)
        return True
    except ValueError:
        return False


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")

"""What a DumbDiLoCo master writes: the files of one publication (steps 7 and 8, one transport write:
global/latest.safetensors and global/step_count.json; past the spec the ledger, the outer momentum and the
model's transformers config beside them), the ledger on its own, and the single-master lease.

Invariants: every file of a publication names the same outer step and global SHA-256; the lease names the
process (its instance token), not only the node id. Formats: docs/dumb_diloco.md ("Repository layout").
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..store.budget import LEDGER_EVERY_S
from ..wire.repo_paths import (
    GLOBAL_LEDGER_PATH,
    GLOBAL_MOMENTUM_PATH,
    GLOBAL_STEP_PATH,
    GLOBAL_WEIGHTS_PATH,
    LEASE_PATH,
    utc_now,
)
from ..wire.tensor_format import encode, parse_header
from .recovery import LedgerEntry, MasterState

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

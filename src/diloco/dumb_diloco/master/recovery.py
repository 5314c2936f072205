"""The DumbDiLoCo master's state, in one place: the float32 global weights, the outer optimizer's
buffers and the processed-delta ledger (`MasterState`), where they are kept (the trainer checkpoint,
`<state_dir>/<node_id>/`, the ledger and momentum published beside each global), which of them a
(re)starting master trusts (`recover`), and the single-master lease.

Invariants: a saved state is readable at every instant (tensors first, then the JSON naming them);
published ledger/momentum are used only when they name the global's outer step and SHA-256; a delta
in the ledger is never applied again. Prose: docs/dumb_diloco.md ("Restarts and checkpoints").
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from diloco.outer import OuterOptimizer

from ...files import write_atomic
from ..store.transport import RemoteNotFound, Transport
from ..wire.global_state import GlobalSnapshot, is_delta_tensor
from ..wire.repo_paths import (
    GLOBAL_LEDGER_PATH,
    GLOBAL_MOMENTUM_PATH,
    LEASE_PATH,
    LEDGER_FILE_MAX_BYTES,
    utc_now,
)
from ..wire.tensor_format import TORCH_DTYPES, InvalidTensorFile, decode, encode

log = logging.getLogger("diloco.dumb_diloco")

STATE_FORMAT = 1
_TENSORS = ("weights", "momentum", "delayed")  # MasterState's tensor dicts, "<kind>/<name>" in files


def as_float32(t: torch.Tensor) -> torch.Tensor:
    """The float32 form the outer loop works on: complex entries as view_as_real (shape [..., 2])."""
    t = t.detach()
    return (torch.view_as_real(t) if t.is_complex() else t).to("cpu", torch.float32, copy=True)


def from_float32(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Back to the model's dtype (inverse of `as_float32`); always a copy, snapshots never alias."""
    if dtype.is_complex:
        return torch.view_as_complex(t.contiguous()).to(dtype, copy=True)
    return t.to(dtype, copy=True)


_DTYPES_BY_NAME = {str(d).removeprefix("torch."): d for d in TORCH_DTYPES.values()}  # what a state file holds


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = _DTYPES_BY_NAME.get(name.removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


# --------------------------------------------------------------------------- ledger


@dataclass(frozen=True)
class LedgerEntry:
    """What the master did with one delta (identity = node_id, local_step, sha256)."""

    node_id: str
    local_step: int
    sha256: str
    # "applied" | "rejected" | "duplicate" (the payload of an applied delta, again) | "preexisting" (in the
    # repository before this master had any state)
    status: str
    outer_step: int  # the round that applied it (applied) or that was current when it was seen
    base_outer_step: int = -1  # the global version the node's baseline came from (-1: unknown)
    reason: str = ""
    # outer steps the master had taken since the delta's base when it applied (or rejected) it; -1: unknown
    staleness: int = -1
    step_micros: int = 0  # the node's busy microseconds per step, from the delta's header (0: not sent)

    @property
    def identity(self) -> tuple[str, int, str]:
        return (self.node_id, self.local_step, self.sha256)


class Ledger:
    """The processed-delta ledger: every identity the master has applied or rejected, in order."""

    def __init__(self, entries: Iterable[LedgerEntry] = ()):
        self._entries: dict[tuple[str, int, str], LedgerEntry] = {}
        self._applied: dict[str, LedgerEntry] = {}  # payload SHA-256 -> the entry that applied it
        self.included: dict[str, int] = {}  # node -> the newest local step of its applied deltas
        self.step_micros: dict[str, int] = {}  # node -> its busy microseconds per step, at that delta
        for e in entries:
            self.add(e)

    def __contains__(self, identity: tuple[str, int, str]) -> bool:
        return identity in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: LedgerEntry) -> None:
        self._entries.setdefault(entry.identity, entry)
        if entry.status in ("applied", "preexisting"):
            self._applied.setdefault(entry.sha256, entry)
        if entry.status == "applied":
            if entry.local_step > self.included.get(entry.node_id, -1) and entry.step_micros > 0:
                self.step_micros[entry.node_id] = entry.step_micros
            self.included[entry.node_id] = max(self.included.get(entry.node_id, -1), entry.local_step)

    def get(self, identity: tuple[str, int, str]) -> LedgerEntry | None:
        return self._entries.get(identity)

    def applied_payload(self, sha256: str) -> LedgerEntry | None:
        """The entry that applied (or found) a payload with this SHA-256, if any."""
        return self._applied.get(sha256)

    def entries(self) -> list[LedgerEntry]:
        return list(self._entries.values())

    def count(self, status: str) -> int:
        return sum(e.status == status for e in self._entries.values())

    def to_json(self) -> list[dict]:
        return [asdict(e) for e in self._entries.values()]

    @classmethod
    def from_json(cls, rows: list[dict]) -> Ledger:
        return cls(LedgerEntry(**row) for row in rows)


# --------------------------------------------------------------------------- master state


@dataclass
class MasterState:
    """Everything the outer loop owns. `weights` are float32 (complex as [..., 2]) for the entries that
    take part in deltas and the stored tensor for the others; `dtypes` are the model's, used to publish.
    The outer optimizer's buffers are kept here by tensor name between rounds."""

    outer_step: int
    weights: dict[str, torch.Tensor]
    dtypes: dict[str, torch.dtype]
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)  # outer Nesterov buffers (float32)
    ledger: Ledger = field(default_factory=Ledger)
    # delayed Nesterov (past the spec): pseudo-gradients summed since the last momentum update, and how many
    delayed: dict[str, torch.Tensor] = field(default_factory=dict)
    delayed_count: int = 0

    @classmethod
    def from_model_state(cls, state: dict[str, torch.Tensor], outer_step: int = 0) -> MasterState:
        weights = {
            k: as_float32(t) if is_delta_tensor(t) else t.detach().to("cpu", copy=True)
            for k, t in state.items()
        }
        return cls(outer_step, weights, {k: t.dtype for k, t in state.items()})

    def published(self, share: bool = False) -> dict[str, torch.Tensor]:
        """The full state_dict in the model's dtypes (what global/latest.safetensors holds). `share`: the
        state's own tensors where no conversion is needed, for a caller that only reads them under the
        lock that guards the state (encoding the global); else always copies (snapshots never alias)."""
        return {
            k: t
            if share and t.dtype == self.dtypes[k]
            else from_float32(t, self.dtypes[k])
            if self.dtypes[k].is_floating_point or self.dtypes[k].is_complex
            else t.clone()
            for k, t in self.weights.items()
        }

    def apply_outer_step(
        self,
        pseudo_grad: dict[str, torch.Tensor],
        lr: float,
        momentum: float,
        delay_period: int = 1,
        deltas: int = 1,
    ) -> None:
        """Step 6: `diloco.outer.OuterOptimizer` (torch's SGD-Nesterov; delayed Nesterov for a period > 1)
        on the float32 weights with `pseudo_grad`, the mean of `deltas` deltas, as their gradient. A fresh optimizer each round loads and
        returns its buffers by name, so the state lives in one serialisable place (outer_step: the caller)."""
        names = list(pseudo_grad)
        opt = OuterOptimizer(
            [self.weights[n] for n in names], lr=lr, momentum=momentum, delay_period=delay_period
        )
        opt.load_buffers(
            [self.momentum.get(n) for n in names], [self.delayed.get(n) for n in names], self.delayed_count
        )
        opt.step([pseudo_grad[n] for n in names], deltas)
        sums, self.delayed_count = opt.delayed_sums()
        self.momentum = {n: m for n, m in zip(names, opt.momentum_buffers()) if m is not None}
        self.delayed = {n: s for n, s in zip(names, sums) if s is not None}

    # ---- the trainer's checkpoint (torch.load(weights_only=True): tensors, dicts, lists, ints, strs)

    def _meta(self) -> dict:
        dtypes = {k: str(d) for k, d in self.dtypes.items()}
        return {
            "format": STATE_FORMAT,
            "outer_step": self.outer_step,
            "dtypes": dtypes,
            "ledger": self.ledger.to_json(),
            "delayed_count": self.delayed_count,
        }

    def _tensor_dicts(self) -> dict[str, dict[str, torch.Tensor]]:
        """The state's tensor dicts by kind (_TENSORS), "<kind>/<name>" in files."""
        return {"weights": self.weights, "momentum": self.momentum, "delayed": self.delayed}

    def to_checkpoint(self) -> dict:
        return self._meta() | {
            kind: {k: t.clone() for k, t in tensors.items()} for kind, tensors in self._tensor_dicts().items()
        }

    @classmethod
    def from_checkpoint(cls, d: dict) -> MasterState:
        return cls(
            outer_step=int(d["outer_step"]),
            weights=dict(d["weights"]),
            dtypes={k: _dtype_from_name(v) for k, v in d["dtypes"].items()},
            momentum=dict(d["momentum"]),
            ledger=Ledger.from_json(d["ledger"]),
            delayed=dict(d.get("delayed", {})),
            delayed_count=int(d.get("delayed_count", 0)),
        )

    # ---- state_dir: <dir>/master_state.json names <dir>/master_state.<outer_step>.safetensors

    def save(self, directory: Path) -> None:
        """Tensors first (a new file per outer step), then the JSON that names them (atomic rename):
        a crash at any point leaves the previous complete state readable."""
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {f"{kind}/{k}": t for kind, ts in self._tensor_dicts().items() for k, t in ts.items()}
        blob = encode(tensors, {"kind": "dumb_diloco_master_state", "outer_step": str(self.outer_step)})
        name = f"master_state.{self.outer_step:08d}.safetensors"
        write_atomic(directory / name, blob)
        meta = self._meta() | {
            "tensors": name,
            "tensors_sha256": hashlib.sha256(blob).hexdigest(),
            "saved_at": utc_now(),
        }
        write_atomic(directory / "master_state.json", json.dumps(meta, indent=1).encode())
        for old in directory.glob("master_state.*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)

    @classmethod
    def load(cls, directory: Path) -> MasterState | None:
        """The saved state, None if there is none; ValueError if it exists but is unreadable."""
        path = directory / "master_state.json"
        if not path.exists():
            return None
        meta = json.loads(path.read_text())
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"{path}: unknown master state format {meta.get('format')!r}")
        blob = (directory / meta["tensors"]).read_bytes()
        if hashlib.sha256(blob).hexdigest() != meta["tensors_sha256"]:
            raise ValueError(f"{directory / meta['tensors']}: SHA-256 does not match {path}")
        tensors, _ = decode(blob, max_bytes=len(blob), require_finite=False)
        return cls.from_checkpoint(meta | {kind: _strip(tensors, kind) for kind in _TENSORS})


def _strip(tensors: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(f"{kind}/"): t for k, t in tensors.items() if k.startswith(f"{kind}/")}


# --------------------------------------------------------------------------- which state a master trusts


def recover(
    local: MasterState | None,
    checkpoint: MasterState | None,
    repo: GlobalSnapshot | None,
    step_info: dict,
    published: Callable[[int], PublishedState | None],
    model_state: dict[str, torch.Tensor],
    corrupt_step: int = -1,
) -> tuple[MasterState, bool, bool]:
    """The state a starting master continues from, whether to publish it, and whether it adopted the
    repository without any record of it (its deltas are then treated as already processed):

    1. the newer of `state_dir` (`local`) and the trainer checkpoint, if at least as new as the repository;
    2. else the repository's global with the ledger and momentum published with it (an exact takeover);
    3. else the repository's global with the local momentum and ledger, plus the round of step_count.json;
    4. no global in the repository: 1, or the model's weights, above a corrupt global's step (`corrupt_step`).
    """
    chosen = max((s for s in (local, checkpoint) if s is not None), key=lambda s: s.outer_step, default=None)
    if repo is None:
        state = chosen or MasterState.from_model_state(model_state, outer_step=0)
        state.outer_step = max(state.outer_step, corrupt_step + 1)  # readers only install newer steps
        return state, True, False
    if chosen is not None and chosen.outer_step >= repo.outer_step:
        return chosen, chosen.outer_step > repo.outer_step, False
    state = MasterState.from_model_state(repo.state, repo.outer_step)
    if (pub := published(repo.outer_step)) is not None:
        state.ledger, state.momentum = pub.ledger, pub.momentum
        state.delayed, state.delayed_count = pub.delayed, pub.delayed_count
        log.warning(
            "master: continuing from the repository at outer step %d with its published ledger (%d entries) "
            "and momentum%s",
            repo.outer_step,
            len(state.ledger),
            f" (local state was at outer step {chosen.outer_step})" if chosen is not None else "",
        )
        return state, False, False
    if chosen is not None:
        log.warning(
            "master: local state is at outer step %d but the repository is at %d; adopting the "
            "repository's weights (momentum and ledger kept)",
            chosen.outer_step,
            repo.outer_step,
        )
        state.momentum, state.ledger = chosen.momentum, chosen.ledger
    for d in step_info.get("deltas", []):  # the round we have no record of
        state.ledger.add(
            LedgerEntry(
                d["node_id"],
                int(d["local_step"]),
                d["sha256"],
                "applied",
                repo.outer_step,
                int(d.get("base_outer_step", -1)),
            )
        )
    return state, False, chosen is None


@dataclass
class PublishedState:
    ledger: Ledger
    momentum: dict[str, torch.Tensor]
    delayed: dict[str, torch.Tensor]
    delayed_count: int


def load_published_state(
    transport: Transport, outer_step: int, global_sha256: str, max_file_bytes: int
) -> PublishedState | None:
    """The ledger and outer momentum published with global `outer_step` (both must name that step and
    that global's SHA-256, i.e. come from the same publication); None if absent or not matching."""
    try:
        revision = transport.revision()
        raw = transport.read(GLOBAL_LEDGER_PATH, revision, max_bytes=LEDGER_FILE_MAX_BYTES)
        blob = transport.read(GLOBAL_MOMENTUM_PATH, revision, max_bytes=max_file_bytes)
    except RemoteNotFound:
        return None
    try:
        ledger = json.loads(raw)
        tensors, meta = decode(blob, max_bytes=max_file_bytes)
        for what, step, sha in (
            (GLOBAL_LEDGER_PATH, ledger.get("outer_step"), ledger.get("global_sha256")),
            (GLOBAL_MOMENTUM_PATH, meta.get("outer_step"), meta.get("global_sha256")),
        ):
            if str(step) != str(outer_step) or sha != global_sha256:
                log.warning("master: %s is of another publication (outer step %s); not using it", what, step)
                return None
        return PublishedState(
            Ledger.from_json(ledger["entries"]),
            _strip(tensors, "momentum"),
            _strip(tensors, "delayed"),
            int(meta.get("delayed_count", "0")),
        )
    except (ValueError, KeyError, TypeError, InvalidTensorFile) as err:
        log.warning("master: the published ledger/momentum is unreadable (%s); not using it", err)
        return None


# --------------------------------------------------------------------------- the single-master lease


def read_lease(transport: Transport, revision: str | None = None) -> dict | None:
    """The lease file (master id, instance, heartbeat time), None if there is none or it is unreadable."""
    try:
        lease = json.loads(transport.read(LEASE_PATH, revision, max_bytes=2**16))
    except RemoteNotFound:
        return None
    except (ValueError, UnicodeDecodeError):
        log.warning("master: %s is unreadable; treating the repository as unleased", LEASE_PATH)
        return None
    return lease if isinstance(lease, dict) else None


def lease_holder(
    lease: dict | None, instance: str, lease_seconds: float, now: float
) -> tuple[str, float] | None:
    """(holder, heartbeat age in s) if another master process holds a fresh lease, else None. A process is
    its `instance` token (fencing): a second process with the same node id is another holder. A lease
    counts as fresh for the longer of the holder's lease_seconds and the reader's; a released one never."""
    if lease is None or lease.get("instance") == instance or lease.get("released"):
        return None
    try:
        age = now - float(lease.get("heartbeat", 0))
        held_for = max(float(lease.get("lease_seconds") or 0), lease_seconds)
    except (TypeError, ValueError):
        return None
    return (str(lease.get("master")), age) if age < held_for else None

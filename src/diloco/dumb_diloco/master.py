"""The DumbDiLoCo master: the outer loop (spec "Outer-loop lifecycle") in a background daemon thread.

Every `poll_interval` seconds `OuterLoop.run_once` does one poll, the spec's ten steps::

    1. list remote delta paths          nodes/<node_id>/delta_<local_step>.safetensors
    2. download candidates              the header first (it carries the delta's identity), then the file
    3. skip processed identities        identity = (node_id, local_step, payload_sha256), kept in the Ledger
    4. validate                         keys, shapes, float32, finite, SHA-256, metadata matches the path
    5. average                          every valid delta of this poll with equal weight
    6. Nesterov momentum SGD            theta <- theta - outer_lr * (g + mu * (mu * m + g)), torch.optim.SGD
    7. publish full global weights      global/latest.safetensors  } one transport write (one Hub commit),
    8. publish outer-step metadata      global/step_count.json     } so readers never see a mix of rounds
    9. save local master state          <state_dir>/<node_id>/: global weights, momentum, ledger, outer step
   10. notify the training thread       `on_snapshot(GlobalSnapshot)`; it installs at its next boundary

Past the specification (docs/dumb_diloco.md "Past the specification"; every switch defaults to the
spec): step 5 can wait for a quorum (`min_deltas_per_round`) and weight by staleness; step 6 can use
delayed Nesterov; steps 7-8 also write global/ledger.json, global/outer_momentum.safetensors and the
lease in the same write, and delete processed deltas beyond `keep_deltas` per node in it.

This is DiLoCo's outer step (arXiv 2311.08105, Alg. 1 lines 9-11) with the synchronous all-reduce
replaced by "whatever deltas arrived since the last poll". The outer thread only touches its own
float32 copy of the global model (`MasterState`), never the live model. `MasterState` and `Ledger`
are plain serialisable objects (safetensors + JSON on disk; tensors/lists/ints/strs in the trainer's
checkpoint) so a later part can publish the ledger, weight by staleness or hand the state over.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from .tensor_format import (
    GLOBAL_STEP_PATH,
    GLOBAL_WEIGHTS_PATH,
    NODES_DIR,
    DeltaMeta,
    InvalidTensorFile,
    decode,
    encode,
    is_delta_tensor,
    parse_delta_path,
    parse_header,
)
from .transport import FileTooLarge, RemoteNotFound, Transport, TransportError

log = logging.getLogger("diloco.dumb_diloco")

STATE_FORMAT = 1
HF_CONFIG_PATH = "config.json"
HF_INDEX_PATH = "model.safetensors.index.json"
STEP_FILE_MAX_BYTES = 16 * 2**20
# past the spec: published in the same transport write (one Hub commit) as the global weights
GLOBAL_LEDGER_PATH = "global/ledger.json"  # the processed-delta ledger, outer step, global_sha256
GLOBAL_MOMENTUM_PATH = "global/outer_momentum.safetensors"  # momentum (+ delayed-Nesterov accumulator)
LEASE_PATH = "global/master_lease.json"  # single-master lease: master id + heartbeat time
LEDGER_FILE_MAX_BYTES = 256 * 2**20


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- tensors of the global model


def as_float32(t: torch.Tensor) -> torch.Tensor:
    """The float32 form the outer loop works on: complex entries as view_as_real (shape [..., 2])."""
    t = t.detach()
    return (torch.view_as_real(t) if t.is_complex() else t).to("cpu", torch.float32, copy=True)


def from_float32(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Back to the model's dtype (inverse of `as_float32`)."""
    if dtype.is_complex:
        return torch.view_as_complex(t.contiguous()).to(dtype, copy=True)
    return t.to(dtype, copy=True)  # a copy even for float32: snapshots must not alias the outer state


def delta_layout(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected (shape, dtype) of every tensor of a node delta for a model with this state_dict."""
    out = {}
    for name, t in state.items():
        if is_delta_tensor(t):
            shape = (*t.shape, 2) if t.is_complex() else tuple(t.shape)
            out[name] = (shape, torch.float32)
    return out


def state_layout(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected (shape, dtype) of every tensor of the global file: the full state_dict as it is."""
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}


def _takes_part(dtype: torch.dtype) -> bool:
    """Floating and complex entries take part in deltas and outer updates; other buffers do not."""
    return dtype.is_floating_point or dtype.is_complex


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class GlobalSnapshot:
    """One version of the global model: the full state_dict in the model's dtypes (never mutated)."""

    outer_step: int
    state: dict[str, torch.Tensor]
    source: str = "repo"  # "repo" (downloaded) or "master" (this process's outer loop)
    num_peers: int = 0  # distinct nodes whose deltas made this version's round


# --------------------------------------------------------------------------- ledger


@dataclass(frozen=True)
class LedgerEntry:
    """What the master did with one delta (identity = node_id, local_step, sha256)."""

    node_id: str
    local_step: int
    sha256: str
    status: str  # "applied" | "rejected" | "preexisting" (in the repo before this master had state)
    outer_step: int  # the round that applied it (applied) or that was current when it was seen
    base_outer_step: int = -1  # the global version the node's baseline came from (-1: unknown)
    reason: str = ""
    # outer steps the master had taken since the delta's base when it applied (or rejected) it; -1: unknown
    staleness: int = -1

    @property
    def identity(self) -> tuple[str, int, str]:
        return (self.node_id, self.local_step, self.sha256)


class Ledger:
    """The processed-delta ledger: every identity the master has applied or rejected, in order."""

    def __init__(self, entries: Iterable[LedgerEntry] = ()):
        self._entries: dict[tuple[str, int, str], LedgerEntry] = {}
        for e in entries:
            self.add(e)

    def __contains__(self, identity: tuple[str, int, str]) -> bool:
        return identity in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: LedgerEntry) -> None:
        self._entries.setdefault(entry.identity, entry)

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
    take part in deltas and the stored tensor for the others; `dtypes` are the model's, used to publish."""

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

    def published(self) -> dict[str, torch.Tensor]:
        """The full state_dict in the model's dtypes (what global/latest.safetensors holds)."""
        return {
            k: from_float32(t, self.dtypes[k]) if _takes_part(self.dtypes[k]) else t.clone()
            for k, t in self.weights.items()
        }

    # ---- the trainer's checkpoint (torch.load(weights_only=True): tensors, dicts, lists, ints, strs)

    def to_checkpoint(self) -> dict:
        return {
            "format": STATE_FORMAT,
            "outer_step": self.outer_step,
            "weights": {k: t.clone() for k, t in self.weights.items()},
            "dtypes": {k: str(d) for k, d in self.dtypes.items()},
            "momentum": {k: t.clone() for k, t in self.momentum.items()},
            "ledger": self.ledger.to_json(),
            "delayed": {k: t.clone() for k, t in self.delayed.items()},
            "delayed_count": self.delayed_count,
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
        tensors = {f"weights/{k}": t for k, t in self.weights.items()}
        tensors |= {f"momentum/{k}": t for k, t in self.momentum.items()}
        tensors |= {f"delayed/{k}": t for k, t in self.delayed.items()}
        blob = encode(tensors, {"kind": "dumb_diloco_master_state", "outer_step": str(self.outer_step)})
        name = f"master_state.{self.outer_step:08d}.safetensors"
        _write_atomic(directory / name, blob)
        meta = {
            "format": STATE_FORMAT,
            "outer_step": self.outer_step,
            "tensors": name,
            "tensors_sha256": hashlib.sha256(blob).hexdigest(),
            "dtypes": {k: str(d) for k, d in self.dtypes.items()},
            "ledger": self.ledger.to_json(),
            "delayed_count": self.delayed_count,
            "saved_at": utc_now(),
        }
        _write_atomic(directory / "master_state.json", json.dumps(meta, indent=1).encode())
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
        weights = {k.removeprefix("weights/"): t for k, t in tensors.items() if k.startswith("weights/")}
        momentum = {k.removeprefix("momentum/"): t for k, t in tensors.items() if k.startswith("momentum/")}
        delayed = {k.removeprefix("delayed/"): t for k, t in tensors.items() if k.startswith("delayed/")}
        return cls(
            outer_step=int(meta["outer_step"]),
            weights=weights,
            dtypes={k: _dtype_from_name(v) for k, v in meta["dtypes"].items()},
            momentum=momentum,
            ledger=Ledger.from_json(meta["ledger"]),
            delayed=delayed,
            delayed_count=int(meta.get("delayed_count", 0)),
        )


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def nesterov_outer_step(
    state: MasterState, pseudo_grad: dict[str, torch.Tensor], lr: float, momentum: float
) -> None:
    """Step 6: torch.optim.SGD(nesterov=True) on the float32 global copy with `pseudo_grad` as .grad,
    the momentum buffers carried in `state.momentum` (a fresh optimizer object each round, so the state
    lives in one serialisable place)."""
    names = list(pseudo_grad)
    params = [state.weights[n] for n in names]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)
    for n, p in zip(names, params):
        p.grad = pseudo_grad[n]
        if momentum > 0 and n in state.momentum:
            opt.state[p]["momentum_buffer"] = state.momentum[n]
    opt.step()
    for n, p in zip(names, params):
        if momentum > 0:
            state.momentum[n] = opt.state[p]["momentum_buffer"]
        p.grad = None


def delayed_nesterov_outer_step(
    state: MasterState, pseudo_grad: dict[str, torch.Tensor], lr: float, momentum: float, period: int
) -> None:
    """Step 6 with delayed Nesterov (past the spec; Asynchronous Local-SGD, arXiv 2401.09135): the
    momentum buffer changes only every `period`-th outer step, from the mean of the pseudo-gradients
    since its last change; in between each step is plain SGD on its own pseudo-gradient g:

        every step:          a <- a + g,  k <- k + 1
        k < period:          theta <- theta - lr * g
        k == period:         m <- mu * m + a / period;  theta <- theta - lr * (g + mu * m);  a <- 0, k <- 0

    With period 1 this is exactly `nesterov_outer_step` (torch's SGD, nesterov=True)."""
    state.delayed_count += 1
    for n, g in pseudo_grad.items():
        if n in state.delayed:
            state.delayed[n].add_(g)
        else:
            state.delayed[n] = g.clone()
    if state.delayed_count < period:
        for n, g in pseudo_grad.items():
            state.weights[n].sub_(g, alpha=lr)
        return
    for n, g in pseudo_grad.items():
        m = state.momentum.get(n)
        m = torch.zeros_like(g) if m is None else m
        state.momentum[n] = m.mul_(momentum).add_(state.delayed[n], alpha=1.0 / period)
        state.weights[n].sub_(g + momentum * m, alpha=lr)
    state.delayed.clear()
    state.delayed_count = 0


# --------------------------------------------------------------------------- the outer loop


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


@dataclass
class RoundResult:
    """What one poll did (returned by `run_once`; the thread logs it)."""

    outer_step: int
    applied: list[LedgerEntry] = field(default_factory=list)
    rejected: list[LedgerEntry] = field(default_factory=list)
    published: bool = False
    pseudo_grad_norm: float = 0.0
    seconds: float = 0.0

    @property
    def num_peers(self) -> int:
        return len({e.node_id for e in self.applied})


class OuterLoop:
    """Steps 1-10 of the outer loop over a `Transport`; `start()` runs them in a daemon thread."""

    def __init__(
        self,
        transport: Transport,
        state: MasterState,
        *,
        node_id: str,
        collaborators: Iterable[str] = (),
        outer_lr: float,
        outer_momentum: float,
        poll_interval: float,
        state_dir: Path | None,
        max_file_bytes: int,
        on_snapshot: Callable[[GlobalSnapshot], None] = lambda snapshot: None,
        hf_config: dict | None = None,
        min_deltas_per_round: int = 0,
        staleness_weighting: bool = False,
        delayed_nesterov_period: int = 0,
        publish_state: bool = True,
        keep_deltas: int = 0,
        lease_seconds: float = 0.0,
        wall_clock: Callable[[], float] = time.time,
        init_sha256: str | None = None,
    ):
        self.transport, self.state = transport, state
        self.node_id = node_id
        self.init_sha256 = init_sha256  # the master's initial weights, published for workers to compare
        self.allowed = frozenset(collaborators) | {node_id} if collaborators else None  # None: every node
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.poll_interval, self.state_dir, self.max_file_bytes = poll_interval, state_dir, max_file_bytes
        self.on_snapshot = on_snapshot
        self.hf_config = hf_config
        # quorum (past the spec): keep validated deltas pending until this many are there (0: the spec, >= 1)
        self.min_deltas_per_round = min_deltas_per_round
        self._pending: dict[tuple[str, int, str], tuple[Candidate, dict[str, torch.Tensor]]] = {}
        self.staleness_weighting = staleness_weighting  # weight 1/(1+staleness), normalised (False: equal)
        self.delayed_nesterov_period = delayed_nesterov_period  # 0: Nesterov SGD every step (the spec)
        self.publish_state = publish_state  # ledger + momentum beside the global, in the same write
        self.keep_deltas = keep_deltas  # GC: processed deltas kept per node (0: keep all, the spec)
        self._processed_paths: dict[str, tuple[str, int]] = {}  # path -> (node, step): processed, in the repo
        self.lease_seconds, self.wall_clock = lease_seconds, wall_clock  # 0: no lease (the spec)
        self._last_lease_write = -math.inf
        self.fenced = ""  # non-empty: another master holds the lease; this one no longer publishes
        self._delta_layout = delta_layout(state.published())
        self.lock = threading.Lock()  # guards `state` against checkpointing from the training thread
        self._ignored_nodes: set[str] = set()
        self._headers: dict[tuple[str, str], Candidate] = {}  # (path, version) -> identity from its header
        self._transient = False  # this round skipped something after a transport error (retried next poll)
        self._refused: list[tuple[str, int, str, str]] = []  # (node, step, tag, reason) from the last listing
        self._unpublished = False  # the last round's publication failed: retry before the next round
        self._hf_config_written = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._drain_seconds = 0.0
        self._last_new_delta = time.monotonic()
        # metrics (read by the training thread)
        self.rounds = 0
        self.deltas_accepted = 0
        self.deltas_rejected = 0
        self.last_num_peers = 0
        self.last_pseudo_grad_norm = 0.0
        self.errors = 0
        self.bytes_downloaded = 0
        self.bytes_uploaded = 0

    def mark_existing_as_processed(self) -> int:
        """Put every delta now in the repository into the ledger as "preexisting" (a master adopting a
        repository without its own state cannot know which were applied; re-applying them would be worse)."""
        revision = self.transport.revision()
        n = 0
        for f in self._list_deltas(revision):
            c = self._candidate(f, revision)
            if c is not None and c.identity not in self.state.ledger:
                base = c.meta.base_outer_step if c.meta else -1
                self.state.ledger.add(
                    LedgerEntry(c.node_id, c.local_step, c.sha256, "preexisting", self.state.outer_step, base)
                )
                n += 1
        return n

    # ---- one poll: the ten steps

    def run_once(self, flush: bool = False) -> RoundResult:
        """One poll. With `min_deltas_per_round` N > 0 valid deltas wait (in memory, not in the ledger)
        until N are pending; `flush` (shutdown) applies the pending ones even below N."""
        start = time.perf_counter()
        self._transient = False
        if self._unpublished:
            self.publish()
        revision = self.transport.revision()
        listed = self._list_deltas(revision)  # 1
        live = {(f.path, getattr(f, "version", "")) for f in listed}
        self._headers = {k: c for k, c in self._headers.items() if k in live}  # forget deleted/replaced files
        candidates = [self._candidate(f, revision) for f in listed]  # 2 (headers: the identities)
        self._processed_paths = {c.path: (c.node_id, c.local_step) for c in candidates
                                 if c is not None and c.identity in self.state.ledger}  # fmt: skip
        candidates = [c for c in candidates if c is not None and self._is_new(c.identity)]  # 3
        if candidates:
            self._last_new_delta = time.monotonic()
        result = RoundResult(outer_step=self.state.outer_step)
        self._reject_refused(result)
        for c in candidates:
            tensors = self._download_and_validate(c, revision)  # 2 (payload) + 4
            if isinstance(tensors, str):
                base = c.meta.base_outer_step if c.meta else -1
                entry = LedgerEntry(c.node_id, c.local_step, c.sha256, "rejected", self.state.outer_step,
                                    base, tensors, self._staleness(base))  # fmt: skip
                result.rejected.append(entry)
                self._processed_paths[c.path] = (c.node_id, c.local_step)
                log.warning("master: rejected delta %s: %s", c.path, tensors)
            elif tensors is not None:
                self._pending[c.identity] = (c, tensors)
        valid = self._take_round(flush)
        with self.lock:
            for entry in result.rejected:
                self.state.ledger.add(entry)
            self.deltas_rejected += len(result.rejected)
            if valid:
                mean = _average([t for _, t in valid], self._weights(valid))  # 5
                result.pseudo_grad_norm = math.sqrt(
                    sum(float(g.double().square().sum()) for g in mean.values())
                )
                self._outer_step(mean)  # 6
                for c, _ in valid:
                    assert c.meta is not None
                    base = c.meta.base_outer_step
                    entry = LedgerEntry(c.node_id, c.local_step, c.sha256, "applied", self.state.outer_step + 1,
                                        base, staleness=self._staleness(base))  # fmt: skip
                    self.state.ledger.add(entry)
                    result.applied.append(entry)
                self.state.outer_step += 1
                result.outer_step = self.state.outer_step
                self.deltas_accepted += len(valid)
                self.rounds += 1
                self.last_num_peers = result.num_peers
                self.last_pseudo_grad_norm = result.pseudo_grad_norm
        self._processed_paths |= {c.path: (c.node_id, c.local_step) for c, _ in valid}
        if valid:
            result.published = self.publish(result.applied)  # 7 + 8
        if valid or result.rejected:
            self.save_state()  # 9
        if valid:
            self.notify()  # 10
        result.seconds = time.perf_counter() - start
        if valid:
            log.info(
                "master: outer step %d from %d delta(s) of %d node(s) (%s), |pseudo_grad| %.4g, %d rejected, %.2fs",
                result.outer_step, len(result.applied), result.num_peers,
                ", ".join(f"{e.node_id}@{e.local_step}" for e in result.applied),
                result.pseudo_grad_norm, len(result.rejected), result.seconds,
            )  # fmt: skip
        return result

    def _weights(self, valid: list[tuple[Candidate, dict[str, torch.Tensor]]]) -> list[float] | None:
        """Step 5's weights: None (equal, the spec) or 1/(1+staleness) normalised to sum 1."""
        if not self.staleness_weighting:
            return None
        raw = [
            1.0 / (1 + max(0, self._staleness(c.meta.base_outer_step if c.meta else -1))) for c, _ in valid
        ]
        return [w / sum(raw) for w in raw]

    def _outer_step(self, mean: dict[str, torch.Tensor]) -> None:
        if self.delayed_nesterov_period > 0:
            delayed_nesterov_outer_step(self.state, mean, self.outer_lr, self.outer_momentum,
                                        self.delayed_nesterov_period)  # fmt: skip
        else:
            nesterov_outer_step(self.state, mean, self.outer_lr, self.outer_momentum)

    def _is_new(self, identity: tuple[str, int, str]) -> bool:
        return identity not in self.state.ledger and identity not in self._pending

    def _staleness(self, base_outer_step: int) -> int:
        """Outer steps taken since the delta's base (before this round's step); -1 if the base is unknown."""
        return max(0, self.state.outer_step - base_outer_step) if base_outer_step >= 0 else -1

    def _take_round(self, flush: bool) -> list[tuple[Candidate, dict[str, torch.Tensor]]]:
        """The deltas of this round: every pending one once the quorum is met (or on `flush`), else none."""
        quorum = max(1, self.min_deltas_per_round)
        if not self._pending or (len(self._pending) < quorum and not flush):
            if self._pending:
                log.info("master: %d delta(s) pending, waiting for %d (min_deltas_per_round)",
                         len(self._pending), quorum)  # fmt: skip
            return []
        valid = list(self._pending.values())
        self._pending.clear()
        return valid

    @property
    def pending(self) -> int:
        """Validated deltas waiting for the quorum (`min_deltas_per_round`)."""
        return len(self._pending)

    def _list_deltas(self, revision: str) -> list:
        """The delta files to consider; files refused from their path alone (past the spec: a node
        outside `collaborators`, a path-unsafe node directory) go to `self._refused` for the ledger."""
        out, self._refused = [], []
        for f in self.transport.list(NODES_DIR, revision):
            parsed = parse_delta_path(f.path)
            if parsed is None:
                self._refuse_unsafe(f.path)
                continue
            if self.allowed is not None and parsed[0] not in self.allowed:
                if parsed[0] not in self._ignored_nodes:
                    self._ignored_nodes.add(parsed[0])
                    log.warning("master: ignoring deltas of %r: not in distributed.collaborators", parsed[0])
                # identity without the payload hash: a later master with a wider list still takes the delta
                self._refused.append((parsed[0], parsed[1], "not-a-collaborator",
                                      "node is not in distributed.collaborators"))  # fmt: skip
                continue
            out.append(f)
        return out

    def _refuse_unsafe(self, path: str) -> None:
        """nodes/<dir>/delta_<n>.safetensors whose <dir> is not a valid node id (e.g. '..', spaces)."""
        parts = path.split("/")
        if len(parts) < 3 or not parts[-1].startswith("delta_") or not parts[-1].endswith(".safetensors"):
            return  # not shaped like a delta (a README, a stray file): ignored
        step = parts[-1].removeprefix("delta_").removesuffix(".safetensors")
        node = "/".join(parts[1:-1])
        self._refused.append((node, int(step) if step.isdigit() else -1, f"unsafe-path:{path}",
                              f"path-unsafe node directory {node!r} in {path}"))  # fmt: skip

    def _reject_refused(self, result: RoundResult) -> None:
        for node, step, tag, reason in self._refused:
            if (node, step, tag) not in self.state.ledger:
                entry = LedgerEntry(node, step, tag, "rejected", self.state.outer_step, reason=reason)
                result.rejected.append(entry)
                log.warning("master: rejected delta %s@%s: %s", node, step, reason)

    def _candidate(self, f, revision: str) -> Candidate | None:
        """The delta's identity from its path and header (the header only once per file version)."""
        key = (f.path, getattr(f, "version", ""))
        if key[1] and key in self._headers:
            return self._headers[key]
        c = self._read_candidate(f, revision)
        if key[1] and c is not None:
            self._headers[key] = c
        return c

    def _read_candidate(self, f, revision: str) -> Candidate | None:
        node_id, local_step = parse_delta_path(f.path)  # type: ignore[misc]
        if f.size > self.max_file_bytes:  # refused from the listing: not even its header is read
            return Candidate(f.path, node_id, local_step, f"oversized-{f.size}",
                             reason=f"file is {f.size} bytes, over the cap of {self.max_file_bytes} (max_file_bytes)")  # fmt: skip
        try:
            header = self.transport.read_header(f.path, revision)
        except InvalidTensorFile as err:  # no readable header, so no hash: identify it by its size
            return Candidate(f.path, node_id, local_step, f"unreadable-{f.size}", reason=err.reason)
        except RemoteNotFound:
            return None
        except TransportError as err:  # transient: try again next poll
            log.warning("master: cannot read the header of %s (%s); will retry", f.path, err)
            self._transient = True
            return None
        sha = header.metadata.get("payload_sha256", "")
        if not sha:
            return Candidate(
                f.path, node_id, local_step, f"no-sha-{f.size}", reason="metadata has no payload_sha256"
            )
        try:
            meta = DeltaMeta.from_header(header.metadata)
        except InvalidTensorFile as err:
            return Candidate(f.path, node_id, local_step, sha, reason=err.reason)
        return Candidate(f.path, node_id, local_step, sha, meta)

    def _download_and_validate(self, c: Candidate, revision: str) -> dict[str, torch.Tensor] | str | None:
        """The delta's tensors, a rejection reason (str), or None (transient failure: retried next poll)."""
        if c.reason:
            return c.reason
        assert c.meta is not None
        if (c.meta.node_id, c.meta.local_step) != (c.node_id, c.local_step):
            return f"metadata says {c.meta.node_id}@{c.meta.local_step} but the path says {c.node_id}@{c.local_step}"
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
            self._transient = True
            return None
        self.bytes_downloaded += len(blob)
        try:
            tensors, meta = decode(blob, max_bytes=self.max_file_bytes, expected=self._delta_layout)
        except InvalidTensorFile as err:
            return err.reason
        if meta.get("payload_sha256") != c.sha256:
            return "the file changed between its header and its download"
        return tensors

    # ---- publication, state, notification

    def publish(self, applied: Iterable[LedgerEntry] = ()) -> bool:
        """Steps 7 and 8 in one write: the full global weights and global/step_count.json; past the spec,
        in the same write, the ledger and outer momentum (`publish_state`), the lease, and the deletion
        of processed deltas beyond `keep_deltas` per node (garbage collection)."""
        if self.lease_seconds > 0 and time.monotonic() - self._last_lease_write > self.lease_seconds / 2:
            with contextlib.suppress(TransportError):
                self._check_fence()  # a long round: make sure no other master took the lease meanwhile
        if self.fenced:
            log.error("master: not publishing: %s", self.fenced)
            return False
        with self.lock:
            outer_step = self.state.outer_step
            weights = self.state.published()
            ledger_rows = self.state.ledger.to_json() if self.publish_state else []
            momentum = {f"momentum/{k}": t.clone() for k, t in self.state.momentum.items()}
            momentum |= {f"delayed/{k}": t.clone() for k, t in self.state.delayed.items()}
            delayed_count = self.state.delayed_count
        created = utc_now()
        blob = encode(weights, {"kind": "dumb_diloco_global", "outer_step": str(outer_step),
                                "created_at": created, "master": self.node_id, "format": "pt"})  # fmt: skip
        step_info = {
            "outer_step": outer_step,
            "format_version": "1",
            "created_at": created,
            "master": self.node_id,
            "global_sha256": parse_header(blob).metadata["payload_sha256"],
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            **({"init_sha256": self.init_sha256} if self.init_sha256 else {}),
            "deltas": [
                {
                    "node_id": e.node_id,
                    "local_step": e.local_step,
                    "sha256": e.sha256,
                    "base_outer_step": e.base_outer_step,
                }
                for e in applied
            ],  # fmt: skip
        }
        files = {GLOBAL_WEIGHTS_PATH: blob, GLOBAL_STEP_PATH: json.dumps(step_info, indent=1).encode()}
        if self.publish_state:
            common = {
                "outer_step": outer_step,
                "global_sha256": step_info["global_sha256"],
                "master": self.node_id,
            }
            ledger = common | {"format_version": "1", "entries": ledger_rows}
            files[GLOBAL_LEDGER_PATH] = json.dumps(ledger, separators=(",", ":")).encode()
            meta = {k: str(v) for k, v in common.items()} | {"kind": "dumb_diloco_outer_momentum",
                                                              "delayed_count": str(delayed_count)}  # fmt: skip
            files[GLOBAL_MOMENTUM_PATH] = encode(momentum, meta)
        if self.lease_seconds > 0:
            files[LEASE_PATH] = self._lease_blob()
        delete = self._garbage()
        if self.hf_config is not None and not self._hf_config_written:
            files[HF_CONFIG_PATH] = json.dumps(self.hf_config, indent=2).encode()
            index = {
                "metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
                "weight_map": {k: GLOBAL_WEIGHTS_PATH for k in weights},
            }
            files[HF_INDEX_PATH] = json.dumps(index, indent=1).encode()
        try:
            try:
                self.transport.write(files, delete, message=f"{self.node_id}: global outer step {outer_step}")
            except TransportError:
                if not delete:
                    raise
                delete = []  # a delta to collect may be gone already (another master, a user): publish without GC
                self.transport.write(files, message=f"{self.node_id}: global outer step {outer_step}")
        except TransportError as err:
            self._unpublished = True
            self.errors += 1
            log.error(
                "master: publishing outer step %d failed (%s); will retry at the next poll", outer_step, err
            )
            return False
        self._unpublished = False
        if LEASE_PATH in files:
            self._last_lease_write = time.monotonic()
        for path in delete:
            self._processed_paths.pop(path, None)
        if delete:
            log.info(
                "master: garbage-collected %d processed delta(s) (keep_deltas=%d)",
                len(delete),
                self.keep_deltas,
            )
        self._hf_config_written = self._hf_config_written or HF_CONFIG_PATH in files
        self.bytes_uploaded += sum(len(b) for b in files.values())
        return True

    def _garbage(self) -> list[str]:
        """Processed deltas (in the ledger) beyond the `keep_deltas` most recent of each node."""
        if self.keep_deltas <= 0:
            return []
        by_node: dict[str, list[tuple[int, str]]] = {}
        for path, (node, step) in self._processed_paths.items():
            by_node.setdefault(node, []).append((step, path))
        out = []
        for items in by_node.values():
            out += [path for _, path in sorted(items, reverse=True)[self.keep_deltas :]]
        return sorted(out)

    # ---- the single-master lease (past the spec)

    def _lease_blob(self) -> bytes:
        lease = {"master": self.node_id, "heartbeat": self.wall_clock(), "lease_seconds": self.lease_seconds,
                 "heartbeat_utc": utc_now(), "outer_step": self.state.outer_step}  # fmt: skip
        return json.dumps(lease).encode()

    def _check_fence(self) -> bool:
        """True (and `fenced` set) if another master holds a fresh lease. Raises TransportError."""
        other = lease_holder(self.transport, self.node_id, self.lease_seconds, self.wall_clock())
        if other is not None and not self.fenced:
            self.fenced = (f"master {other[0]!r} holds the lease of this repository (heartbeat {other[1]:.0f}s "
                           "ago); this master stops aggregating")  # fmt: skip
            log.error("master %s: %s", self.node_id, self.fenced)
        return bool(self.fenced)

    def heartbeat(self) -> None:
        """Renew the lease (a small write of its own) when no publication renewed it for lease_seconds/3;
        stop publishing (fenced) if another master holds a fresh lease."""
        if self.lease_seconds <= 0 or self.fenced:
            return
        if time.monotonic() - self._last_lease_write < self.lease_seconds / 3:
            return
        try:
            if self._check_fence():
                return
            self.transport.write({LEASE_PATH: self._lease_blob()}, message=f"{self.node_id}: lease heartbeat")
            self._last_lease_write = time.monotonic()
        except TransportError as err:
            log.warning("master: lease heartbeat failed (%s); will retry", err)

    def save_state(self) -> None:
        if self.state_dir is None:
            return
        with self.lock:
            try:
                self.state.save(self.state_dir)
            except OSError as err:
                self.errors += 1
                log.error("master: cannot save the master state to %s: %s", self.state_dir, err)

    def snapshot(self) -> GlobalSnapshot:
        with self.lock:
            return GlobalSnapshot(
                self.state.outer_step, self.state.published(), "master", self.last_num_peers
            )

    def notify(self) -> None:
        self.on_snapshot(self.snapshot())

    # ---- the daemon thread

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="dumb-diloco-outer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            self._round()
        self._last_round()  # stop() was called: one last round for the deltas that arrived meanwhile
        while time.monotonic() - self._last_new_delta < self._drain_seconds:  # draining late deltas
            time.sleep(self.poll_interval)
            self._round()
        if self._pending:  # below the quorum at the end: apply them rather than lose them
            self._last_round(flush=True)

    def _last_round(self, flush: bool = False, attempts: int = 20) -> None:
        """At shutdown, a round that a transport error cut short is tried again (up to `attempts` polls;
        `stop`'s timeout bounds it too), so the last deltas are not lost to a transient failure."""
        for _ in range(attempts):
            if self._round(flush) or self.fenced:
                return
            time.sleep(self.poll_interval)

    def _round(self, flush: bool = False) -> bool:
        """One guarded poll; True if it went through with no transport error left to retry."""
        if self.fenced:
            return False
        try:
            self.heartbeat()
            self.run_once(flush)
        except Exception as err:  # never let the outer loop die: log, count, try again next poll
            self.errors += 1
            log.exception(
                "master: outer round failed (%s); retrying in %ss", type(err).__name__, self.poll_interval
            )
            return False
        return not self._transient and not self._unpublished

    def stop(self, drain_seconds: float = 0.0, timeout: float | None = None) -> bool:
        """Run a last round (and more while deltas keep arriving within `drain_seconds`), then stop.
        Returns False if the thread was still busy after `timeout` seconds (it is a daemon)."""
        if self._thread is None:
            return True
        self._drain_seconds = drain_seconds
        self._last_new_delta = time.monotonic()
        self._stop.set()
        self._thread.join(None if timeout is None else timeout + drain_seconds)
        return not self._thread.is_alive()


def _average(
    deltas: list[dict[str, torch.Tensor]], weights: list[float] | None = None
) -> dict[str, torch.Tensor]:
    """Equal-weight mean (or the `weights`-weighted sum), accumulated in float32 in a fixed order."""
    if weights is not None:
        out = {k: t * weights[0] for k, t in deltas[0].items()}
        for d, w in zip(deltas[1:], weights[1:]):
            for k, t in d.items():
                out[k].add_(t, alpha=w)
        return out
    out = {k: t.clone() for k, t in deltas[0].items()}
    for d in deltas[1:]:
        for k, t in d.items():
            out[k].add_(t)
    for t in out.values():
        t.div_(len(deltas))
    return out


# --------------------------------------------------------------------------- published state and lease (past the spec)


def read_lease(transport: Transport) -> dict | None:
    """The lease file (master id, heartbeat time), None if there is none or it is unreadable."""
    try:
        lease = json.loads(transport.read(LEASE_PATH, max_bytes=2**16))
    except RemoteNotFound:
        return None
    except (ValueError, UnicodeDecodeError):
        log.warning("master: %s is unreadable; treating the repository as unleased", LEASE_PATH)
        return None
    return lease if isinstance(lease, dict) else None


def lease_holder(
    transport: Transport, node_id: str, lease_seconds: float, now: float
) -> tuple[str, float] | None:
    """(other master, heartbeat age in s) if another master holds a fresh lease, else None."""
    lease = read_lease(transport)
    if lease is None or lease.get("master") == node_id:
        return None
    try:
        age = now - float(lease.get("heartbeat", 0))
        held_for = max(float(lease.get("lease_seconds") or 0), lease_seconds)
    except (TypeError, ValueError):
        return None
    return (str(lease.get("master")), age) if age < held_for else None


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
        for what, step, sha in ((GLOBAL_LEDGER_PATH, ledger.get("outer_step"), ledger.get("global_sha256")),
                                (GLOBAL_MOMENTUM_PATH, meta.get("outer_step"), meta.get("global_sha256"))):  # fmt: skip
            if str(step) != str(outer_step) or sha != global_sha256:
                log.warning("master: %s is of another publication (outer step %s); not using it", what, step)
                return None
        return PublishedState(
            Ledger.from_json(ledger["entries"]),
            {k.removeprefix("momentum/"): t for k, t in tensors.items() if k.startswith("momentum/")},
            {k.removeprefix("delayed/"): t for k, t in tensors.items() if k.startswith("delayed/")},
            int(meta.get("delayed_count", "0")),
        )
    except (ValueError, KeyError, TypeError, InvalidTensorFile) as err:
        log.warning("master: the published ledger/momentum is unreadable (%s); not using it", err)
        return None

"""The DumbDiLoCo master's outer loop, a daemon thread; every `poll_interval` s `OuterLoop.run_once`:

    1. list nodes/<node_id>/delta_<local_step>.safetensors   6. the outer step (recovery.MasterState)
    2. read each header (the delta's identity), then the file  7. publish global/latest.safetensors   } one
    3. skip identities in the ledger (node, step, sha256)     8. and global/step_count.json          } write
    4. validate (keys, shapes, float32, finite, SHA-256)      9. save the state to <state_dir>/<node_id>/
    5. add each valid delta to a running sum, then average   10. hand a GlobalSnapshot to the training thread

Invariants: the thread touches only its own float32 copy (`state`, under `lock`), never the live model;
a delta is applied at most once; pending deltas (the quorum) cost one running float32 sum, not a copy
each, and only their identities are kept (a restarted master reads them again); readers never see
weights and step count of different rounds; a round that fails is logged, counted and tried again.
Past the spec (quorum, staleness weighting, delayed Nesterov, published ledger/momentum, lease, GC; the
defaults that differ from it: docs/dumb_diloco.md, "Master outer loop", "Past the specification").
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

import torch

from ..store.base import why_permanent
from ..store.transport import Transport, TransportError
from ..wire.global_state import GlobalSnapshot, delta_layout
from ..wire.repo_paths import GLOBAL_LEDGER_PATH, LEASE_PATH, utc_now
from .aggregation import RunningSum
from .intake import Candidate, Intake
from .publication import HF_CONFIG_PATH, Cadence, garbage, global_files, lease_blob, ledger_blob
from .recovery import LedgerEntry, MasterState, read_lease

log = logging.getLogger("diloco.dumb_diloco")


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


@dataclass(eq=False)
class OuterLoop:
    """Steps 1-10 of the outer loop over a `Transport`; `start()` runs them in a daemon thread. Never
    started, the loop is the caller's to drive (a lock-step simulation): each `run_once()` is one round,
    and `stop()` has no thread to stop (it runs no last round)."""

    transport: Transport
    state: MasterState
    _: KW_ONLY
    node_id: str
    outer_lr: float
    outer_momentum: float
    poll_interval: float
    state_dir: Path | None
    max_file_bytes: int
    collaborators: Iterable[str] = ()  # the nodes whose deltas count (and the master's own); (): every node
    on_snapshot: Callable[[GlobalSnapshot], None] = lambda snapshot: None
    hf_config: dict | None = None
    # past the spec, every default the spec's: a quorum of deltas per round, staleness weights
    # 1/(1+staleness), delayed Nesterov, ledger + momentum published with the global, GC, the lease
    min_deltas_per_round: int = 0
    staleness_weighting: bool = False
    delayed_nesterov_period: int = 0  # 0: Nesterov SGD every step
    publish_state: bool = True
    keep_deltas: int = 0  # processed deltas kept per node (0: keep all)
    lease_seconds: float = 0.0  # 0: no lease
    wall_clock: Callable[[], float] = time.time
    init_sha256: str | None = None  # the master's initial weights, published for workers to compare
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)  # this process, in the lease (fencing)
    published_step: int = -1  # the global in the repository, as this master published or found it
    published_sha256: str = ""

    def __post_init__(self):
        allowed = frozenset(self.collaborators) | {self.node_id} if self.collaborators else None
        self.intake = Intake(
            self.transport, delta_layout(self.state.published(share=True)), self.max_file_bytes, allowed
        )
        self._pending: dict[tuple[str, int, str], Candidate] = {}  # waiting for the quorum; summed in _sum
        self._sum, self._round_nodes = RunningSum(), None  # step 5 as the deltas arrive: their weighted sum
        self._processed_paths: dict[str, tuple[str, int]] = {}  # path -> (node, step): processed, in the repo
        self.cadence = Cadence(self.lease_seconds)  # when the lease and the ledger are due between rounds
        self.fenced = ""  # non-empty: another master holds the lease; this one no longer publishes
        self.dead = ""  # non-empty: a refused token (PermanentError): the loop stopped; the node fails
        self.lock = threading.Lock()  # guards `state` against checkpointing from the training thread
        self._unpublished = False  # the last round's publication failed: retry before the next round
        self._hf_config_written = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._drain_timeout, self._draining = 0.0, False
        self.unfinished: dict[str, str] = {}  # while draining: node -> why its final delta is not processed
        # metrics (read by the training thread)
        self.rounds = self.deltas_accepted = self.deltas_rejected = self.last_num_peers = self.errors = 0
        self.bytes_uploaded = 0
        self.last_pseudo_grad_norm, self.last_staleness = 0.0, []  # the last round's; staleness per delta

    # ---- one poll: the ten steps

    def run_once(self, flush: bool = False) -> RoundResult:
        """One poll. With `min_deltas_per_round` N > 0 valid deltas wait (in the running sum, not in the
        ledger) until N are pending; `flush` (shutdown) applies the pending ones even below N."""
        start = time.perf_counter()
        self.intake.transient = False
        if self._unpublished:
            self.publish()
        revision = self.transport.revision()
        listed = self.intake.list(revision)  # 1
        live = {(f.path, getattr(f, "version", "")) for f in listed}
        self.intake.headers = {k: c for k, c in self.intake.headers.items() if k in live}  # forget gone files
        candidates = [
            c for f in listed if (c := self.intake.candidate(f, revision)) is not None
        ]  # 2 (headers)
        ledger = self.state.ledger
        self._processed_paths = {
            c.path: (c.node_id, c.local_step) for c in candidates if c.identity in ledger
        }
        listed_all = candidates
        candidates = [
            c for c in candidates if c.identity not in ledger and c.identity not in self._pending
        ]  # 3
        result = RoundResult(outer_step=self.state.outer_step)
        seen = {c.sha256: f"{c.node_id}@{c.local_step}" for c in self._pending.values()}
        for node, step, tag, reason in self.intake.refused:
            if (node, step, tag) not in ledger:
                result.rejected.append(
                    LedgerEntry(node, step, tag, "rejected", self.state.outer_step, reason=reason)
                )
                log.warning("master: rejected delta %s@%s: %s", node, step, reason)
        self._take_in_all(candidates, result, seen, revision)
        self.intake.buffer = None  # the poll's file buffer: no model-sized bytes held between polls
        valid = self._take_round(flush, revision)
        with self.lock:
            for entry in result.rejected:
                ledger.add(entry)
            self.deltas_rejected += len(result.rejected)
            self.cadence.ledger_dirty |= bool(result.rejected)
            if valid:
                self._outer_step(valid, result)
        self._processed_paths |= {c.path: (c.node_id, c.local_step) for c in valid}
        if valid:
            result.published = self.publish(result.applied)  # 7 + 8
        if valid or result.rejected:
            self.save_state()  # 9
        if result.rejected and not valid:
            self.heartbeat()  # the rejections reach the published ledger (at most once a minute)
        if self._draining:
            self.unfinished = self.intake.unfinished(listed_all, self.state.ledger, self.node_id, revision)
        if valid:
            self.on_snapshot(self.snapshot())  # 10
            result.seconds = time.perf_counter() - start
            log.info(
                "master: outer step %d from %d delta(s) of %d node(s) (%s), |pseudo_grad| %.4g, %d rejected, "
                "%.2fs",
                *(result.outer_step, len(result.applied), result.num_peers),
                ", ".join(f"{e.node_id}@{e.local_step}" for e in result.applied),
                *(result.pseudo_grad_norm, len(result.rejected), result.seconds),
            )
        return result

    def _take_in_all(
        self, candidates: list[Candidate], result: RoundResult, seen: dict[str, str], revision: str
    ) -> None:
        """Each new candidate into the running sum, or into `result.rejected` (a duplicate of `seen`, an
        applied or pending delta's SHA-256, or a bad file); a transient failure is read again next poll."""
        for c in candidates:
            same = self.intake.duplicate_of(c, self.state.ledger, seen)
            if same is not None:  # a copy of an applied delta: never again
                result.rejected.append(c.entry("duplicate", self.state.outer_step, same))
                log.warning("master: duplicate delta %s: %s", c.path, same)
                continue
            why = self._take_in(c, revision)  # 2 (payload) + 4 + 5 (into the running sum)
            if why:
                staleness = self._staleness(c.meta.base_outer_step if c.meta else -1)
                result.rejected.append(c.entry("rejected", self.state.outer_step, why, staleness))
                self._processed_paths[c.path] = (c.node_id, c.local_step)
                log.warning("master: rejected delta %s: %s", c.path, why)
            elif why is not None:
                seen[c.sha256] = f"{c.node_id}@{c.local_step}"

    def _outer_step(self, valid: list[Candidate], result: RoundResult) -> None:
        """The round's outer step from its valid deltas (under the state lock): ledger entries, the
        step, the counters."""
        mean = self._sum.mean(self._round_nodes)  # 5: per node in a quorum round, else per delta
        result.pseudo_grad_norm = math.sqrt(  # float64 accumulation, no float64 copy
            sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in mean.values())
        )
        for c in valid:
            staleness = self._staleness(c.meta.base_outer_step)
            result.applied.append(c.entry("applied", self.state.outer_step + 1, staleness=staleness))
            self.state.ledger.add(result.applied[-1])
        period = max(1, self.delayed_nesterov_period)  # counted in deltas (arXiv 2401.09135)
        self.state.apply_outer_step(mean, self.outer_lr, self.outer_momentum, period, len(valid))  # 6
        self.state.outer_step += 1
        result.outer_step = self.state.outer_step
        self.deltas_accepted += len(valid)
        self.rounds += 1
        self.last_num_peers, self.last_pseudo_grad_norm = result.num_peers, result.pseudo_grad_norm
        self.last_staleness = [e.staleness for e in result.applied]

    def _take_in(self, c: Candidate, revision: str) -> str | None:
        """Download and validate `c` and add it to the running sum (pending): "" if it is pending, a
        rejection reason, or None (a transient failure: read again next poll). Its bytes die on return.
        Its weight: 1 (the spec) or 1/(1+staleness), normalised over the round by `RunningSum.mean`."""
        tensors = self.intake.download(c, revision)  # read-only views of the file's bytes
        if tensors is None or isinstance(tensors, str):
            return tensors
        weight = 1.0
        if self.staleness_weighting:
            weight = 1.0 / (1 + max(0, self._staleness(c.meta.base_outer_step if c.meta else -1)))
        try:
            self._sum.add(tensors, weight)
        except BaseException:  # a half-added delta (out of memory?): drop the sum; pending ones are re-read
            self._sum, self._pending = RunningSum(), {}
            raise
        self._pending[c.identity] = c
        return ""

    def _staleness(self, base_outer_step: int) -> int:
        """Outer steps taken since the delta's base (before this round's step); -1 if the base is unknown."""
        return max(0, self.state.outer_step - base_outer_step) if base_outer_step >= 0 else -1

    def _take_round(self, flush: bool, revision: str) -> list[Candidate]:
        """The deltas of this round: every pending one once deltas of `min_deltas_per_round` distinct nodes
        are pending (one fast node's two deltas do not make a quorum of two; a node that finished counts, as
        it will send no more: its marker is read only for a quorum over 1), or on `flush`; else none."""
        quorum, senders = max(1, self.min_deltas_per_round), {c.node_id for c in self._pending.values()}
        nodes = len(senders) + (len(self.intake.finished(revision) - senders) if quorum > 1 else 0)
        if not self._pending or (nodes < quorum and not flush):
            if self._pending:
                log.info(f"master: {self.pending} delta(s) of {nodes} node(s) pending, waiting for {quorum}")
            return []
        expected = quorum - nodes + len(senders)  # a flush below the quorum: the nodes still expected
        self._round_nodes = max(len(senders), expected) if self.min_deltas_per_round else None
        valid = list(self._pending.values())
        self._pending.clear()
        return valid

    @property
    def bytes_downloaded(self) -> int:
        return self.intake.bytes_downloaded

    @property
    def pending(self) -> int:
        """Validated deltas waiting for the quorum (`min_deltas_per_round`)."""
        return len(self._pending)

    @property
    def waiting(self) -> tuple[Candidate, ...]:
        """The validated deltas waiting for the quorum: their identities and headers (the sum holds the tensors)."""
        return tuple(self._pending.values())

    # ---- publication, state, notification

    def publish(self, applied: Iterable[LedgerEntry] = ()) -> bool:
        """Steps 7 and 8 in one write: the full global weights and global/step_count.json; past the spec,
        in the same write, the ledger and outer momentum (`publish_state`), the lease, and the deletion
        of processed deltas beyond `keep_deltas` per node (garbage collection)."""
        if self._fenced_before_write():
            log.error("master: not publishing: %s", self.fenced)
            return False
        outer = {
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "init_sha256": self.init_sha256,
        }
        hf_config = None if self._hf_config_written else self.hf_config
        with self.lock:
            files, common = global_files(
                self.state, self.node_id, outer, applied, self.publish_state, hf_config
            )
        outer_step = common["outer_step"]
        if self.lease_seconds > 0:
            files[LEASE_PATH] = self.lease_blob()
        delete = garbage(self._processed_paths, self.keep_deltas)
        message = f"{self.node_id}: global outer step {outer_step}"
        try:
            try:
                self.transport.write(files, delete, message=message)
            except TransportError:
                if not delete:
                    raise
                # a delta to collect may be gone already (another master, a user): publish without GC
                delete = []
                self.transport.write(files, message=message)
        except TransportError as err:
            self._unpublished, self.dead = True, self.dead or why_permanent(err)
            self.errors += 1
            log.error(f"master: publishing outer step {outer_step} failed ({err}); retrying at the next poll")
            return False
        self._unpublished = False
        self.published_step, self.published_sha256 = outer_step, common["global_sha256"]
        self.cadence.wrote(files)
        for path in delete:
            self._processed_paths.pop(path, None)
        if delete:
            log.info(
                f"master: garbage-collected {len(delete)} processed delta(s), keep_deltas={self.keep_deltas}"
            )
        self._hf_config_written = self._hf_config_written or HF_CONFIG_PATH in files
        self.bytes_uploaded += sum(len(b) for b in files.values())
        return True

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
        current = not self._unpublished and self.published_step == self.state.outer_step
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

    def save_state(self) -> None:
        if self.state_dir is None:
            return
        with self.lock:
            try:
                self.state.save(self.state_dir)
            except OSError as err:
                self.errors += 1
                log.error("master: cannot save the master state to %s: %s", self.state_dir, err)

    def ledger_entry(self, identity: tuple[str, int, str]) -> LedgerEntry | None:
        """What the ledger holds for a delta (node, local step, sha256), under the lock."""
        with self.lock:
            return self.state.ledger.get(identity)

    def node_steps_applied(self) -> int:
        """Every node's newest applied local step, summed (under the lock)."""
        with self.lock:
            return sum(max(step, 0) for step in self.state.ledger.included.values())

    def checkpoint(self) -> dict:
        """The full outer state, for the trainer's checkpoint (under the lock)."""
        with self.lock:
            return self.state.to_checkpoint()

    def snapshot(self) -> GlobalSnapshot:
        with self.lock:
            state, ledger = self.state.published(), self.state.ledger
            args = (self.last_num_peers, dict(ledger.included), dict(ledger.step_micros))
            return GlobalSnapshot(self.state.outer_step, state, "master", *args)

    # ---- the daemon thread

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="dumb-diloco-outer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval) and not self.dead:
            self._round()
        # stop() was called: rounds until every node's final delta is processed, or drain_timeout passed
        # (a round that a transport error cut short is tried again, up to 20 polls, even past the deadline)
        self._draining, deadline, announced, failed = True, time.monotonic() + self._drain_timeout, 0.0, 0
        while not self.fenced and not self.dead:
            ok = self._round(flush=self.intake.all_finished)  # every node finished: no quorum to wait for
            failed = 0 if ok else failed + 1
            remaining = deadline - time.monotonic()
            if (ok and not self.unfinished) or (remaining <= 0 and (ok or failed >= 20)):
                break
            if self.unfinished and time.monotonic() - announced > 30:
                announced, left = time.monotonic(), self.describe_left()
                log.info(f"master: waiting up to {remaining:.0f}s for the final deltas of: {left}")
            time.sleep(self.poll_interval if remaining <= 0 else min(self.poll_interval, remaining))
        for _ in range(20 if self._pending else 0):  # below the quorum at the end: apply, do not lose them
            if self._round(flush=True) or self.fenced or self.dead:
                break
            time.sleep(self.poll_interval)
        if self.unfinished:
            log.warning(
                f"master: stopped after drain_timeout {self._drain_timeout:g}s without the final deltas of: "
                f"{self.describe_left()}"
            )
        self.heartbeat(final=True)

    def describe_left(self) -> str:
        return "; ".join(f"{node} ({why})" for node, why in self.unfinished.items())

    def _round(self, flush: bool = False) -> bool:
        """One guarded poll; True if it went through with no transport error left to retry."""
        if self.fenced or self.dead:
            return False
        try:
            self.heartbeat()
            self.run_once(flush)
        except Exception as err:  # never let the outer loop die (but for a refused token): log, count, retry
            self.errors += 1
            self.dead = self.dead or why_permanent(err)
            log.exception(
                f"master: outer round failed ({type(err).__name__}); retrying in {self.poll_interval}s"
            )
            return False
        return not self.intake.transient and not self._unpublished

    @property
    def running(self) -> bool:
        """Whether the daemon thread is alive (started and not yet ended)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def draining(self) -> bool:
        """True once `stop` asked for the final deltas (the rounds after it wait for every node's last)."""
        return self._draining

    @property
    def stopped(self) -> bool:
        """True once `stop` was called (until the next `start`)."""
        return self._stop.is_set()

    def stop(self, drain_timeout: float = 0.0, timeout: float | None = None) -> bool:
        """Run rounds until every node's final delta is processed (at most `drain_timeout` s; 0: one last
        round), then the final ledger and lease write, and stop. `unfinished` then says what was left.
        Returns False if the thread was still busy after drain_timeout + `timeout` s (it is a daemon)."""
        if self._thread is None:
            return True
        self._drain_timeout = drain_timeout
        self._stop.set()
        self._thread.join(None if timeout is None else timeout + drain_timeout)
        return not self._thread.is_alive()

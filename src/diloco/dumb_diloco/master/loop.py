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

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

import torch

from ..settings import Settings
from ..store.base import why_permanent
from ..store.transport import Transport
from ..wire.global_state import GlobalSnapshot, delta_layout
from .aggregation import RunningSum
from .intake import Candidate, Intake
from .publication import Publisher
from .recovery import LedgerEntry, MasterState

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


@dataclass(frozen=True)
class OuterConfig:
    """What the outer loop is told by the `distributed:` block (`of`); every default past the spec is the
    spec's: a quorum of deltas per round, staleness weights 1/(1+staleness), delayed Nesterov, ledger +
    momentum published with the global, GC of processed deltas, the single-master lease."""

    node_id: str
    outer_lr: float
    outer_momentum: float
    poll_interval: float = 1.0
    max_file_bytes: int = 2**34
    collaborators: tuple[str, ...] = ()  # the nodes whose deltas count (and the master's own); (): every node
    min_deltas_per_round: int = 0
    staleness_weighting: bool = False
    delayed_nesterov_period: int = 0  # 0: Nesterov SGD every step
    publish_state: bool = True
    keep_deltas: int = 0  # processed deltas kept per node (0: keep all)
    lease_seconds: float = 0.0  # 0: no lease

    @classmethod
    def of(cls, s: Settings, max_file_bytes: int) -> OuterConfig:
        return cls(
            s.node_id,
            s.outer_lr,
            s.outer_momentum,
            s.poll_interval,
            max_file_bytes,
            tuple(s.collaborators),
            s.min_deltas_per_round,
            s.staleness_weighting,
            s.delayed_nesterov_period if s.delayed_nesterov else 0,
            s.publish_master_state,
            s.keep_deltas,
            s.lease_seconds,
        )


@dataclass(eq=False)
class OuterLoop:
    """Steps 1-10 of the outer loop over a `Transport`; `start()` runs them in a daemon thread. Never
    started, the loop is the caller's to drive (a lock-step simulation): each `run_once()` is one round,
    and `stop()` has no thread to stop (it runs no last round). Its parts: the `Intake` (intake.py: what
    nodes/ holds, validated), the running sum (aggregation.py), the `Publisher` (publication.py: steps 7-8,
    the lease, fencing)."""

    transport: Transport
    state: MasterState
    config: OuterConfig
    _: KW_ONLY
    state_dir: Path | None = None
    on_snapshot: Callable[[GlobalSnapshot], None] = lambda snapshot: None
    hf_config: dict | None = None
    wall_clock: Callable[[], float] = time.time
    init_sha256: str | None = None  # the master's initial weights, published for workers to compare
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)  # this process, in the lease (fencing)
    published_step: int = -1  # the global in the repository, as this master published or found it
    published_sha256: str = ""

    def __post_init__(self):
        c = self.config
        allowed = frozenset(c.collaborators) | {c.node_id} if c.collaborators else None
        self.intake = Intake(
            self.transport, delta_layout(self.state.published(share=True)), c.max_file_bytes, allowed
        )
        self._pending: dict[tuple[str, int, str], Candidate] = {}  # waiting for the quorum; summed in _sum
        self._sum, self._round_nodes = RunningSum(), None  # step 5 as the deltas arrive: their weighted sum
        self._processed_paths: dict[str, tuple[str, int]] = {}  # path -> (node, step): processed, in the repo
        self.lock = threading.Lock()  # guards `state` against checkpointing from the training thread
        outer = {"outer_lr": c.outer_lr, "outer_momentum": c.outer_momentum, "init_sha256": self.init_sha256}
        self.publication = Publisher(
            self.transport,
            self.state,
            self.lock,
            node_id=c.node_id,
            outer=outer,
            publish_state=c.publish_state,
            hf_config=self.hf_config,
            keep_deltas=c.keep_deltas,
            lease_seconds=c.lease_seconds,
            wall_clock=self.wall_clock,
            instance=self.instance,
            published_step=self.published_step,
            published_sha256=self.published_sha256,
        )
        self._dead = ""  # non-empty: a refused token (PermanentError): the loop stopped; the node fails
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._drain_timeout, self._draining = 0.0, False
        self.unfinished: dict[str, str] = {}  # while draining: node -> why its final delta is not processed
        # metrics (read by the training thread)
        self.rounds = self.deltas_accepted = self.deltas_rejected = self.last_num_peers = self._errors = 0
        self.last_pseudo_grad_norm, self.last_staleness = 0.0, []  # the last round's; staleness per delta

    @property
    def dead(self) -> str:
        """Non-empty once a write or a read was refused for good (PermanentError): the loop stopped."""
        return self._dead or self.publication.dead

    @property
    def fenced(self) -> str:
        """Non-empty once another process holds the lease: this master no longer publishes."""
        return self.publication.fenced

    @property
    def errors(self) -> int:
        """Failed rounds, publications and state saves."""
        return self._errors + self.publication.errors

    @property
    def bytes_uploaded(self) -> int:
        return self.publication.bytes_uploaded

    # ---- one poll: the ten steps

    def run_once(self, flush: bool = False) -> RoundResult:
        """One poll. With `min_deltas_per_round` N > 0 valid deltas wait (in the running sum, not in the
        ledger) until N are pending; `flush` (shutdown) applies the pending ones even below N."""
        start = time.perf_counter()
        if self.publication.unpublished:
            self.publish()
        revision = self.transport.revision()
        candidates = self.intake.candidates(revision)  # 1 + 2 (headers)
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
        self.intake.end_round()
        valid = self._take_round(flush, revision)
        with self.lock:
            for entry in result.rejected:
                ledger.add(entry)
            self.deltas_rejected += len(result.rejected)
            if result.rejected:
                self.publication.rejected()
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
            self.unfinished = self.intake.unfinished(
                listed_all, self.state.ledger, self.config.node_id, revision
            )
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
        period = max(1, self.config.delayed_nesterov_period)  # counted in deltas (arXiv 2401.09135)
        self.state.apply_outer_step(
            mean, self.config.outer_lr, self.config.outer_momentum, period, len(valid)
        )  # 6
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
        if self.config.staleness_weighting:
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
        quorum, senders = (
            max(1, self.config.min_deltas_per_round),
            {c.node_id for c in self._pending.values()},
        )
        nodes = len(senders) + (len(self.intake.finished(revision) - senders) if quorum > 1 else 0)
        if not self._pending or (nodes < quorum and not flush):
            if self._pending:
                log.info(f"master: {self.pending} delta(s) of {nodes} node(s) pending, waiting for {quorum}")
            return []
        expected = quorum - nodes + len(senders)  # a flush below the quorum: the nodes still expected
        self._round_nodes = max(len(senders), expected) if self.config.min_deltas_per_round else None
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
        """Steps 7 and 8 (the `Publisher`); the processed deltas it garbage-collected are forgotten."""
        deleted = self.publication.publish(applied, self._processed_paths)
        for path in deleted or ():
            self._processed_paths.pop(path, None)
        return deleted is not None

    def heartbeat(self, final: bool = False) -> None:
        """The lease and the ledger between publications, when due (the `Publisher`)."""
        self.publication.heartbeat(final)

    def save_state(self) -> None:
        if self.state_dir is None:
            return
        with self.lock:
            try:
                self.state.save(self.state_dir)
            except OSError as err:
                self._errors += 1
                log.error("master: cannot save the master state to %s: %s", self.state_dir, err)

    def adopt_existing(self) -> int:
        """Every delta now in the repository into the ledger as "preexisting" (a master adopting a
        repository without its own state cannot know which were applied; re-applying them would be
        worse); returns how many."""
        revision = self.transport.revision()
        found = [c for c in self.intake.candidates(revision) if c.identity not in self.state.ledger]
        with self.lock:
            for c in found:
                self.state.ledger.add(c.entry("preexisting", self.state.outer_step))
        return len(found)

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
        while not self._stop.wait(self.config.poll_interval) and not self.dead:
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
            time.sleep(
                self.config.poll_interval if remaining <= 0 else min(self.config.poll_interval, remaining)
            )
        for _ in range(20 if self._pending else 0):  # below the quorum at the end: apply, do not lose them
            if self._round(flush=True) or self.fenced or self.dead:
                break
            time.sleep(self.config.poll_interval)
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
            self._errors += 1
            self._dead = self._dead or why_permanent(err)
            log.exception(
                f"master: outer round failed ({type(err).__name__}); retrying in {self.config.poll_interval}s"
            )
            return False
        return not self.intake.transient and not self.publication.unpublished

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

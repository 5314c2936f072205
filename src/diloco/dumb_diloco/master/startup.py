"""A master's start from the newest state it can trust (`take_lease`, `recover_outer_loop`,
`open_outer_loop`); how the node joins the run (`GlobalReader`, `Joiner`, one `Repository`) is node/joiner.py.

Invariants: the master runs under the start-up deadline of `DumbDiLoCo.start` (startup_timeout, retries
included). Prose: docs/dumb_diloco.md ("Node lifecycle", "Restarts and checkpoints").
"""

from __future__ import annotations

import fcntl
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Protocol

import torch

from ..settings import DumbDiLoCoError, Settings
from ..store.transport import RevisionConflict, Transport, TransportError, write_atomic
from ..wire.global_state import GlobalSnapshot
from ..wire.repo_paths import LEASE_PATH
from ..wire.tensor_format import GlobalMismatch, InvalidTensorFile
from .loop import OuterConfig, OuterLoop
from .publication import lease_blob
from .recovery import MasterState, lease_holder, load_published_state, read_lease, recover

log = logging.getLogger("diloco.dumb_diloco")


class PublishedGlobal(Protocol):
    """What the master reads of the newest published global: its step_count.json and the versions that
    failed validation (the node's node/joiner.GlobalReader is one)."""

    step_info: dict
    rejected: set[tuple[int, str]]


class Repository(Protocol):
    """The repository the master runs against, as the node that hosts it opened it (node/joiner.Joiner
    is one): the run's settings, the transport once connected and the reader of the published global.
    A protocol here, so the master needs nothing of the node's folder."""

    s: Settings
    transport: Transport
    reader: PublishedGlobal


def recover_outer_loop(
    joiner: Repository,
    fetch: Callable[[], GlobalSnapshot | None],
    check_layout: Callable[[dict[str, torch.Tensor], str], None],
    model_state: dict[str, torch.Tensor],
    *,
    checkpoint: MasterState | None,
    state_dir: Path,
    max_file_bytes: int,
    instance: str,
    init_sha256: str,
    hf_config: dict | None,
    on_snapshot: Callable[[GlobalSnapshot], None],
) -> tuple[OuterLoop, bool, bool]:
    """The master's outer loop, from the newest state it can trust (recovery.recover: `state_dir`'s, the
    trainer `checkpoint`'s or the repository's, read with `fetch`). Returns it (not started) and whether
    the repository is behind it (publish) and whether it adopted the repository's global."""
    s, reader = joiner.s, joiner.reader
    try:
        local = MasterState.load(state_dir)
    except (OSError, ValueError, InvalidTensorFile) as err:
        raise DumbDiLoCoError(f"master state in {state_dir} is unreadable: {err}") from None
    saved = max((x for x in (local, checkpoint) if x is not None), key=lambda x: x.outer_step, default=None)
    if saved is not None:  # the one recover() prefers
        check_layout(saved.published(), f"the master state in {state_dir}")
    try:
        repo = fetch()
    except GlobalMismatch as err:
        raise s.error(
            f"the global model in {s.repo_id} is not this model ({err.reason}); "
            "use the model config of that run, or another repo_id"
        ) from None
    except InvalidTensorFile as err:
        log.warning("master: the repository's global is corrupt (%s); it will be replaced", err)
        repo = None
    except TransportError as err:
        raise s.error(f"cannot read {s.repo_id}: {err}") from None

    def published(outer_step: int):
        if not s.publish_master_state:
            return None
        try:
            sha = reader.step_info.get("global_sha256", "")
            return load_published_state(joiner.transport, outer_step, sha, max_file_bytes)
        except TransportError as err:
            raise s.error(f"cannot read {s.repo_id}: {err}") from None

    corrupt = max((k for k, _ in reader.rejected), default=-1)
    state, publish, adopted = recover(
        local, checkpoint, repo, reader.step_info, published, model_state, corrupt
    )
    outer = OuterLoop(
        joiner.transport,
        state,
        OuterConfig.of(s, max_file_bytes),
        state_dir=state_dir,
        on_snapshot=on_snapshot,
        hf_config=hf_config,
        init_sha256=init_sha256,
        instance=instance,
        published_step=-1 if repo is None else repo.outer_step,
        published_sha256="" if repo is None else reader.step_info.get("global_sha256", ""),
    )
    return outer, publish, adopted


def open_outer_loop(outer: OuterLoop, settings: Settings, publish: bool, adopted: bool) -> None:
    """A recovered outer loop's first writes: an adopted repository's deltas marked as processed, the
    state published if the repository is behind it, and saved locally."""
    if adopted:
        n = outer.adopt_existing()
        log.warning(
            "master: no local master state; adopted global outer step %d from %s and treat its %d "
            "existing delta(s) as already processed",
            outer.state.outer_step,
            settings.repo_id,
            n,
        )
    if publish:
        outer.publish()
        log.info("master: published global outer step %d to %s", outer.state.outer_step, settings.repo_id)
    outer.save_state()


def take_lease(settings: Settings, transport: Transport, state_dir: Path) -> tuple[str, IO]:
    """This master process's instance token, once it holds the repository (past the spec): an exclusive
    flock on <state_dir>/<node_id>/master.lock (one process per master state on a machine), then the lease
    global/master_lease.json, written only on top of the revision at which it was found free (a
    compare-and-swap: of two masters starting together, one wins). A fresh lease of another process is
    refused in one line, also with this node id, unless it is of the process that last held this
    state_dir (a restart after a crash: the flock proves it is gone). Returns the token and the open
    lock file, which holds the flock until it is closed."""
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = open(state_dir / "master.lock", "a+")  # noqa: SIM115 - held until close()
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise settings.error(
            f"another process runs this master with state_dir {state_dir} (it holds master.lock); "
            "run one master per node id"
        ) from None
    except OSError as err:
        log.warning("master: cannot lock %s (%s); relying on the lease alone", state_dir, err)
    try:
        instance = _lease(settings, transport, state_dir)
    except BaseException:
        lock.close()
        raise
    return instance, lock


def _lease(s: Settings, transport: Transport, state_dir: Path) -> str:
    instance = uuid.uuid4().hex
    previous = state_dir / "instance"
    before = previous.read_text().strip() if previous.exists() else ""
    if s.lease_seconds <= 0:
        return instance
    for _ in range(20):
        try:
            revision = transport.revision()
            lease = read_lease(transport, revision)
            ours = lease is not None and bool(before) and lease.get("instance") == before
            other = None if ours else lease_holder(lease, instance, s.lease_seconds, time.time())
            if other is not None:
                same = " (another process with this node id)" if other[0] == s.node_id else ""
                raise s.error(
                    f"{s.repo_id} is held by master {other[0]!r}{same} (lease heartbeat {other[1]:.0f}s ago, "
                    f"lease_seconds {s.lease_seconds:g}); run one master per repository, or start this one "
                    "after that master stopped (a clean stop releases the lease) or its lease expired"
                )
            if lease is not None and not ours:
                why = "it released the lease" if lease.get("released") else "its lease expired"
                log.warning(
                    f"master {s.node_id}: taking over {s.repo_id} from master {lease.get('master')!r} ({why})"
                )
            blob = lease_blob(s.node_id, instance, time.time(), s.lease_seconds, -1, False)
            transport.write({LEASE_PATH: blob}, message=f"{s.node_id}: lease", parent_revision=revision)
            write_atomic(previous, instance.encode())
            return instance
        except RevisionConflict:
            continue  # the repository moved on (a delta, another master): look again
        except TransportError as err:
            raise s.error(f"cannot take the lease of {s.repo_id}: {err}") from None
    raise s.error(f"cannot take the lease of {s.repo_id}: the repository kept changing under it")

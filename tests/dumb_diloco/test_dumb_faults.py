"""Past the specification, part 2: fault injection with the master, workers and readers as separate
processes (this file is also the processes' script: `python tests/dumb_diloco/test_dumb_faults.py <role> ...`).

- a master killed (SIGKILL) mid-run and restarted continues: outer step, momentum and ledger; replaying
  the published ledger from the deltas in the repository gives the published global and momentum bit for
  bit, so no delta was processed twice or lost;
- a second master refuses to start while the first one's lease is fresh, and takes over after it expired;
- a transport failing every third call never stops training, and every delta ends up applied (a failed
  upload is merged into the node's next delta);
- a reader polling concurrently with publications never sees the global weights and step_count.json of
  different rounds (directory and loopback Hub).

Nothing here waits for a fixed time or counts on a thread interleaving: the test side waits for durable
records (files in the repository, rendezvous files the processes write) with generous deadlines, the
nodes pause at a given step until told to go on, and the fault injection follows a fixed schedule.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from polling import wait_until

TESTS = Path(__file__).resolve().parents[1]
TOKEN = "hf_FaultTestTokenNeverLogged0123456789"
H = 3
DEADLINE = 120  # s: the longest any wait below may take before it counts as a failure (a loaded machine)


# ============================================================================ the processes' side


class Flaky:
    """A transport whose calls fail (TransientError, before reaching the repository) on a fixed schedule.

    Each operation's calls are numbered 1, 2, 3, ... in this process and every `every`-th one fails:
    calls 1, 1 + every, 1 + 2 * every, ... of `write` (so a node's first upload and a master's first
    publication fail for sure), calls every, 2 * every, ... of the others (a master refuses to start when
    its first reads fail). Not a random draw per call: the uploader, poll and outer-loop threads share
    the transport, so which call drew which number, and whether any upload failed at all, would depend on
    the threads' interleaving."""

    def __init__(self, inner, every: int):
        self.inner, self.every, self.failures = inner, every, 0
        self._calls: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _maybe_fail(self, op: str) -> None:
        from diloco.dumb_diloco.store.transport import TransientError

        with self._lock:
            self._calls[op] += 1
            n = self._calls[op]
            fail = (n - 1) % self.every == 0 if op == "write" else n % self.every == 0
            self.failures += fail
        if fail:
            raise TransientError(f"injected: {op} call {n} failed")

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("revision", "list", "read", "read_header", "write", "delete"):
            return attr

        def call(*a, **k):
            self._maybe_fail(name)
            return attr(*a, **k)

        return call


def _transport(repo: str, create: bool):
    from diloco.dumb_diloco.store.transport import DirectoryTransport, HubTransport, RetryPolicy

    if repo.startswith("http"):
        endpoint, _, repo_id = repo.rpartition("|") if "|" in repo else (repo, "", "")
        retry = RetryPolicy(max_attempts=3, base_delay_s=0.05, max_delay_s=0.2, max_total_s=5)
        return HubTransport(repo_id, token=TOKEN, endpoint=endpoint, create=create, retry=retry)
    return DirectoryTransport(repo, create=create)


def _settings(repo: str, role: str, node_id: str, state_dir: str, **kw):
    from dumb_helpers import settings

    return settings(
        Path(repo) if not repo.startswith("http") else Path("x"),
        role=role,
        node_id=node_id,
        inner_steps=H,
        poll_interval=0.05,
        state_dir=state_dir,
        startup_timeout=DEADLINE,
        shutdown_timeout=60,
        async_delta_upload=True,
        async_global_poll=True,
        **kw,
    )


def _wait_until(pred, what: str) -> None:
    """In a node process: wait for `pred` (a rendezvous with the test), or exit 3 past DEADLINE."""
    end = time.monotonic() + DEADLINE
    while not pred():
        if time.monotonic() > end:
            print(f"error: timed out waiting for {what}", file=sys.stderr)
            sys.exit(3)
        time.sleep(0.01)


def proc_node(
    role: str,
    repo: str,
    node_id: str,
    state_dir: str,
    stop_file: str,
    steps: int,
    fail_every: int,
    lease: float,
    seed: int,
    first_step: int = 0,
    pause_at: int = 0,
) -> None:
    """A node whose "optimizer step" moves every weight by a seeded random amount, every 10 ms, until
    `steps` steps or `stop_file` exists; then a bounded close. Prints its counters as JSON.

    With `pause_at`, after that step the node waits until its upload is done, writes <node_id>.paused
    beside `stop_file` and waits there until a file `go` exists. Every delta carries the number of steps
    it covers as tokens_since_baseline (one token per step), so the repository tells what was delivered."""
    import torch
    from dumb_helpers import Tiny

    from diloco.dumb_diloco.node.strategy import DumbDiLoCo
    from diloco.dumb_diloco.settings import DumbDiLoCoError

    torch.manual_seed(seed)
    # a restarted master opens the existing repository (the loopback Hub answers create_repo on an existing
    # repository without the "url" the client wants: a gap of src/diloco/testing/hub_server.py, not of the transport)
    transport = _transport(repo, create=role == "master" and first_step == 0)
    if fail_every:
        transport = Flaky(transport, fail_every)
    kw = {"lease_seconds": lease} if role == "master" else {}
    coord = DumbDiLoCo(Tiny(), _settings(repo, role, node_id, state_dir, **kw), transport, tokens_per_step=1)
    try:
        coord.start()
    except DumbDiLoCoError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    step = first_step  # a restarted node's trainer resumes its step count from its checkpoint
    while step - first_step < steps and not os.path.exists(stop_file):
        step += 1
        with torch.no_grad():
            for p in coord.model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        coord.on_step(step)  # never raises, whatever the transport does
        if step - first_step == pause_at:
            _wait_until(lambda: not coord.uploader.uploading, "the upload in flight")
            Path(stop_file).with_name(f"{node_id}.paused").touch()
            _wait_until(Path(stop_file).with_name("go").exists, "the go file")
        time.sleep(0.01)
    coord.close()
    out = {
        "steps": step - first_step,
        "uploads": coord.counters.uploads,
        "upload_failures": coord.counters.upload_failures,
        "carry_steps": coord.uploader.carry.steps if coord.uploader.carry else 0,
        "pending_steps": coord.uploader.steps_since_capture,  # after the last captured boundary: never uploaded
        "injected": getattr(transport, "failures", 0),
    }
    if coord.outer is not None:
        out |= {"outer_step": coord.outer.state.outer_step, "errors": coord.outer.errors}
    print(json.dumps(out), flush=True)


def proc_reader(repo: str, min_checks: int, min_steps: int) -> None:
    """Poll global/step_count.json and global/latest.safetensors at one revision, as installers do, until
    `min_checks` pairs were compared and `min_steps` distinct outer steps seen (publications happened
    while reading), or DEADLINE passed; exit 1 at the first pair of different rounds."""
    from diloco.dumb_diloco.store.transport import RemoteNotFound
    from diloco.dumb_diloco.wire.repo_paths import GLOBAL_STEP_PATH, GLOBAL_WEIGHTS_PATH
    from diloco.dumb_diloco.wire.tensor_format import decode

    t = _transport(repo, create=False)
    checks, steps, end = 0, set(), time.monotonic() + DEADLINE
    while (checks < min_checks or len(steps) < min_steps) and time.monotonic() < end:
        rev = t.revision()
        try:
            info = json.loads(t.read(GLOBAL_STEP_PATH, rev))
            _, meta = decode(t.read(GLOBAL_WEIGHTS_PATH, rev), max_bytes=2**24)
        except RemoteNotFound:
            continue
        if meta["outer_step"] != str(info["outer_step"]) or meta["payload_sha256"] != info["global_sha256"]:
            print(f"OUT OF STEP at {rev}: {meta['outer_step']} vs {info['outer_step']}", flush=True)
            sys.exit(1)
        checks += 1
        steps.add(info["outer_step"])
    print(json.dumps({"checks": checks, "distinct_steps": len(steps)}), flush=True)


# ============================================================================ the tests' side


def _spawn(*args: str, log: Path) -> subprocess.Popen:
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    )  # polling
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *map(str, args)],
        cwd=TESTS,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )


def node(
    tmp_path,
    role,
    repo,
    node_id,
    *,
    steps=10**6,
    fail_every=0,
    lease=0.0,
    seed=0,
    tag="",
    first_step=0,
    pause_at=0,
):
    return _spawn(
        "node",
        role,
        repo,
        node_id,
        tmp_path / "state",
        tmp_path / "stop",
        steps,
        fail_every,
        lease,
        seed,
        first_step,
        pause_at,
        log=tmp_path / f"{node_id}{tag}.log",
    )


def finish(p: subprocess.Popen, log: Path, timeout: float = DEADLINE) -> dict:
    p.wait(timeout=timeout)
    text = log.read_text()
    assert p.returncode == 0, text[-3000:]
    # the last JSON line: a daemon thread may still log a line after it while the process exits
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def _ready(repo: str) -> bool:
    try:
        return published_step(_transport(repo, create=False)) >= 0
    except Exception:  # the repository does not exist yet
        return False


def published_step(repo) -> int:
    from diloco.dumb_diloco.store.transport import RemoteNotFound
    from diloco.dumb_diloco.wire.repo_paths import GLOBAL_STEP_PATH

    try:
        return json.loads(repo.read(GLOBAL_STEP_PATH))["outer_step"]
    except (RemoteNotFound, ValueError):
        return -1


def applied_nodes(repo) -> set[str]:
    """The nodes with at least one delta applied in the published ledger."""
    from diloco.dumb_diloco.store.transport import RemoteNotFound
    from diloco.dumb_diloco.wire.repo_paths import GLOBAL_LEDGER_PATH

    try:
        entries = json.loads(repo.read(GLOBAL_LEDGER_PATH))["entries"]
    except (RemoteNotFound, ValueError):
        return set()
    return {e["node_id"] for e in entries if e["status"] == "applied"}


def delivered(repo, node_id: str) -> tuple[int, int]:
    """(number of the node's deltas in the repository, optimizer steps they cover): every node process
    writes one token per step, so tokens_since_baseline is the steps a delta covers."""
    from diloco.dumb_diloco.wire.tensor_format import DeltaMeta

    files = repo.list(f"nodes/{node_id}")
    steps = sum(DeltaMeta.from_header(repo.read_header(f.path).metadata).tokens_since_baseline for f in files)
    return len(files), steps


def replay(repo, node_state) -> None:
    """Rebuild the global and momentum from the initial model and the published ledger (each round's
    deltas averaged in ledger order, one Nesterov step per round) and compare with what is published."""
    import torch
    from dumb_helpers import Tiny

    from diloco.dumb_diloco.master.aggregation import average as _average
    from diloco.dumb_diloco.master.recovery import MasterState
    from diloco.dumb_diloco.wire.repo_paths import (
        GLOBAL_LEDGER_PATH,
        GLOBAL_MOMENTUM_PATH,
        GLOBAL_WEIGHTS_PATH,
        delta_path,
        parse_delta_path,
    )
    from diloco.dumb_diloco.wire.tensor_format import decode

    ledger = json.loads(repo.read(GLOBAL_LEDGER_PATH))
    entries = ledger["entries"]
    applied = [(e["node_id"], e["local_step"]) for e in entries if e["status"] == "applied"]
    in_repo = {parse_delta_path(f.path) for f in repo.list("nodes") if f.path.endswith(".safetensors")}
    assert len(applied) == len(set(applied)), "a delta was applied twice (or a path was reused)"
    assert set(applied) == in_repo, f"lost: {in_repo - set(applied)}, unknown: {set(applied) - in_repo}"
    assert all(e["staleness"] >= 0 for e in entries if e["status"] == "applied")
    state = MasterState.from_model_state(Tiny().state_dict())
    for step in range(1, ledger["outer_step"] + 1):
        deltas = [
            decode(repo.read(delta_path(e["node_id"], e["local_step"])), max_bytes=2**20)[0]
            for e in entries
            if e["status"] == "applied" and e["outer_step"] == step
        ]
        assert deltas, f"outer step {step} has no deltas in the ledger"
        state.apply_outer_step(_average(deltas), 0.7, 0.9)
    weights, _ = decode(repo.read(GLOBAL_WEIGHTS_PATH), max_bytes=2**20)
    momentum, _ = decode(repo.read(GLOBAL_MOMENTUM_PATH), max_bytes=2**20)
    for k in ("w", "b"):
        assert torch.equal(weights[k], state.weights[k]), k
        assert torch.equal(momentum[f"momentum/{k}"], state.momentum[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", "hub"])
def test_master_killed_mid_run_and_restarted_continues_exactly(tmp_path, kind):
    server, repo_id = _repo(tmp_path, kind)
    try:
        master = node(tmp_path, "master", repo_id, "m", lease=30)
        wait_until(lambda: _ready(repo_id), "the master's first global", DEADLINE)
        # the workers stop after step 24 (their 8th delta uploaded) until told to go on
        workers = [
            node(tmp_path, "worker", repo_id, f"w{i}", steps=45, seed=i + 1, pause_at=24) for i in (1, 2)
        ]
        repo = _transport(repo_id, create=False)
        wait_until(
            lambda: all((tmp_path / f"w{i}.paused").exists() for i in (1, 2)), "the workers' pause", DEADLINE
        )
        # mid-run: 4 outer steps (the master's own deltas keep coming) with deltas of both workers in them
        wait_until(
            lambda: published_step(repo) >= 4 and applied_nodes(repo) >= {"w1", "w2"},
            "4 outer steps with both workers' deltas",
            DEADLINE,
        )
        master.send_signal(signal.SIGKILL)  # no close, no last save: wherever it was
        master.wait()
        killed_at = published_step(repo)
        # the workers go on: their deltas from step 27 on can only be applied by the restarted master
        (tmp_path / "go").touch()
        # same node id (its own lease); its trainer would resume from its checkpoint's step, past the old deltas
        master = node(tmp_path, "master", repo_id, "m", lease=30, tag="-2", first_step=100_000)
        for w, i in zip(workers, (1, 2)):
            assert finish(w, tmp_path / f"w{i}.log")["steps"] == 45
        # the workers have exited, so every delta they uploaded is in the repository: the master's last
        # round, after the stop file, takes whatever its earlier rounds did not
        (tmp_path / "stop").touch()
        out = finish(master, tmp_path / "m-2.log")
        assert out["outer_step"] > killed_at and out["errors"] == 0
        assert {"w1", "w2", "m"} <= applied_nodes(repo)
        replay(repo, tmp_path / "state")
    finally:
        if server is not None:
            server.stop()


def _repo(tmp_path, kind):
    """(loopback Hub server or None, the repo argument of the processes)."""
    if kind == "hub":
        from diloco.testing.hub_server import HubServer

        server = HubServer(token=TOKEN).start()
        return server, f"{server.url}|org/run"
    return None, str(tmp_path / "repo")


@pytest.mark.slow
def test_second_master_refuses_while_the_lease_is_fresh_then_takes_over(tmp_path):
    from diloco.dumb_diloco.store.transport import DirectoryTransport
    from diloco.dumb_diloco.wire.repo_paths import GLOBAL_STEP_PATH, LEASE_PATH

    repo_dir = str(tmp_path / "repo")
    lease = 2.0  # m1's lease, and the taking-over m2's
    first = node(tmp_path, "master", repo_dir, "m1", lease=lease)
    wait_until(
        lambda: (tmp_path / "repo").exists() and published_step(DirectoryTransport(repo_dir)) >= 0,
        "the first master",
        DEADLINE,
    )
    # A master counts a lease as fresh for the longer of the holder's lease_seconds and its own: 300 s here,
    # so m1's lease is fresh when m2 looks, however long a loaded machine delays m1's heartbeats.
    second = node(tmp_path, "master", repo_dir, "m2", lease=300, tag="-refused")
    second.wait(timeout=DEADLINE)
    text = (tmp_path / "m2-refused.log").read_text()
    assert second.returncode == 2 and "held by master 'm1'" in text
    assert len([line for line in text.splitlines() if line.startswith("error:")]) == 1
    first.send_signal(signal.SIGKILL)
    first.wait()
    repo = DirectoryTransport(repo_dir)
    m1_lease = json.loads(repo.read(LEASE_PATH))  # m1's last heartbeat: nobody renews it any more
    assert m1_lease["master"] == "m1"
    m1_step = published_step(repo)
    w = node(tmp_path, "worker", repo_dir, "w1", steps=30, seed=3)
    wait_until(lambda: time.time() - m1_lease["heartbeat"] > lease, "m1's lease to expire", DEADLINE)
    # m2's seed differs from m1's (0): each step's noise is the seed's, so with m1's seed a delta of m2 can carry
    # the very payload of m1's delta at the same step, which the master rightly records as a duplicate
    second = node(tmp_path, "master", repo_dir, "m2", lease=lease, tag="-takeover", seed=2)
    finish(w, tmp_path / "w1.log")
    (tmp_path / "stop").touch()
    finish(second, tmp_path / "m2-takeover.log")
    # m2 said so when it started (a warning: Python's last-resort handler prints it to the process's stderr)
    text = (tmp_path / "m2-takeover.log").read_text()
    assert f"master m2: taking over {repo_dir} from master 'm1' (its lease expired)" in text, text[-3000:]
    # and the repository's durable records say so: m2 holds the lease and published the rounds after m1's
    # (w1's deltas, uploaded while no master ran, were new to it)
    assert json.loads(repo.read(LEASE_PATH))["master"] == "m2"
    info = json.loads(repo.read(GLOBAL_STEP_PATH))
    assert info["master"] == "m2" and info["outer_step"] > m1_step
    assert "w1" in applied_nodes(repo)
    replay(repo, tmp_path / "state")  # the takeover was exact: one history, every delta once


@pytest.mark.slow
def test_transport_failing_every_third_call_never_stops_training(tmp_path):
    from diloco.dumb_diloco.store.transport import DirectoryTransport

    repo_dir = str(tmp_path / "repo")
    master = node(tmp_path, "master", repo_dir, "m", fail_every=3, seed=11)
    wait_until(
        lambda: (tmp_path / "repo").exists() and published_step(DirectoryTransport(repo_dir)) >= 0,
        "the master",
        DEADLINE,
    )
    workers = [
        node(tmp_path, "worker", repo_dir, f"w{i}", steps=30, fail_every=3, seed=20 + i) for i in (1, 2)
    ]
    outs = {i: finish(w, tmp_path / f"w{i}.log") for w, i in zip(workers, (1, 2))}
    for o in outs.values():
        assert o["steps"] == 30 and o["injected"] > 0  # training never stopped
        assert o["upload_failures"] >= 1  # the first upload failed (Flaky) and was merged into the next one
    # the workers have exited, so every delta they uploaded is in the repository: the master's last round,
    # after the stop file, takes whatever its earlier rounds did not (retrying what a failure cut short)
    (tmp_path / "stop").touch()
    out = finish(master, tmp_path / "m.log")
    assert out["injected"] > 0
    # every delta in the repository was applied exactly once, and the history replays exactly
    repo = DirectoryTransport(repo_dir)
    replay(repo, tmp_path / "state")
    for i, o in outs.items():
        # each successful upload is one file, and every step of the run is accounted for: delivered in a
        # delta, reported as never delivered (a failed last upload), or after the last boundary captured
        files, steps = delivered(repo, f"w{i}")
        assert o["uploads"] == files
        assert steps + o["carry_steps"] + o["pending_steps"] == 30, (o, steps)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", "hub"])
def test_reader_never_sees_global_and_step_count_out_of_step(tmp_path, kind, monkeypatch):
    server, repo = _repo(tmp_path, kind)
    try:
        master = node(tmp_path, "master", repo, "m", lease=30)
        wait_until(lambda: _ready(repo), "the master's first global", DEADLINE)
        w = node(tmp_path, "worker", repo, "w1", steps=24, seed=5)
        # the reader reads until it compared 100 pairs and saw 3 outer steps (the master publishes a round of
        # its own deltas every few polls until it is stopped, so publications happen while it reads)
        reader = _spawn("reader", repo, 100, 3, log=tmp_path / "reader.log")
        finish(w, tmp_path / "w1.log")
        reader.wait(timeout=DEADLINE + 30)
        text = (tmp_path / "reader.log").read_text()
        assert reader.returncode == 0, text[-2000:]
        stats = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
        assert stats["checks"] >= 100 and stats["distinct_steps"] >= 3, stats  # it did see publications
        (tmp_path / "stop").touch()
        finish(master, tmp_path / "m.log")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    if role == "node":
        r, repo, node_id, state_dir, stop, steps, fail_every, lease, seed, first, pause_at = rest
        proc_node(
            r,
            repo,
            node_id,
            state_dir,
            stop,
            int(steps),
            int(fail_every),
            float(lease),
            int(seed),
            int(first),
            int(pause_at),
        )
    else:
        proc_reader(rest[0], int(rest[1]), int(rest[2]))

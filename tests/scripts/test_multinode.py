"""Two nodes over loopback, for real (issue 31): `scripts/launch_node.sh --cpu --nodes 2 --node-rank R
--rdzv 127.0.0.1:<port>` started twice on this machine (gloo), as a user starts it on each node.

- A two-node run equals the same run on one node with as many ranks, for DDP and synchronous DiLoCo, with
  1 and 2 ranks per node: every logged value but the clocks, the final evaluation and every rank's final
  checkpoint, within 1e-6 (on CPU it is bit-identical; a wrong shard or average is off by far more).
- A node killed (SIGKILL to its launch's process group: bash, torchrun and, through the kernel, its ranks)
  makes the other exit within `distributed.timeout_seconds` with `error:` lines, not a hang or a traceback;
  both nodes run again resume from the last complete checkpoint exactly.
- Ctrl+C on one node (SIGINT to its process group, as a terminal sends it) stops both nodes with 130,
  every rank with its file in the checkpoint of the step they agreed on; run again, they resume exactly.
  The 1-rank-per-node runs are these interrupted ones: the resumed result is compared with one node's
  uninterrupted run, which checks the resume and the two nodes at once.

Node 0's torchrun hosts the c10d store on the --rdzv port, as on a cluster (node 1's launch waits until
it answers there). The port is one the kernel chose for a socket the test binds to 127.0.0.1:0 with
SO_REUSEADDR and keeps, never listening, for the whole launch: no other process is given that port (a plain
bind is refused, connect() skips bound ports), yet the store, which binds with SO_REUSEADDR too, can listen
on it. A port closed and handed over would be anyone's until node 0 binds it. Each node's terminal is a file of its own, printed (its tail) when an assertion
fails; waits are on files and exits, with deadlines. The step a run stops or dies at is wherever it is
when the signal lands, so the run after it is told where to end (train.max_steps = last checkpoint + 3)
and the reference is run to the same step.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diloco import checkpoint

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = {"ddp": "tiny/ddp_mx", "diloco": "tiny/diloco_fp32"}
RUN = {"ddp": "tiny-ddp-mx", "diloco": "tiny-diloco-fp32"}  # their run_name
SHAPE = [  # the micro model, a few steps of 4 sequences of 32 tokens; a checkpoint every 3 steps
    "data.seq_len=32",
    "eval.tokens=256",
    "train.batch_size=4",
    "train.micro_batch_size=1",
    "optim.warmup_steps=2",
    "train.log_every=1",
    "train.eval_every=0",
    "train.checkpoint_every=3",
    "train.progress=false",
    "wandb.mode=disabled",
]
LONG = ["train.max_steps=100000", "optim.total_steps=100000"]  # until a signal stops it
TIMEOUT = 30  # distributed.timeout_seconds of the runs a node is killed in (also their start-up's)
CLOCKS = ("seconds", "time", "utilization", "tokens_per_second")  # logged values that are not the math
# Not compared in a checkpoint: Python's `random` state, which the trainer neither seeds nor draws from
# (each process starts it from the OS). The data position is compared: resumed runs once wrote the start
# of the shard there when they checkpointed before reading a document (see SequenceStream).
NOT_MATH = ("/rng/python",)
TOL = 1e-6
START = 300  # seconds a launch may take to reach its first checkpoint or its end (2 shared cores)


def overrides(mode: str, ranks_per_node: int) -> list[str]:
    """DiLoCo: a worker per node (its ranks share the worker's batch through DDP), H=2."""
    extra = ["distributed.inner_steps=2", f"distributed.ranks_per_worker={ranks_per_node}"]
    return SHAPE + (extra if mode == "diloco" else [])


def held_port() -> socket.socket:
    """A port of 127.0.0.1 kept from every other process but node 0's store (see the module docstring)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


# ------------------------------------------------------------------------------------------ nodes
class Node:
    """One scripts/launch_node.sh in a session of its own, its terminal a file."""

    def __init__(self, label: str, args: list[str], terminal: Path, env_extra: dict | None = None):
        env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        env.update(env_extra or {})
        for k in ("NODE_RANK", "SLURM_NODEID", "RDZV_ENDPOINT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        for k in ("LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DILOCO_LAUNCHER_PID"):
            env.pop(k, None)
        self.label, self.terminal = label, terminal
        with open(terminal, "w") as out:
            self.proc = subprocess.Popen(
                ["scripts/launch_node.sh", *args],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)  # the whole launch: bash, tee, torchrun (the ranks die with it)

    def output(self) -> str:
        return self.terminal.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        return f"--- {self.label} ({self.terminal}):\n" + "\n".join(self.output().splitlines()[-lines:])


class Launch:
    """The nodes of one run: two over loopback (node 0 hosts the rendezvous) or a single one. Every node
    has `out_dir` (a shared filesystem), or node r its own `out_dir[r]`."""

    def __init__(self, out_dir, mode, nodes, ranks_per_node, extra: list[str], tag: str, env=None):
        dirs = out_dir if isinstance(out_dir, list) else [out_dir] * nodes
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        self.port = held_port() if nodes > 1 else None
        args = ["--experiment", EXPERIMENT[mode], "--cpu"]
        run = [f"launch.gpus_per_node={ranks_per_node}", *extra]
        if nodes == 1:
            self.nodes = [
                Node(
                    f"one node, {tag}",
                    [*args, "--", f"out_dir={dirs[0]}", *run],
                    dirs[0] / f"one-{tag}.terminal",
                    env,
                )
            ]
        else:
            rdzv = ["--nodes", "2", "--rdzv", f"127.0.0.1:{self.port.getsockname()[1]}"]
            self.nodes = [
                Node(
                    f"node {r}, {tag}",
                    [*args, *rdzv, "--node-rank", str(r), "--", f"out_dir={dirs[r]}", *run],
                    dirs[r] / f"node{r}-{tag}.terminal",
                    env,
                )
                for r in range(nodes)
            ]

    def __getitem__(self, rank: int) -> Node:
        return self.nodes[rank]

    def tails(self) -> str:
        return "\n".join(n.tail() for n in self.nodes)

    def wait(self, seconds: float, nodes: list[Node] | None = None) -> list[int]:
        deadline = time.monotonic() + seconds
        codes = []
        for n in nodes or self.nodes:
            try:
                codes.append(n.proc.wait(timeout=max(deadline - time.monotonic(), 0.01)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{n.label} still running {seconds:.0f} s on\n{self.tails()}")
        return codes

    def close(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.signal(signal.SIGKILL)
                n.proc.wait(timeout=30)
        if self.port is not None:
            self.port.close()


@pytest.fixture
def launches():
    started: list[Launch] = []

    def start(*args, **kwargs) -> Launch:
        started.append(Launch(*args, **kwargs))
        return started[-1]

    yield start
    for launch in started:
        launch.close()


def wait_for(predicate, what: str, launch: Launch, seconds: float = START):
    deadline = time.monotonic() + seconds
    while not (found := predicate()):
        if time.monotonic() > deadline or any(n.proc.poll() is not None for n in launch.nodes):
            pytest.fail(f"no {what} after {seconds:.0f} s, or a node ended first\n{launch.tails()}")
        time.sleep(0.1)  # polling a file; nothing waits on this for its order
    return found


def complete_checkpoint(run_dir: Path, after: int = 0):
    """The newest complete checkpoint past step `after`, else None."""
    latest = checkpoint.latest(run_dir)
    return latest if latest is not None and step_of(latest) > after else None


def step_of(ckpt: Path) -> int:
    return json.loads((ckpt / "meta.json").read_text())["step"]


# ------------------------------------------------------------------------------------------ results
def logged(run_dir: Path) -> dict[tuple[int, str], float]:
    """Every logged number of metrics.jsonl but the clocks, by (step, key)."""
    values = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, v in record.items():
            if key != "step" and isinstance(v, int | float) and not any(c in key for c in CLOCKS):
                values[record["step"], key] = v
    return values


def differences(got, want, path: str = "") -> list[str]:
    """Where two checkpoint states differ: tensors beyond TOL, anything else unequal (clocks excepted)."""
    if any(c in path for c in CLOCKS) or path.startswith(NOT_MATH):
        return []
    if isinstance(want, dict):
        if set(got) != set(want):
            return [f"{path}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"]
        return [d for k in want for d in differences(got[k], want[k], f"{path}/{k}")]
    if isinstance(want, list | tuple):
        if len(got) != len(want):
            return [f"{path}: length {len(got)} != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{path}[{i}]")]
    if torch.is_tensor(want):
        if got.shape != want.shape or got.dtype != want.dtype:
            return [f"{path}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"]
        if want.is_floating_point():
            gap = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
            return [f"{path}: max |diff| {gap:.3g}"] if gap > TOL else []
        return [] if torch.equal(got, want) else [f"{path}: differs"]
    if isinstance(want, float):
        return [] if math.isclose(got, want, rel_tol=TOL, abs_tol=TOL) else [f"{path}: {got!r} != {want!r}"]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def assert_same_run(got: Path, want: Path, world: int, why: str) -> None:
    """The run in `got` computed what the one in `want` did: every logged number, the final evaluation
    and every rank's final checkpoint."""
    g, w = logged(got), logged(want)
    assert g.keys() == w.keys(), f"{why}: logged {sorted(g.keys() ^ w.keys())[:10]} in one run only"
    off = [(k, g[k], w[k]) for k in w if not math.isclose(g[k], w[k], rel_tol=TOL, abs_tol=TOL)]
    assert not off, f"{why}: {len(off)} logged values differ, first {off[:5]}"
    assert any(key == "eval/loss" for _, key in w), "the runs end with an evaluation"
    sg, sw = (json.loads((d / "summary.json").read_text()) for d in (got, want))
    assert sg["status"] == sw["status"] == "completed" and sg["world_size"] == sw["world_size"] == world
    assert sg["final_eval_loss"] == pytest.approx(sw["final_eval_loss"], rel=TOL, abs=TOL), why
    cg, cw = checkpoint.latest(got), checkpoint.latest(want)
    assert step_of(cg) == step_of(cw) == sw["step"], why
    for rank in range(world):
        state = [torch.load(c / f"rank{rank}.pt", weights_only=True) for c in (cg, cw)]
        off = differences(*state)
        assert not off, f"{why}: rank {rank}'s final checkpoint differs: {off[:5]}"


def assert_readable_end(node: Node) -> None:
    """A node that lost its peer says so in `error:` lines: no traceback, no C++ frames, nothing but
    the run's own lines, torchrun's one-line warnings and the launcher's notes."""
    out = node.output()
    ours = re.compile(r"^(error: |note: |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ |[WI]\d{4} \d\d:\d\d:\d\d)")
    foreign = [line for line in out.splitlines() if line.strip() and not ours.match(line)]
    assert not foreign, f"{node.label} printed more than lines of its own: {foreign[:5]}\n{node.tail()}"
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors and all(len(e) < 600 for e in errors), node.tail()
    assert any("a peer rank died" in e or "rendezvous store" in e for e in errors), node.tail()


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("mode", ["ddp", "diloco"])
def test_two_nodes_of_two_ranks_compute_what_one_node_of_four_does(mode, tmp_path, launches):
    two = launches(tmp_path / "two", mode, 2, 2, [*overrides(mode, 2), "train.max_steps=6"], "run")
    one = launches(tmp_path / "one", mode, 1, 4, [*overrides(mode, 2), "train.max_steps=6"], "run")
    assert two.wait(START) == [0, 0], two.tails()
    assert one.wait(START) == [0], one.tails()
    run = RUN[mode]
    assert_same_run(tmp_path / "two" / run, tmp_path / "one" / run, 4, f"{mode}: 2 nodes x 2 ranks vs 1 x 4")

    # each node's terminal is in its log, after the command it ran (node 1 with its own node rank)
    for rank, node in enumerate(two.nodes):
        log = (tmp_path / "two" / run / f"launch-node{rank}.log").read_text()
        header, body = log.split("\n", 1)
        assert f"--nnodes 2 --nproc_per_node 2 --node_rank {rank} --rdzv-backend c10d" in header
        assert body == node.output(), node.tail()
    # global rank 0 (the run's last line) is on the node the c10d rendezvous sorts first (host, pid)
    assert sum(n.output().count("final eval perplexity") for n in two.nodes) == 1, two.tails()


# Where each run of test_kills_at_many_points is killed, in order; each run resumes from the last one's
# newest complete checkpoint. ("step", n): node n once the run has logged a step past a new checkpoint
# (mid-step: the all-reduce, the stop agreement, the log). ("pause", point, rank, whom): rank `rank` held
# at `point` of its first new checkpoint (kill_points/sitecustomize.py), then the node it runs on
# ("its") or the other ("other") killed and the held rank let go. The runs after a checkpoint
# begin from a packing stream's leftovers: the position bug this test found lived there.
KILLS = [
    ("step", 1),
    ("pause", "rank-file", 1, "its"),  # only rank 0's file of the new checkpoint written
    ("pause", "meta", 0, "its"),  # every file written, the checkpoint not marked complete
    ("pause", "prune", 0, "other"),  # marked complete, the old ones not yet pruned
    ("step", 0),  # the node with the rendezvous store
    ("pause", "rank-file", 0, "other"),
]
KILL_POINTS = Path(__file__).resolve().parent / "kill_points"


def node_of(pid: int, launch: Launch) -> Node:
    """The node whose launch started process `pid` (walking up its parents)."""
    by_pid = {n.proc.pid: n for n in launch.nodes}
    while pid > 1 and pid not in by_pid:
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return by_pid[pid]


def logged_past(run_dir: Path, step: int) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and any(
        json.loads(line)["step"] > step for line in metrics.read_text().splitlines() if line.endswith("}")
    )


def kill_once(kill: tuple, attempt: int, last: int, run_dir: Path, tmp_path: Path, launches) -> str:
    """One run of test_kills_at_many_points, killed where `kill` says; returns what happened."""
    long = [*overrides("ddp", 1), *LONG, f"distributed.timeout_seconds={TIMEOUT}"]
    env, folder = None, tmp_path / f"pause{attempt}"
    if kill[0] == "pause":
        folder.mkdir()
        spec = f"{kill[1]}:{kill[2]}:{last + 1}:{folder}"
        env = {
            "PYTHONPATH": f"{KILL_POINTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "DILOCO_TEST_PAUSE": spec,
        }
    launch = launches(tmp_path / "two", "ddp", 2, 1, long, f"attempt{attempt}", env)
    if kill[0] == "step":
        reached = wait_for(lambda: complete_checkpoint(run_dir, after=last), "new checkpoint", launch)
        wait_for(lambda: logged_past(run_dir, step_of(reached)), "step past it", launch)
        victim = launch[kill[1]]
    else:
        marker = wait_for(lambda: next(folder.glob("paused-*"), None), f"rank {kill[2]} at {kill[1]}", launch)
        held = node_of(int(marker.name.rsplit("launcher", 1)[1]), launch)
        victim = held if kill[3] == "its" else launch.nodes[1 - launch.nodes.index(held)]
    if attempt:  # the run went on from the last one's checkpoint
        said = "".join(n.output() for n in launch.nodes)
        assert f"resumed from {run_dir / 'checkpoints'}" in said, launch.tails()
    victim.signal(signal.SIGKILL)
    victim.proc.wait(timeout=30)
    if kill[0] == "pause":
        (folder / "go").touch()
    (survivor,) = [n for n in launch.nodes if n is not victim]
    (code,) = launch.wait(TIMEOUT + 30, [survivor])
    assert code == 2, f"{survivor.label} ended with {code}\n{launch.tails()}"
    assert_readable_end(survivor)
    return f"{kill}: {victim.label} killed, newest complete checkpoint {step_of(checkpoint.latest(run_dir))}"


def test_kills_at_many_points_resume_exactly(tmp_path, launches):
    """DDP, 2 nodes x 1 rank, killed at every point of KILLS in turn (steps, each part of a checkpoint
    write, either node); the run resumed after the last kill equals one node's uninterrupted run in every
    logged value, the final evaluation and every rank's final checkpoint (data position included). The
    survivor of each kill ends with `error:` lines, not a hang or a traceback."""
    run_dir = tmp_path / "two" / RUN["ddp"]
    last = 0
    for attempt, kill in enumerate(KILLS):
        print(f"\n[multinode] {kill_once(kill, attempt, last, run_dir, tmp_path, launches)}")
        now = step_of(checkpoint.latest(run_dir))
        assert now >= last, "a kill lost a complete checkpoint"
        last = now

    end = [*overrides("ddp", 1), "optim.total_steps=100000", f"train.max_steps={last + 3}"]
    final = launches(tmp_path / "two", "ddp", 2, 1, end, "final")
    one = launches(tmp_path / "one", "ddp", 1, 2, end, "reference")
    assert final.wait(START) == [0, 0], final.tails()
    assert one.wait(START) == [0], one.tails()
    why = f"ddp, 2 nodes x 1 rank killed {len(KILLS)} times and resumed vs 1 node x 2 ranks uninterrupted"
    assert_same_run(run_dir, tmp_path / "one" / RUN["ddp"], 2, why)


def test_ctrl_c_on_one_node_stops_both_with_130_and_a_checkpoint_and_both_resume(tmp_path, launches):
    """DiLoCo, 2 nodes x 1 rank, H=2: Ctrl+C on node 1 (not the store's host), node 0 stops with it."""
    mode = "diloco"
    run_dir = tmp_path / "two" / RUN[mode]
    launch = launches(tmp_path / "two", mode, 2, 1, [*overrides(mode, 1), *LONG], "stopped")
    wait_for(lambda: complete_checkpoint(run_dir), "checkpoint", launch)
    launch[1].signal(signal.SIGINT)  # what a terminal does: the whole foreground job
    assert launch.wait(START) == [130, 130], launch.tails()
    said = "".join(n.output() for n in launch.nodes)
    assert said.count("resume with the same command") == 1, launch.tails()
    assert "Traceback" not in said and "SignalException" not in said and "ChildFailedError" not in said
    stopped = int(re.search(r"stopped at step (\d+); resume", said).group(1))
    ckpt = checkpoint.latest(run_dir)
    assert step_of(ckpt) == stopped and (ckpt / "rank0.pt").exists() and (ckpt / "rank1.pt").exists()

    end = [*overrides(mode, 1), "optim.total_steps=100000", f"train.max_steps={stopped + 3}"]
    one = launches(tmp_path / "one", mode, 1, 2, end, "reference")
    # node 1 on a disk of its own sees no checkpoint (rank 0 alone writes meta.json): both refuse to mix
    # a resumed model with a fresh one, in one line each, and leave the run as it was
    apart = launches([tmp_path / "two", tmp_path / "node1-disk"], mode, 2, 1, end, "apart")
    assert apart.wait(START) == [2, 2], apart.tails()
    refusal = re.compile(
        rf"error: the ranks start at different steps \(ranks \[[01]\] at step 0; ranks \[[01]\] at step {stopped}\):"
        r" every node must see the same run folder \(out_dir on a shared filesystem\) to resume$"
    )
    for node in apart.nodes:
        errors = [line for line in node.output().splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and refusal.match(errors[0]), apart.tails()
    assert checkpoint.latest(run_dir) == ckpt

    final = launches(tmp_path / "two", mode, 2, 1, end, "resumed")
    assert final.wait(START) == [0, 0], final.tails()
    assert f"resumed from {ckpt} at step {stopped}" in "".join(n.output() for n in final.nodes), final.tails()
    assert one.wait(START) == [0], one.tails()
    why = "diloco, 2 nodes x 1 rank stopped by Ctrl+C and resumed vs 1 node x 2 ranks uninterrupted"
    assert_same_run(run_dir, tmp_path / "one" / RUN[mode], 2, why)

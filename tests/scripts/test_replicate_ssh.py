"""`make replicate-*` across nodes: diloco.experiments.run's ssh runner (scripts/replicate.py), with an `ssh` stand-in first on PATH.

The stand-in (written into the test's folder) is what ssh is to the runner: `ssh [-o ...] HOST COMMAND`
runs COMMAND for a host of its cluster, here, in a login-like environment of its own (its own HOME, a
system PATH, none of the caller's variables) with ssh's stdin passed through, and answers any other host,
or a host told to fail, as ssh does (one line, exit 255). The cluster is two "nodes" on this machine,
127.0.0.1 and 127.0.0.2 (both loopback), listed in a hosts file as a user lists theirs.

A family of two tiny runs then goes through the code a cluster run does (hosts file, the nodes' commands,
ssh, `scripts/launch_node.sh` on each node, torchrun's c10d rendezvous between the nodes): tiny/ddp_mx and
tiny/diloco_fp32, each on 2 nodes x 1 rank. The rendezvous store is the test's own, on a port the kernel
chose and the test keeps (torchrun's c10d backend joins an existing store as a client), so no port is
picked and released. A node that fails (the stand-in refuses 127.0.0.2) fails the family in one line
naming it, stops the node that did start (it would otherwise wait out the rendezvous), and starts no
further run. The DumbDiLoCo leg's node commands are checked as the runner builds them (a DumbDiLoCo
experiment's quorum waits for its 4 nodes; its launch_node.sh commands run in tests/scripts/test_launch_dumb.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from trainer_utils import compose_cfg

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_network")]

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ["127.0.0.1", "127.0.0.2"]  # both loopback: two "nodes" on this machine
RUNS = ["tiny/ddp_mx", "tiny/diloco_fp32"]  # the tiny family's order
STEPS = 50
OVERRIDES = [  # every run of the family, on every node (after `--`): 2 nodes, the micro run at seconds' size
    "launch.nodes=2",  # 2 DDP ranks, 2 DiLoCo workers (ranks_per_worker 1): one per node
    "launch.gpus_per_node=1",
    "data.seq_len=32",
    "train.batch_size=4",
    "train.micro_batch_size=2",
    f"train.max_steps={STEPS}",
    f"optim.total_steps={STEPS}",
    "optim.warmup_steps=5",
    "train.eval_every=0",
    "eval.tokens=1024",
    "wandb.mode=disabled",
]
DEADLINE = 540  # s: the family's longest (about a minute on 2 idle cores); past it a failure, never a synchronisation

STAND_IN = r"""#!/usr/bin/env bash
# ssh stand-in: ssh [-o OPTION | -flag]... HOST COMMAND
while [[ ${1:-} == -* ]]; do [[ $1 == -[oplFiJ] ]] && shift; shift; done
host=$1; shift
printf '%s\t%s\n' "$host" "$*" >> {log}
if ! grep -qxF -- "$host" {cluster}; then
  echo "ssh: Could not resolve hostname $host: Name or service not known" >&2; exit 255
fi
if grep -qxF -- "$host" {down}; then
  echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255
fi
home={homes}/$host; mkdir -p "$home"; cd "$home"
exec env -i HOME="$home" PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 OMP_NUM_THREADS=1 \
  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 bash -c "$*"
"""


def stand_in(tmp_path: Path, down: list[str] = ()) -> dict[str, str]:
    """Write the ssh stand-in and the hosts file; the environment that puts the stand-in first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "cluster").write_text("".join(f"{h}\n" for h in HOSTS))
    (tmp_path / "down").write_text("".join(f"{h}\n" for h in down))
    (tmp_path / "nodes.txt").write_text(
        "# node 0 first (the rendezvous)\n" + "".join(f"{h}\n" for h in HOSTS)
    )
    paths = {k: shlex.quote(str(tmp_path / k)) for k in ("cluster", "down", "homes")}
    script = STAND_IN.replace("{log}", shlex.quote(str(tmp_path / "ssh.log")))
    for k, v in paths.items():
        script = script.replace("{" + k + "}", v)
    (bin_dir / "ssh").write_text(script)
    (bin_dir / "ssh").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE", "RANK", "WORLD"))}
    return env | {"PATH": f"{bin_dir}:{env['PATH']}", "REPO_ID": str(tmp_path / "shared" / "repo")}


def replicate_cmd(tmp_path: Path, port: int, *extra: str) -> list[str]:
    """`make replicate-*`'s command for the two runs, on the hosts file's nodes."""
    return [
        sys.executable,
        "scripts/replicate.py",
        "--family",
        "tiny",
        "--only",
        *RUNS,
        "--hosts-file",
        str(tmp_path / "nodes.txt"),
        "--port",
        str(port),
        "--runs",
        str(tmp_path / "runs"),
        *(f"--override={o}" for o in [*OVERRIDES, *extra]),
    ]


def replicate(tmp_path: Path, env: dict[str, str], port: int) -> subprocess.CompletedProcess:
    cmd = replicate_cmd(tmp_path, port)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE)


def ssh_calls(tmp_path: Path) -> list[tuple[str, str]]:
    log = tmp_path / "ssh.log"
    return [tuple(line.split("\t", 1)) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def rendezvous():
    """A c10d store on 127.0.0.1 at a port the kernel chose, held for the test: both nodes' torchrun join it."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=60))
    yield store.port
    del store


@pytest.mark.timeout(600)
def test_a_family_of_two_runs_over_ssh_on_two_nodes(tmp_path, rendezvous):
    env = stand_in(tmp_path)
    done = replicate(tmp_path, env, rendezvous)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # each node ran the README's command for its part, and the second run started once the first was done
    calls = [(next(r for r in RUNS if f"--experiment {r} " in c), h, c) for h, c in ssh_calls(tmp_path)]
    assert [r for r, _, _ in calls] == [RUNS[0]] * 2 + [RUNS[1]] * 2
    runs = tmp_path / "runs"
    for name, first in ((RUNS[0], 0), (RUNS[1], 2)):
        by_host = {h: c for _, h, c in calls[first : first + 2]}
        assert sorted(by_host) == HOSTS
        run_dir = runs / compose_cfg([f"experiment={name}"]).run_name
        for rank, host in enumerate(HOSTS):
            launch = f"scripts/launch_node.sh --experiment {name} --cpu --node-rank {rank} --rdzv 127.0.0.1:{rendezvous}"
            assert f"{launch} -- out_dir={runs} launch.nodes=2" in by_host[host]
            log = (
                run_dir / f"launch-node{rank}.log"
            ).read_text()  # the node's own torchrun, joined to node 0
            assert (
                f"--nnodes 2 --nproc_per_node 1 --node_rank {rank} --rdzv-backend c10d" in log.splitlines()[0]
            )
        summary = json.loads((run_dir / "summary.json").read_text())
        assert (summary["status"], summary["step"], summary["world_size"]) == ("completed", STEPS, 2), name
    assert json.loads((runs / "tiny-diloco-fp32" / "summary.json").read_text())["num_workers"] == 2


def test_the_nodes_commands_of_a_dumb_diloco_run_and_the_hosts_file(tmp_path, monkeypatch):
    from diloco.experiments import run as replicate
    from diloco.experiments.plan import PlanError

    hosts = tmp_path / "nodes.txt"
    hosts.write_text("# GPU nodes, node 0 first\n gpu-a  # the master\n\ngpu-b\ngpu-c\ngpu-d\n")
    assert replicate.read_hosts(hosts) == ["gpu-a", "gpu-b", "gpu-c", "gpu-d"]
    monkeypatch.delenv("REPO_ID", raising=False)
    with pytest.raises(PlanError, match="tiny/dumb_diloco is a DumbDiLoCo run: set REPO_ID"):
        replicate.ssh_commands("tiny/dumb_diloco", replicate.read_hosts(hosts), 29500)
    monkeypatch.setenv("REPO_ID", "my-org/dumb-tiny")
    launches = replicate.ssh_commands(
        "tiny/dumb_diloco", replicate.read_hosts(hosts), 29500, ["seed=1"], cpu=True
    )
    for i, (node, host) in enumerate(zip(launches, ["gpu-a", "gpu-b", "gpu-c", "gpu-d"], strict=True)):
        role = "master" if i == 0 else "worker"
        assert node.host == host and node.log == f"runs/tiny-dumb-diloco-node-{i}/launch-node{i}.log"
        assert node.command.endswith(
            f"exec scripts/launch_node.sh --experiment tiny/dumb_diloco --cpu --role {role} --node-id node-{i} "
            f"--repo-id my-org/dumb-tiny --shard {i} -- seed=1 3<&-"
        ), node.command
    one_node = replicate.ssh_commands("tiny/ddp_1x", ["gpu-a"], 29500)  # no rendezvous: torchrun --standalone
    assert one_node[0].command.endswith("exec scripts/launch_node.sh --experiment tiny/ddp_1x 3<&-")
    with pytest.raises(PlanError, match="tiny/dumb_diloco needs 4 nodes; the hosts file lists 2"):
        replicate.ssh_commands("tiny/dumb_diloco", ["gpu-a", "gpu-b"], 29500)
    hosts.write_text("gpu-a\ngpu-b\ngpu-a\n")
    with pytest.raises(PlanError, match="lists gpu-a more than once"):
        replicate.read_hosts(hosts)


@pytest.mark.timeout(600)
def test_a_failed_node_stops_the_run_and_the_family_in_one_line(tmp_path, rendezvous):
    env = stand_in(tmp_path, down=[HOSTS[1]])
    done = replicate(tmp_path, env, rendezvous)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(
        f"error: tiny/ddp_mx failed on {HOSTS[1]}: ssh could not run it there (exit 255"
    ), errors
    assert f"the other nodes were stopped ({', '.join(h for h in HOSTS if h != HOSTS[1])})" in errors[0]
    assert "Traceback" not in done.stderr
    # node 0 had started its part and was stopped; the family's next run never reached a node
    assert sorted(h for h, _ in ssh_calls(tmp_path)) == HOSTS
    assert all(RUNS[1] not in c for _, c in ssh_calls(tmp_path))
    assert not (tmp_path / "runs" / "tiny-ddp-mx" / "summary.json").exists()


@pytest.mark.timeout(600)
def test_ctrl_c_stops_every_node_with_a_checkpoint(tmp_path, rendezvous):
    env = stand_in(tmp_path)
    long = ["train.max_steps=100000", "optim.total_steps=100000", "train.checkpoint_every=0"]
    out, err = (
        tmp_path / "replicate.out",
        tmp_path / "replicate.err",
    )  # files: a full pipe would stall the nodes
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(  # SIGINT ignored, as a script's background job (`make ... &`) starts it
            replicate_cmd(tmp_path, rendezvous, *long),
            cwd=ROOT,
            env=env,
            stdout=o,
            stderr=e,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
    metrics = tmp_path / "runs" / "tiny-ddp-mx" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + DEADLINE
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):  # both nodes are training
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached step 10"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # to the runner only: it must stop the nodes itself
        proc.wait(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err.read_text()
    assert proc.returncode == 130, out.read_text()[-2000:] + err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: stopped (Ctrl+C); the runs started were told to stop and checkpoint"
    ], err[-3000:]
    run_dir = tmp_path / "runs" / "tiny-ddp-mx"
    # both nodes' ranks finished the same step, wrote its checkpoint and said how to resume
    stopped = re.compile(r"stopped at step (\d+); resume with the same command")
    stops = [stopped.findall((run_dir / f).read_text()) for f in ("train.log", "train.rank1.log")]
    assert len(stops[0]) == 1 and stops[0] == stops[1], stops
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{int(stops[0][0]):08d}"]
    assert all(RUNS[1] not in c for _, c in ssh_calls(tmp_path))

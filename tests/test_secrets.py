"""Secrets are never written (issue 14, finding 3): a token given in the config or in the environment is
in no file a run produces and in nothing it sends to W&B.

One run as docs/dumb_diloco.md describes it: a DumbDiLoCo master and a worker, each started with
scripts/launch_node.sh (tiny/dumb_diloco on the CPU, cut to the micro model and 20 steps), over the
loopback Hub, with W&B on in offline mode so that it writes every file it would otherwise upload. The
master's token is an override on its command line (`-- distributed.token=...`, no HF_TOKEN); the
worker's is in HF_TOKEN. HOME, TMPDIR, HF_HOME and W&B's directories all lie under tmp_path, so
whatever the processes write lands there. Then every file under tmp_path (run directories, launch logs,
W&B's run files and logs, checkpoints, the master's state, caches, the processes' captured output),
every file the run wrote into the repository checkout, and every file of every commit in the Hub
repository is searched for either token, raw and base64-encoded.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wandb_files import complete_records

from diloco.testing.hub_server import HubServer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_network")]

ROOT = Path(__file__).resolve().parents[1]
CONFIG_TOKEN = "hf_PlantedConfigToken7Xq2Lm9Rt4Vw8Yz"  # the master's, on its command line
ENV_TOKEN = "hf_PlantedEnvToken3Kp6Nd1Sg5Hj0BcQ"  # the worker's, in HF_TOKEN
REPO = "secrets-org/run"
STEPS = 20
OVERRIDES = [
    "model=micro",
    "data.seq_len=64",
    "train.batch_size=4",
    "train.micro_batch_size=4",
    "train.log_every=5",
    "train.eval_every=0",
    "train.progress=false",
    "eval.tokens=1024",
    "optim.warmup_steps=2",
    f"optim.total_steps={STEPS}",
    f"train.max_steps={STEPS}",
    "wandb.mode=offline",
    "distributed.inner_steps=5",
    "distributed.poll_interval=0.2",
    "distributed.min_deltas_per_round=1",
    "distributed.drain_timeout=60",
    "distributed.startup_timeout=240",
    "distributed.shutdown_timeout=120",
]
DEADLINE = 300  # s


def needles(token: str) -> dict[bytes, str]:
    """The token's raw bytes and its base64 forms at each alignment (the characters that depend on the
    token alone), standard and URL-safe."""
    found = {token.encode(): "raw"}
    for pad in range(3):
        encoded = base64.b64encode(b"\0" * pad + token.encode())[4:-4]
        found[encoded] = "base64"
        found[encoded.replace(b"+", b"-").replace(b"/", b"_")] = "base64url"
    return found


def node_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    drop = ("HF_", "HUGGING_FACE", "WANDB_", "XDG_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    for k in ("NODE_RANK", "SLURM_NODEID", "RDZV_ENDPOINT", "ROLE", "NODE_ID", "REPO_ID", "SHARD", "RANK"):
        env.pop(k, None)
    dirs = {
        "HOME": "home",
        "TMPDIR": "tmp",
        "XDG_CACHE_HOME": "home/.cache",
        "XDG_CONFIG_HOME": "home/.config",
        "HF_HOME": "hf_home",
        "WANDB_CONFIG_DIR": "wandb_home/config",
        "WANDB_CACHE_DIR": "wandb_home/cache",
        "WANDB_DATA_DIR": "wandb_home/data",
        "WANDB_ARTIFACT_DIR": "wandb_home/artifacts",
    }
    for var, sub in dirs.items():
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(tmp_path / sub)
    env |= {
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return env | extra


def launch(tmp_path: Path, role: str, node_id: str, shard: int, env: dict, extra: list[str]):
    cmd = ["scripts/launch_node.sh", "--experiment", "tiny/dumb_diloco", "--cpu", "--nodes", "2"]
    cmd += ["--role", role, "--node-id", node_id, "--shard", str(shard), "--repo-id", REPO]
    cmd += ["--", f"out_dir={tmp_path / 'runs'}", *OVERRIDES, *extra]
    out = open(tmp_path / "logs" / f"{node_id}.out", "w")  # the processes' stdout and stderr
    # in its own process group, so that a failed test can end the launcher and the run it started
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    return proc, out


def written_files(tmp_path: Path, since: float) -> dict[str, bytes]:
    """Every file under tmp_path, and every file under the checkout (but .git and .venv) written since
    `since`: the run might write into its working directory."""
    files = {str(p): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in (".git", ".venv")]
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_file() and p.stat().st_mtime >= since and tmp_path not in p.parents:
                files[str(p)] = p.read_bytes()
    return files


def test_no_token_from_the_config_or_the_environment_is_in_any_file_a_run_writes(tmp_path):
    (tmp_path / "logs").mkdir()
    t0 = time.time() - 1
    with HubServer(token={CONFIG_TOKEN, ENV_TOKEN}) as server:  # refuses a request with neither
        master_env = node_env(tmp_path, HF_ENDPOINT=server.url)  # no HF_TOKEN: the config's token
        worker_env = node_env(tmp_path, HF_ENDPOINT=server.url, HF_TOKEN=ENV_TOKEN)
        nodes = [
            (
                "master-1",
                *launch(tmp_path, "master", "master-1", 0, master_env, [f"distributed.token={CONFIG_TOKEN}"]),
            ),
            ("worker-1", *launch(tmp_path, "worker", "worker-1", 1, worker_env, [])),
        ]
        try:
            for name, proc, out in nodes:
                proc.wait(timeout=DEADLINE)
                out.close()
                text = (tmp_path / "logs" / f"{name}.out").read_text()
                assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{text[-4000:]}"
        finally:
            for _, proc, _ in nodes:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        commits = [c.files for c in server.repos[REPO].commits.values()]
        head = server.snapshot(REPO)

    # The run did what it should, so each token was used: the master's commits (the global, the
    # published master state) carried the config's, the worker's deltas HF_TOKEN's; no token file existed.
    assert {"global/latest.safetensors", "global/step_count.json", "global/ledger.json"} <= set(head)
    assert any(p.startswith("nodes/worker-1/") for c in commits for p in c), sorted(head)
    assert not (tmp_path / "hf_home" / "token").exists()
    runs = tmp_path / "runs"
    for name in ("master-1", "worker-1"):
        run_dir = runs / f"tiny-dumb-diloco-{name}"
        assert list(run_dir.glob("launch-node*.log")), sorted(run_dir.iterdir())
        # W&B was on: its run file is complete, with the history, the config and the program's arguments
        (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
        records = {}
        for r in complete_records(wandb_file):
            records.setdefault(r.WhichOneof("record_type"), []).append(r)
        assert {"run", "history", "environment", "output_raw"} <= set(records), sorted(records)
        if name == "master-1":  # ... both of which held the config's token (the search below: redacted)
            config = {i.key: json.loads(i.value_json) for i in records["run"][0].run.config.update}
            assert config["distributed"]["token"]
            args = [a for r in records["environment"] for a in r.environment.args]
            assert [a for a in args if a.startswith("distributed.token=")], args

    files = written_files(tmp_path, t0)
    for i, snapshot in enumerate(commits):
        files |= {f"hub commit {i}: {path}": data for path, data in snapshot.items()}
    leaks = [
        f"{path}: {which} token ({form})"
        for path, data in sorted(files.items())
        for which, token in (("config", CONFIG_TOKEN), ("environment", ENV_TOKEN))
        for needle, form in needles(token).items()
        if needle in data
    ]
    assert not leaks, f"a token was written ({len(files)} files searched):\n" + "\n".join(leaks)

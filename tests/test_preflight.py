"""Mistakes that are not config keys (issue 52), each one line and exit 2 before anything is written: a run
folder of another node, role or run; an unknown experiment or model; an out_dir or a repository that
cannot be written; a relative path read as a Hub id. And two DumbDiLoCo nodes started on one machine as
the README and docs print them get a run folder each."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_utils import SMALL, compose_cfg, train

from diloco import preflight
from diloco.config import ConfigError, validate

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("no_network")


def _trainer(
    *args: str, cwd: Path, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diloco.train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "WANDB_MODE": "disabled", **(env or {})},
    )


def _one_line(p: subprocess.CompletedProcess) -> str:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-2000:]
    return lines[0]


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------ one run folder per run


def test_a_run_folder_of_another_run_is_refused_and_left_as_it_was(tmp_path):
    first = train(tmp_path, "train.max_steps=2", name="r")
    before = _snapshot(first)
    for other, key in (("seed=7", "seed"), ("distributed=diloco", "distributed.mode")):
        cfg = validate(compose_cfg([*SMALL, f"out_dir={tmp_path}", "run_name=r", "train.max_steps=2", other]))
        with pytest.raises(ConfigError, match=rf"run folder .*r belongs to another run \({re.escape(key)}="):
            preflight.check_run_folder(cfg, first)
    # a longer schedule is the same run: it resumes
    train(tmp_path, "train.max_steps=3", "optim.total_steps=20", name="r")
    assert _snapshot(first).keys() >= before.keys()


def test_a_dumb_diloco_nodes_run_folder_carries_its_node_id():
    base = ["distributed=dumb_diloco", "distributed.repo_id=./shared", "run_name=tiny-dumb-diloco"]
    master = validate(compose_cfg([*base, "distributed.role=master", "distributed.node_id=node-0"]))
    worker = validate(compose_cfg([*base, "distributed.role=worker", "distributed.node_id=node-1"]))
    assert (master.run_name, worker.run_name) == ("tiny-dumb-diloco-node-0", "tiny-dumb-diloco-node-1")
    # launch_node.sh's names already carry it; role single is no node
    named = validate(compose_cfg([*base, "run_name=x-node-1", "distributed.node_id=node-1"]))
    single = validate(compose_cfg([*base, "distributed.role=single", "distributed.node_id=node-1"]))
    assert (named.run_name, single.run_name) == ("x-node-1", "tiny-dumb-diloco")


def printed_commands(path: Path) -> list[list[str]]:
    """Every `python -m diloco.train ...` command of a file's bash blocks, continuation lines joined and
    comments dropped, as argument lists after the module."""
    text = path.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    joined = "\n".join(blocks).replace("\\\n", " ")
    lines = [line.split("#")[0].split() for line in joined.splitlines()]
    return [words[3:] for words in lines if words[:3] == ["python", "-m", "diloco.train"]]


def node_commands() -> list[list[str]]:
    """The README's two DumbDiLoCo commands (a master, a worker), which the docs print for every node."""
    readme = [c for c in printed_commands(ROOT / "README.md") if "distributed=dumb_diloco" in c]
    docs = [c for c in printed_commands(ROOT / "docs" / "dumb_diloco.md") if "distributed=dumb_diloco" in c]
    assert len(readme) == 2 and readme == docs[:2], (readme, docs)
    return readme


def test_the_printed_commands_run_two_nodes_on_one_machine_each_in_its_own_folder(tmp_path):
    """The README's master and worker commands exactly as printed, in one folder of one machine, with a
    shared directory for the repository (docs: "the same commands with distributed.repo_id=<a path>") and
    the tiny family's model and data after them (experiment=tiny/dumb_diloco: the run name the issue's two
    nodes shared). Each node writes its own folder, config and summary; nothing is shared."""
    import yaml

    out, repo = tmp_path / "runs", tmp_path / "shared"
    tiny = [
        "experiment=tiny/dumb_diloco",
        "device=cpu",
        f"out_dir={out}",
        "distributed.min_deltas_per_round=1",
        "distributed.install_wait_seconds=0",
        "distributed.poll_interval=0.1",
        "distributed.drain_timeout=60",
        "distributed.shutdown_timeout=30",
        "distributed.inner_steps=5",
        "train.max_steps=10",
        "optim.total_steps=10",
        "optim.warmup_steps=2",
        "train.eval_every=0",
        "eval.tokens=2048",
    ]
    commands = [[a.replace("my-org/my-run", str(repo)) for a in c] + tiny for c in node_commands()]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "diloco.train", *c],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "WANDB_MODE": "disabled"},
        )
        for c in commands
    ]
    logs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    for role, node in (("master", "node-0"), ("worker", "node-1")):
        run = out / f"tiny-dumb-diloco-{node}"
        recorded = yaml.safe_load((run / "config.yaml").read_text())
        assert (recorded["distributed"]["role"], recorded["distributed"]["node_id"]) == (role, node)
        assert recorded["run_name"] == run.name and (run / "summary.json").exists()
    assert not (out / "tiny-dumb-diloco").exists()


# ------------------------------------------------------------------------------ names the command line gives


@pytest.mark.parametrize(
    ("arg", "want"),
    [
        ("experiment=150m/diloco_8w_h5000", "did you mean experiment=150m/diloco_8w_h500?"),
        ("model=150n", "did you mean model=150m?"),
    ],
)
def test_an_unknown_experiment_or_model_is_one_line_listing_them_all(tmp_path, arg, want):
    line = _one_line(_trainer(arg, cwd=tmp_path))
    group = arg.split("=")[0]
    assert want in line and f"the {group} options are:" in line
    assert "tiny/dumb_diloco" in line or "ladder_ne33k" in line  # the sub-folders' files too
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------ places on this machine


def test_a_read_only_out_dir_is_one_line(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere; a file in the way stands for it
        (tmp_path / "ro").write_text("")
        line = _one_line(_trainer(*SMALL, f"out_dir={tmp_path / 'ro'}", cwd=tmp_path))
        assert f"out_dir={tmp_path / 'ro'}: {tmp_path / 'ro'} is a file" in line
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        line = _one_line(_trainer(*SMALL, f"out_dir={tmp_path / 'ro'}", cwd=tmp_path))
        assert "is not writable: choose a writable out_dir" in line


def test_an_unwritable_out_dir_is_refused_before_anything(tmp_path, monkeypatch):
    place = tmp_path / "ro"
    place.mkdir()
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != place)  # as for a user without the right
    with pytest.raises(ConfigError, match="is not writable: choose a writable out_dir"):
        preflight.check_writable(place, place / "run")


@pytest.mark.parametrize("role", ["master", "worker"])
def test_a_repository_that_is_a_file_is_one_line_at_once(tmp_path, role):
    afile = tmp_path / "afile"
    afile.write_text("not a repository")
    args = [*SMALL, f"out_dir={tmp_path / 'runs'}", "distributed=dumb_diloco", f"distributed.role={role}"]
    args += ["distributed.node_id=n0", f"distributed.repo_id={afile}", "distributed.startup_timeout=600"]
    line = _one_line(_trainer(*args, cwd=tmp_path, timeout=60))  # a worker once waited 600 s for it
    assert f"distributed.repo_id={afile} is a file; a shared-directory repository is a folder" in line
    assert not (tmp_path / "runs").exists()


def test_a_relative_path_read_as_a_hub_id_says_so(tmp_path):
    (tmp_path / "runs").mkdir()
    args = [
        *SMALL,
        "out_dir=out",
        "distributed=dumb_diloco",
        "distributed.role=master",
        "distributed.node_id=n0",
    ]
    env = {"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf")}  # no token, none stored
    line = _one_line(_trainer(*args, "distributed.repo_id=runs/shared", cwd=tmp_path, env=env, timeout=60))
    assert "read as a Hugging Face Hub repository id" in line and "write ./runs/shared" in line
    # not a path here either, and no token: the same advice, at once (it retried for 105 s)
    (tmp_path / "runs").rmdir()
    line = _one_line(_trainer(*args, "distributed.repo_id=runs/shared", cwd=tmp_path, env=env, timeout=60))
    assert (
        "no Hub token is set (HF_TOKEN, `hf auth login` or distributed.token)" in line
        and "./runs/shared" in line
    )
    assert not (tmp_path / "out").exists()


def test_a_hub_repository_out_of_reach_is_one_line_at_once(tmp_path):
    """A worker given a Hub id with no Hub to reach retried for minutes; now one TCP connection decides
    (here a loopback port nothing listens on)."""
    args = [
        *SMALL,
        "out_dir=out",
        "distributed=dumb_diloco",
        "distributed.role=worker",
        "distributed.node_id=n1",
    ]
    env = {"HF_TOKEN": "hf_NotARealTokenForThisTest0000", "HF_ENDPOINT": "http://127.0.0.1:9"}
    line = _one_line(_trainer(*args, "distributed.repo_id=my-org/my-run", cwd=tmp_path, env=env, timeout=60))
    assert (
        "distributed.repo_id=my-org/my-run is a Hugging Face Hub repository and 127.0.0.1:9 is unreachable"
        in line
    )
    assert not (tmp_path / "out").exists()


def test_launch_node_refuses_an_out_dir_it_cannot_write_in_one_line(tmp_path):
    """Through scripts/launch_node.sh the same mistake was a bare `mkdir: cannot create directory`."""
    (tmp_path / "afile").write_text("")
    out = subprocess.run(
        [
            "bash",
            "scripts/launch_node.sh",
            "--experiment",
            "demo",
            "--cpu",
            "--",
            f"out_dir={tmp_path / 'afile'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("launch_node.sh: error: out_dir=") and "is a file" in lines[0]

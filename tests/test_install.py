"""The project works installed from a wheel, not only from this checkout.

A wheel is built from a copy of the project (offline: no build isolation, no index), installed with
--no-deps into a folder of its own, and run from an empty directory outside the repository with that
folder first on PYTHONPATH, so it, not the editable install of .venv, provides `diloco`; the
dependencies come from the running venv. Hydra must find the configs inside the installed package
(diloco.configs) and the `${diloco_asset:...}` paths must point into it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site folder holding only the installed wheel, the wheel's path)."""
    tmp = tmp_path_factory.mktemp("install")
    proj = tmp / "proj"
    proj.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, proj / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "local")
    shutil.copytree(ROOT / "src", proj / "src", ignore=ignore)
    shutil.copytree(ROOT / "configs", proj / "configs", ignore=ignore)
    # a user's git-ignored machine-local files must neither break the build nor ship
    (proj / "configs" / "local").mkdir()
    (proj / "configs" / "local" / "nodes.txt").write_text("gpu-node-0\n")
    (proj / "configs" / "local" / "mine.yaml").write_text("secret: 1\n")

    dist = tmp / "dist"
    pip = [sys.executable, "-m", "pip"]
    r = _run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(proj)],
        tmp,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = dist.glob("diloco-*.whl")
    site = tmp / "lib" / "site"  # site/diloco/../../configs does not exist: no source-relative config path
    r = _run([*pip, "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)], tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    return site, wheel


def _env(site: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(site), WANDB_MODE="disabled", HYDRA_FULL_ERROR="1")
    env.pop("PYTHONHOME", None)
    return env


def test_wheel_holds_the_configs_and_assets_but_not_local_files(installed):
    _, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "diloco/train.py",
        "diloco/configs/__init__.py",
        "diloco/configs/config.yaml",
        "diloco/configs/experiment/demo.yaml",
        "diloco/configs/experiment/150m/diloco_8w_h500.yaml",
        "diloco/configs/model/micro.yaml",
        "diloco/assets/sample/tokenizer/tokenizer.json",
        "diloco/assets/sample/c4-validation.00000-of-00001.json.gz",
        "diloco/assets/mistral-7b-v0.1/tokenizer.model",
        "diloco/assets/mistral-7b-v0.1/tokenizer.json",
        "diloco/assets/mistral-7b-v0.1/tokenizer_config.json",
    ):
        assert expected in names, expected
    # pyproject lists the packages explicitly (diloco.configs lives outside src/): a new subpackage
    # left out of that list would be missing here
    modules = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src" / "diloco").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    repo_configs = {p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*.yaml")}
    shipped = {n.replace("diloco/configs/", "configs/", 1) for n in names if n.startswith("diloco/configs/")}
    assert {p for p in repo_configs if not p.startswith("configs/local/")} <= shipped
    assert not [n for n in names if "/local/" in n]


def test_installed_package_runs_from_outside_the_repository(installed, tmp_path):
    site, _ = installed
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = _env(site)
    py = [sys.executable, "-m", "diloco.train", "--cfg", "job"]

    r = _run(
        [
            sys.executable,
            "-c",
            "import diloco, diloco.configs; print(diloco.__file__); print(diloco.configs.__file__)",
        ],
        cwd,
        env,
    )
    assert r.returncode == 0, r.stderr
    for line in r.stdout.split():
        assert Path(line).is_relative_to(site), f"imported {line}, not the installed wheel under {site}"

    r = _run(py, cwd, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "run_name:" in r.stdout and "model:" in r.stdout

    r = _run([*py, "--resolve", "experiment=demo"], cwd, env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "run_name: demo" in r.stdout
    tokenizer = next(line.split(":", 1)[1].strip() for line in r.stdout.splitlines() if "tokenizer:" in line)
    assert Path(tokenizer).is_relative_to(site), tokenizer  # ${diloco_asset:...} points into the wheel
    assert (Path(tokenizer) / "tokenizer.json").is_file()
    assert not (cwd / "runs").exists() and not (cwd / "outputs").exists()

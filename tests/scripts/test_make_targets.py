"""Every documented command still runs, up to the point where it would start working: each make target's
recipe (`make -n`, with its variables at their defaults and set) and each command of the README is
parsed by the real program it calls. A script's command line goes through its own argparse parser (an
option it no longer has fails here), a training command's overrides compose into a config that
`validate` accepts, and a shell script or make target it names exists. Nothing is trained or measured.
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.config import validate
from diloco.experiments.plan import compose_overrides

ROOT = Path(__file__).resolve().parents[2]
PY = ".venv/bin/python"
VARIANTS = {"defaults": [], "set": ["DRY_RUN=1", "SMOKE=1", "FORCE=1", "OUT=/tmp/out", "N=2"]}
SKIPPED_MODULES = {"pytest", "ruff", "pip", "venv"}  # tools, not this repository's commands


class Parsed(Exception):
    """Raised in place of running a script once its parser accepted the command line."""


def targets() -> list[str]:
    """The targets `make help` lists (the `## ` comment after a rule), but `clean` and `lock`."""
    found = re.findall(r"^([a-z0-9-]+):[^\n]*##", (ROOT / "Makefile").read_text(), re.M)
    return [t for t in found if t not in {"clean", "lock", "help"}]


def recipe(target: str, variables: list[str]) -> str:
    """The shell text `make <target>` would run, set-up prerequisites taken as done."""
    cmd = ["make", "-n", "-o", "setup", "-o", ".venv/.installed", "-o", "lint", target, *variables]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def expand_loops(text: str) -> str:
    """`for x in a b; do body; done` as the bodies with each value in place of `$x`."""
    loop = re.compile(r"for (\w+) in ([^;]+); do (.*?); done")

    def unrolled(m: re.Match) -> str:
        var, values, body = m.group(1), m.group(2).split(), m.group(3)
        return "; ".join(body.replace(f"${var}", v) for v in values)

    return loop.sub(unrolled, text)


def commands(text: str) -> list[list[str]]:
    """Each simple command of a shell text, as words, environment assignments dropped."""
    out = []
    for part in re.split(r"\n|;|&&|\|\|", expand_loops(text)):
        words = shlex.split(part.split(" 2>")[0].split(" >")[0])
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words and words[0] not in {"set", "echo", "exit", "true"}:
            out.append(words)
    return out


def parse_script(script: Path, argv: list[str], monkeypatch) -> argparse.Namespace:
    """Run `script` until its parser has read `argv`: the namespace, or the parser's own SystemExit."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(Parsed) as parsed:
        runpy.run_path(str(script), run_name="__main__")
    return parsed.value.args[0]


def hydra_overrides(args: list[str]) -> list[str]:
    """A training command's overrides, Hydra's own flags (`--help`, `--cfg job`) dropped."""
    out, skip = [], False
    for a in args:
        if not skip and not a.startswith("-"):
            out.append(a)
        skip = a in {"--cfg", "-c", "--package", "-p", "--info", "-i"}
    return out


def check_command(words: list[str], monkeypatch) -> str:
    """One command checked as its program would read it; a word saying which program that was."""
    if words[0] in {PY, "python", "python3"}:
        words = words[1:]
        if words[0] == "-m":
            module, args = words[1], words[2:]
            if module in SKIPPED_MODULES:
                return "tool"
            assert module == "diloco.train", words
            validate(compose_overrides(hydra_overrides(args)))
            return "train"
        script = ROOT / words[0]
        assert script.is_file(), f"{words[0]} does not exist"
        parse_script(script, words[1:], monkeypatch)
        return "script"
    if words[0] == "make":
        assert [t for t in words[1:] if "=" not in t], words
        for t in (t for t in words[1:] if "=" not in t):
            recipe(t, [w for w in words[1:] if "=" in w])
        return "make"
    if words[0].startswith("scripts/"):
        assert (ROOT / words[0]).is_file(), f"{words[0]} does not exist"
        return "shell"
    return "other"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("target", targets())
def test_a_make_target_runs_up_to_its_work(target, variant, monkeypatch):
    kinds = [check_command(w, monkeypatch) for w in commands(recipe(target, VARIANTS[variant]))]
    assert kinds, f"make {target}: no command"


def readme_commands() -> list[str]:
    """The README's shell lines that run this repository's commands (make, python scripts/, -m diloco)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```(?:bash|sh|shell|console)?\n(.*?)^```", text, re.M | re.S)
    lines = [line.split(" #")[0].strip() for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    lines += re.findall(
        r"`(make [^`]*|(?:python )?scripts/[^`\s]+ [^`]*)`", text
    )  # inline, a script with arguments
    lines = ["python " + x if re.match(r"scripts/\S+\.py", x) else x for x in lines]
    wanted = ("make ", "python scripts/", "python -m diloco.train")
    return sorted({x for x in lines if x.startswith(wanted) and "<" not in x and "..." not in x})


def test_the_readme_names_commands():
    assert len(readme_commands()) >= 5


def test_an_option_a_script_lacks_fails_the_check(monkeypatch):
    with pytest.raises(SystemExit):
        check_command([PY, "scripts/report.py", "--family", "tiny", "--no-such-option"], monkeypatch)
    assert check_command([PY, "scripts/report.py", "--family", "tiny"], monkeypatch) == "script"


@pytest.mark.parametrize("line", readme_commands())
def test_a_readme_command_runs_up_to_its_work(line, monkeypatch):
    for words in commands(line):
        check_command(words, monkeypatch)


# ------------------------------------------------------------------------------ what the docs promise


def _minutes(text: str) -> int | None:
    m = re.search(r"(?:about |~)(\d+) min", text)
    return int(m.group(1)) if m else None


def test_make_help_and_the_readme_give_a_target_the_same_time():
    """A target's time in `make help` (its `## ` comment) and in a README line that names `make <target>`
    with a time agree (issue 52: test 15 vs 21 minutes, ladder 65 vs 40, tune-tiny 40 vs 50)."""
    helps = dict(re.findall(r"^([a-z0-9-]+):[^\n]*## ([^\n]*)", (ROOT / "Makefile").read_text(), re.M))
    readme = (ROOT / "README.md").read_text().replace("\n", " ")
    compared = 0
    for target, text in helps.items():
        ours = _minutes(text)
        for m in re.finditer(rf"`make {re.escape(target)}`[^`]{{0,80}}?(?:about |~)(\d+) min", readme):
            assert ours is not None and int(m.group(1)) == ours, (target, ours, m.group(0))
            compared += 1
    assert compared >= 3


def test_every_path_the_docs_link_exists():
    """Relative links of README.md and docs/*.md name files of the repository (issue 52: the docs cited
    the specification at a path outside it)."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links {target}, which does not exist"

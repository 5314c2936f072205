"""Issue 12 ("Bounded memory"): the model-sized CPU buffers a DumbDiLoCo worker node holds around a v2
boundary (asynchronous upload and poll).

A master node (a separate process that only runs its outer loop: quorum 1, outer lr 0.7, Nesterov 0.9)
and one worker share a directory repository in /dev/shm. The worker's model is `--params` float32
parameters on the CPU (a transformer-like layout of 4 MB matrices). Its "inner steps" add a small
perturbation to every parameter; every `inner_steps` (4) steps is a boundary: snapshot, subtraction,
encoding and upload on the upload lane, the poll, the install. Each case is a fresh process:

- `replace`: the specification's node (install: replace, at boundaries);
- `translate`: the paper-scale configs' node (install: translate, install_when_staged, no wait);
- `translate+wait`: the tiny and GPU families' node (the same, install_wait_seconds 10).

After two warm-up rounds the worker runs `--rounds` measured rounds; each waits (untimed, outside the
boundary) until the global with its delta is staged, so every boundary sees the steady state of a
node whose master keeps up. The figure: the process's peak resident memory (VmHWM, reset through
/proc/self/clear_refs after the warm-up) above its resident memory with only the model built, in
model-sized buffers (params x 4 bytes). The live model is not counted (on a GPU node it is on the GPU).
glibc's mmap threshold is fixed at 64 KiB in the children (MALLOC_MMAP_THRESHOLD_), so a freed tensor
returns its pages at once and the peak counts live buffers only. Target: <= 3 for each case.

    python scripts/bench_node_memory.py --label after          # 33.6M parameters (134 MB), ~2 minutes
    python scripts/bench_node_memory.py --tiny --out /tmp/x
    # before/after: as bench/aggregation.py says (this folder copied into the older checkout's src/diloco)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import diloco
from diloco.bench import common as bc
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import Settings
from diloco.dumb_diloco.store.transport import DirectoryTransport

TARGET = 3.0
H = 4
MiB = 2**20
CASES = {
    "replace": {"install": "replace"},
    "translate": {"install": "translate", "install_when_staged": True},
    "translate+wait": {"install": "translate", "install_when_staged": True, "install_wait_seconds": 10.0},
}


def shapes(params: int) -> dict[str, tuple[int, ...]]:
    width = 1024
    mats = max(1, params // (width * width))
    return {"norm.weight": (width,)} | {f"layers.{i}.weight": (width, width) for i in range(mats)}


class Params(torch.nn.Module):
    def __init__(self, layout):
        super().__init__()
        self.params = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.full(s, 0.01)) for s in layout.values()]
        )


def _status_mib(field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024


def _settings(role: str, node_id: str, root: Path, **kw) -> Settings:
    return Settings(
        role=role,
        node_id=node_id,
        repo_id=str(root / "repo"),
        state_dir=str(root / "state"),
        inner_steps=H,
        poll_interval=0.05,
        min_deltas_per_round=1,
        outer_lr=0.7,
        outer_momentum=0.9,
        startup_timeout=60.0,
        shutdown_timeout=120.0,
        publish_hf_config=False,
        **kw,
    )


def run_master(root: Path, params: int) -> None:
    """The master's node: publishes global 0, then only runs its outer loop until `stop` appears."""
    node = DumbDiLoCo(
        Params(shapes(params)), _settings("master", "master", root), DirectoryTransport(root / "repo")
    )
    node.start()
    (root / "master-ready").touch()
    deadline = time.monotonic() + 600
    while not (root / "stop").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    node.close()


def run_worker(root: Path, params: int, case: str, rounds: int) -> None:
    layout = shapes(params)
    model = Params(layout)
    with torch.no_grad():
        torch._foreach_add_(list(model.parameters()), 0.0)
    gc.collect()
    rss_model = _status_mib("VmRSS")
    s = _settings("worker", "worker-1", root, **CASES[case])
    node = DumbDiLoCo(model, s, DirectoryTransport(root / "repo"))
    node.start()
    params_list, step = list(model.parameters()), 0
    for r in range(2 + rounds):
        if r == 2:
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        for _ in range(H):
            with torch.no_grad():
                torch._foreach_add_(params_list, 1e-4 * step)  # stands in for an inner step (unique deltas)
            step += 1
            node.on_step(step)
        deadline = time.monotonic() + 60  # untimed: the master includes this delta and the poll stages it
        while time.monotonic() < deadline and not _has_global(node, r + 1):
            time.sleep(0.02)
            node.collect()
            if not node.poller.in_flight:
                node.poll()
    peak = _status_mib("VmHWM")
    model_mib = sum(torch.Size(x).numel() for x in layout.values()) * 4 / MiB
    node.close()
    print(
        json.dumps(
            {
                "case": case,
                "rss_model_mib": rss_model,
                "peak_mib": peak,
                "model_mib": model_mib,
                "buffers": (peak - rss_model) / model_mib,
                "installs": node.counters.installs,
            }
        )
    )


def _has_global(node: DumbDiLoCo, outer_step: int) -> bool:
    staged = node.installer.staged
    return (
        not node.uploader.uploading
        and max(node.installer.outer_step, staged.outer_step if staged else -1) >= outer_step
    )


def main(argv=None) -> int:
    p = bc.parser(__doc__.splitlines()[0], repeats=3, warmup=0)
    p.add_argument("--params", type=int, default=33_554_432, help="float32 parameters of the model")
    p.add_argument("--label", default="after", help="the key of this run in node_memory.json")
    p.add_argument(
        "--code-commit", default=None, help="the commit of the diloco code measured (default HEAD)"
    )
    p.add_argument("--child", choices=["master", *CASES], help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = bc.finish_args(p.parse_args(argv))
    if args.tiny:
        args.params = 2 * 2**20
    if args.child == "master":
        run_master(args.root, args.params)
        return 0
    if args.child:
        run_worker(args.root, args.params, args.child, args.repeats)
        return 0
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    rows = []
    for case in CASES:
        with tempfile.TemporaryDirectory(prefix="bench_node_memory_", dir="/dev/shm") as tmp:
            root = Path(tmp)
            base = [
                sys.executable,
                "-m",
                "diloco.bench.node_memory",
                "--root",
                tmp,
                "--params",
                str(args.params),
            ]
            master = subprocess.Popen([*base, "--child", "master"], env=env)
            try:
                deadline = time.monotonic() + 120
                while not (root / "master-ready").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                out = subprocess.run(
                    [*base, "--child", case, "--repeats", str(args.repeats)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=600,
                ).stdout
            finally:
                (root / "stop").touch()
                master.wait(timeout=120)
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1])
    record = {
        "date": bc.utc_now(),
        "command": bc.command_line(),
        "bench_commit": bc.commit(),
        "code_commit": args.code_commit or bc.commit(),
        "diloco_source": str(Path(diloco.__file__).parent),
        "machine": bc.machine(),
        "rows": rows,
    }
    runs = bc.write_labelled(args.out, "node_memory", args.label, record, report)
    print(report(runs))
    return 0


def report(runs: dict[str, dict]) -> str:
    lines = [
        "# A DumbDiLoCo worker's model-sized CPU buffers around a v2 boundary (issue 12)",
        "",
        "Written by `scripts/bench_node_memory.py` (its docstring says what is measured): peak resident",
        "memory over 3 rounds above the process with only the model built, in model-sized float32 buffers.",
        f"Target: <= {TARGET:g} in each case.",
        "",
        "| label | code_commit | params_m | " + " | ".join(CASES) + " |",
        "|---|---|---|" + "---|" * len(CASES),
    ]
    for label, r in runs.items():
        by_case = {row["case"]: row["buffers"] for row in r["rows"]}
        params = r["rows"][0]["model_mib"] * MiB / 4 / 1e6
        cells = [f"{by_case[c]:.2f}" if c in by_case else "" for c in CASES]
        lines.append(f"| {label} | {r['code_commit'][:10]} | {params:.1f} | " + " | ".join(cells) + " |")
    lines.append("")
    for label, r in runs.items():
        m = r["machine"]
        lines.append(
            f"- {label}: `{r['command']}` at {r['date']}, code {r['code_commit']} ({r['diloco_source']}), "
            f"script {r['bench_commit'][:10]}; {m['cpu']}, {m['cores']} cores, torch {m['torch']}"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

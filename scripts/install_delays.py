"""How late each DumbDiLoCo node installed each round's global, from the nodes' logs (issue 12's diagnosis,
results/tiny-async-2026-12-02): for node i and outer step k, the time from its upload of the delta at
local step k x H to its install of global k, in seconds and in its own steps (seconds / its mean seconds
per step between its first and last upload). With `install_wait_seconds` the node does not train while it
waits, so there the figure is the wait, in step-equivalents.

    python scripts/install_delays.py runs/acc400-s1337 --prefix tiny-dumb-diloco --inner-steps 25
"""

from __future__ import annotations

import argparse
import re
from datetime import datetime
from pathlib import Path


def stamp(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def delays(log: Path, node: str, h: int) -> tuple[float, list[float]]:
    """(seconds per step, [install delay in seconds for outer steps 1, 2, ...])."""
    lines = log.read_text().splitlines()
    upload = re.compile(rf"uploaded nodes/{re.escape(node)}/delta_(\d+)\.")
    up = {int(m[1]): stamp(line) for line in lines if (m := upload.search(line))}
    got = {
        int(m[1]): stamp(line)
        for line in lines
        if (m := re.search(r"installed global outer step (\d+)", line))
    }
    steps = sorted(up)
    per_step = (
        (up[steps[-1]] - up[steps[0]]) / max(steps[-1] - steps[0], 1) if len(steps) > 1 else float("nan")
    )
    return per_step, [got[k] - up[h * k] for k in sorted(got) if k >= 1 and h * k in up]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, help="the folder holding <prefix>-node-<i>/train.log")
    ap.add_argument("--prefix", default="tiny-dumb-diloco")
    ap.add_argument("--inner-steps", type=int, default=25)
    args = ap.parse_args()
    every = []
    for log in sorted(args.runs.glob(f"{args.prefix}-node-*/train.log")):
        node = log.parent.name.removeprefix(f"{args.prefix}-")
        per_step, d = delays(log, node, args.inner_steps)
        if not d:
            print(f"{node}: no install of a round's global after its own upload")
            continue
        in_steps = [x / per_step for x in d]
        every += in_steps
        print(
            f"{node}: {per_step:.3f} s/step, delay mean {sum(in_steps) / len(d):.1f} steps, max {max(in_steps):.1f}"
        )
    if every:
        print(f"all nodes: mean delay {sum(every) / len(every):.2f} steps over {len(every)} installs")


if __name__ == "__main__":
    main()

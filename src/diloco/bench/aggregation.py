"""Issue 12 ("Bounded memory", "Fast aggregation"): the DumbDiLoCo master's round over 8 pending deltas.

A shared-directory repository (`DirectoryTransport`) holds one float32 delta from each of 8 nodes for a
model of `--params` float32 parameters (16.8M by default: 67 MB a delta). In the same run, alternating:

- the floor, per delta: `transport.read` (the file's bytes) + `hashlib.sha256` of the payload + one float32
  pass (`buf.add_` of the payload into a buffer allocated beforehand);
- the master's round: `OuterLoop.run_once` with `min_deltas_per_round` 8 on a fresh `MasterState` (read,
  validate, average, outer Nesterov step, publish the global; no state_dir), the real code path.

Target: round / floor <= 2.0. Peak memory: a fresh subprocess per measurement runs one round with 2 and
with 8 deltas pending (`collaborators` = the first N nodes) and reads VmHWM from /proc/self/status, reset
through /proc/self/clear_refs right before the round; the figure is the growth over the resident size
before the round, in model-sized buffers (params x 4 bytes). Target: the same for 2 and 8 pending.

Each run is stored under its `--label` in `<out>/aggregation.json` (the other labels are kept), and
`<out>/aggregation.md` is rewritten from all of them. Before/after: copy this checkout's `src/diloco/bench/`
into a checkout of the older commit (which may predate it) and run there with PYTHONPATH=<that checkout>/src
and `--label before --code-commit <sha>`.

    python scripts/bench_aggregation.py --label after     # ~1-2 minutes on 2 cores
    python scripts/bench_aggregation.py --tiny
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import diloco
from diloco.bench import common as bc
from diloco.dumb_diloco.master.loop import OuterConfig, OuterLoop
from diloco.dumb_diloco.master.recovery import MasterState
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.dumb_diloco.wire.repo_paths import delta_path
from diloco.dumb_diloco.wire.tensor_format import DeltaMeta, encode, parse_header

TARGET = 2.0
NODES = 8
MiB = 2**20


def shapes(params: int) -> dict[str, tuple[int, ...]]:
    """A transformer-like layout: an embedding and square matrices of width 1024 (plus a norm)."""
    width = 1024
    mats = max(1, params // 2 // (width * width))
    emb_rows = max(1, (params - mats * width * width) // 512)
    out = {"embed.weight": (emb_rows, 512), "norm.weight": (width,)}
    out |= {f"layers.{i}.weight": (width, width) for i in range(mats)}
    return out


class TimedDirectory(DirectoryTransport):
    """The directory transport, timing its writes (the round's publication of the global)."""

    write_seconds = 0.0

    def write(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return super().write(*args, **kwargs)
        finally:
            self.write_seconds += time.perf_counter() - t0


def make_repo(root: Path, layout: dict[str, tuple[int, ...]], nodes: int) -> DirectoryTransport:
    repo = TimedDirectory(root / "repo")
    g = torch.Generator().manual_seed(0)
    for n in range(nodes):
        tensors = {k: torch.randn(s, generator=g) * 1e-3 for k, s in layout.items()}
        repo.write({delta_path(f"n{n}", 1): encode(tensors, DeltaMeta(f"n{n}", 1, 0).to_header())})
    return repo


def initial_state(layout: dict[str, tuple[int, ...]]) -> MasterState:
    return MasterState.from_model_state({k: torch.full(s, 0.01) for k, s in layout.items()})


def outer_loop(repo: DirectoryTransport, layout, quorum: int, collaborators=()) -> OuterLoop:
    config = OuterConfig("master", 0.7, 0.9, collaborators=tuple(collaborators), min_deltas_per_round=quorum)
    return OuterLoop(repo, initial_state(layout), config)


def floor_pass(repo: DirectoryTransport, paths: list[str], buf: torch.Tensor) -> dict[str, float]:
    """Read + SHA-256 + one float32 add of every delta: the least a master can do with them."""
    t = {"read": 0.0, "sha256": 0.0, "add": 0.0}
    for path in paths:
        t0 = time.perf_counter()
        blob = repo.read(path)
        t1 = time.perf_counter()
        offset = parse_header(blob).payload_offset
        hashlib.sha256(memoryview(blob)[offset:]).hexdigest()
        t2 = time.perf_counter()
        buf.add_(torch.frombuffer(blob, dtype=torch.float32, offset=offset))
        t3 = time.perf_counter()
        t["read"] += t1 - t0
        t["sha256"] += t2 - t1
        t["add"] += t3 - t2
        del blob
    t["total"] = sum(t.values())
    return t


def _status_mib(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) / 1024


def child_memory(root: Path, params: int, pending: int) -> None:
    """One round with `pending` deltas pending, in this fresh process; prints a JSON line."""
    with tempfile.TemporaryDirectory() as tmp:  # first-call costs (lazy imports, allocator) off the record
        small = {"w": (64, 64)}
        outer_loop(make_repo(Path(tmp), small, 1), small, 1).run_once()
    layout = shapes(params)
    repo = DirectoryTransport(root / "repo")
    loop = outer_loop(repo, layout, pending, collaborators=[f"n{i}" for i in range(pending)])
    publish, at_publish = loop.publish, []

    def timed_publish(*a, **kw):  # the peak of steps 1-6 (read, validate, sum, outer step), before 7-8
        at_publish.append(_status_mib("VmHWM"))
        return publish(*a, **kw)

    loop.publish = timed_publish
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages (set-up's copies) would hide new buffers
    rss_before = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    result = loop.run_once()
    peak = _status_mib("VmHWM")
    assert len(result.applied) == pending, result
    model_mib = sum(torch.Size(s).numel() for s in layout.values()) * 4 / MiB
    row = {"pending": pending, "rss_before_mib": rss_before, "peak_mib": peak}
    row |= {"growth_mib": peak - rss_before, "model_buffers": (peak - rss_before) / model_mib}
    row["buffers_before_publish"] = (at_publish[0] - rss_before) / model_mib
    print(json.dumps(row))


def main(argv=None) -> int:
    p = bc.parser(__doc__.splitlines()[0], repeats=7, warmup=1)
    p.add_argument("--params", type=int, default=16_800_000, help="float32 parameters of the model")
    p.add_argument("--label", default="after", help="the key of this run in aggregation.json")
    p.add_argument(
        "--code-commit", default=None, help="the commit of the diloco code measured (default HEAD)"
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
        help="where the repository lives (default /dev/shm: the deltas' reads come from memory, as the "
        "floor's do, and the global's write does not wait for a disk)",
    )
    p.add_argument("--child-memory", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    args = bc.finish_args(p.parse_args(argv))
    if args.tiny:
        args.params = 1_100_000
    if args.child_memory:
        child_memory(args.root, args.params, args.child_memory)
        return 0
    torch.manual_seed(0)
    layout = shapes(args.params)
    numel = sum(torch.Size(s).numel() for s in layout.values())
    started = bc.machine()
    with tempfile.TemporaryDirectory(prefix="bench_aggregation_", dir=args.dir) as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        repo = make_repo(root, layout, NODES)
        print(f"repository: {NODES} deltas of {numel / 1e6:.1f}M float32 in {time.perf_counter() - t0:.1f}s")
        file_bytes = sum(f.size for f in repo.list("nodes"))
        floors, rounds, writes = timed_rounds(repo, layout, numel, args)
        memory = [child_peak(root, pending, args.params) for pending in (2, NODES)]
    ratios = [r / f["total"] for r, f in zip(rounds, floors)]
    row = summary_row(args, numel, file_bytes, floors, rounds, writes, memory)
    record = {
        "name": "aggregation",
        "date": bc.utc_now(),
        "command": bc.command_line(),
        "bench_commit": bc.commit(),
        "diloco_source": str(Path(diloco.__file__).parent),
        "machine": started,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "row": row,
        "ratios": ratios,
        "floors": floors,
        "rounds": rounds,
        "writes": writes,
        "memory": memory,
    }
    bc.write_labelled(args.out, "aggregation", args.label, record, report)
    print(bc.table([row]))
    print(f"-> {Path(args.out) / 'aggregation.json'}, {Path(args.out) / 'aggregation.md'}")
    return 0


def report(runs: dict[str, dict]) -> str:
    cols = ["label", "code_commit", "params_m", "mb_per_delta", "floor_s", "round_s", "ratio", "ratio_of_min"]
    cols += ["write_s", "round_mb_per_s", "buffers_2_pending", "buffers_8_pending"]
    cols += ["steps_1_6_buffers_2_pending", "steps_1_6_buffers_8_pending"]
    rows = [r["row"] | {"code_commit": r["row"]["code_commit"][:10]} for r in runs.values()]
    lines = [
        "# The master's round over 8 pending deltas: time and peak memory (issue 12)",
        "",
        "Written by `scripts/bench_aggregation.py` (its docstring says what is measured). floor: read +",
        "SHA-256 + one float32 add per delta, alternating with the round in the same run (medians; ratio:",
        "the median of the paired ratios; ratio_of_min: fastest round / fastest floor, the figure least",
        "disturbed by other work on a shared machine). write_s:",
        "the part of the round spent in the transport's write (the global and outer momentum). buffers:",
        "the peak resident memory of one round above the resident memory before it, in model-sized float32",
        f"buffers, with 2 and with 8 deltas pending. Targets: ratio <= {TARGET}; buffers independent of the",
        "number pending. steps_1_6_buffers: the same peak up to the publication (read, validate, sum, outer",
        "step), from VmHWM read when `OuterLoop.publish` is called.",
        "",
        bc.table(rows, cols),
        "",
    ]
    for label, r in runs.items():
        m = r["machine"]
        lines.append(
            f"- {label}: `{r['command']}` at {r['date']}, code {r['row']['code_commit']} "
            f"({r['diloco_source']}), script {r['bench_commit'][:10]}, repository in {r['args']['dir']}; "
            f"{m['cpu']}, {m['cores']} cores, "
            f"torch {m['torch']}, 1-minute load {m.get('load_average_1m', 0):.1f}; ratios {[round(x, 2) for x in r['ratios']]}; "
            f"floor parts (s): read {r['row']['read_s']:.3f}, sha256 {r['row']['sha256_s']:.3f}, "
            f"add {r['row']['add_s']:.3f}"
        )
    return "\n".join(lines) + "\n"


def timed_rounds(repo, layout, numel: int, args) -> tuple[list[dict], list[float], list[float]]:
    """The floor and the master's round, alternating so both see the same machine: the floors, the
    rounds' seconds and the global's write seconds of each repeat after the warm-up."""
    paths = [delta_path(f"n{n}", 1) for n in range(NODES)]
    buf = torch.zeros(numel)
    floors, rounds, writes = [], [], []
    for i in range(args.warmup + args.repeats):
        f = floor_pass(repo, paths, buf)
        loop = outer_loop(repo, layout, NODES)
        repo.write_seconds = 0.0
        t1 = time.perf_counter()
        r = loop.run_once()
        dt = time.perf_counter() - t1
        assert len(r.applied) == NODES, r
        del loop
        if i >= args.warmup:
            floors.append(f)
            rounds.append(dt)
            writes.append(repo.write_seconds)
        print(f"repeat {i}: floor {f['total']:.3f}s, round {dt:.3f}s, ratio {dt / f['total']:.2f}")
    return floors, rounds, writes


def child_peak(root: Path, pending: int, params: int) -> dict:
    """One round with `pending` deltas in a fresh process: its peak memory growth (child_memory's line)."""
    cmd = [
        sys.executable,
        "-m",
        "diloco.bench.aggregation",
        "--child-memory",
        str(pending),
        "--root",
        str(root),
    ]
    cmd += ["--params", str(params)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    print(out.strip().splitlines()[-1])
    return json.loads(out.strip().splitlines()[-1])


def summary_row(args, numel: int, file_bytes: int, floors, rounds, writes, memory) -> dict:
    """The run's row: medians of the floor's parts, the round and the write, their ratio, the peaks."""
    ratios = [r / f["total"] for r, f in zip(rounds, floors)]
    round_s = statistics.median(rounds)
    return {
        "label": args.label,
        "code_commit": args.code_commit or bc.commit(),
        "params_m": numel / 1e6,
        "deltas": NODES,
        "mb_per_delta": file_bytes / NODES / 1e6,
        "floor_s": statistics.median(f["total"] for f in floors),
        "read_s": statistics.median(f["read"] for f in floors),
        "sha256_s": statistics.median(f["sha256"] for f in floors),
        "add_s": statistics.median(f["add"] for f in floors),
        "round_s": round_s,
        "write_s": statistics.median(writes),
        "ratio": statistics.median(ratios),
        "ratio_of_min": min(rounds) / min(f["total"] for f in floors),
        "round_mb_per_s": file_bytes / round_s / 1e6,
        "buffers_2_pending": memory[0]["model_buffers"],
        "buffers_8_pending": memory[1]["model_buffers"],
        "steps_1_6_buffers_2_pending": memory[0]["buffers_before_publish"],
        "steps_1_6_buffers_8_pending": memory[1]["buffers_before_publish"],
    }


if __name__ == "__main__":
    sys.exit(main())

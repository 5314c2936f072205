"""Benchmark 5 (issue #7): compute utilization of DiLoCo and DumbDiLoCo when the network is slow.

The real trainer (`diloco.train.run`, micro model on the bundled sample) runs H inner steps per round
for a few rounds; only the network is simulated, scaled so that one round's communication takes the
same fraction of one round's compute as in the paper's 150M setting at a given bandwidth B:

    bandwidth used here = B x (N here / N paper) x (H x step time paper) / (H x step time here)

with N paper = 215.0M parameters, H = 500, 8 workers and an assumed paper step time of 1.65 s (512 x 1024
tokens per step on one H100 at 40% MFU, 6N + attention FLOPs); the step time here is measured first
by a run without communication. So "100 Mbit/s" on the plot means: the utilization the 150M run would
see on a 100 Mbit/s link.

- DiLoCo (synchronous; FP32 and FP16 pseudo-gradients): the project's DiLoCo strategy with its cross-
  worker collective replaced by one that takes ring all-reduce time, 2(W-1)/W x payload / bandwidth
  (W = 8), for what the project hands to it (`diloco.comm` seam; the math is a group of one);
- DumbDiLoCo (asynchronous, v2): this node is a worker; a master runs in the same process (no training,
  its outer loop only) and both reach the shared-directory repository through their own link of the
  same bandwidth (`diloco.dumb_diloco.store.throttled`).

Utilization = 1 - (time the training thread spends inside the strategy's after_inner_step) / (training
loop wall time), over the rounds after a first warm-up round: the fraction of the loop not blocked on
communication. The paper's global 1.1B run
reports 90-95%; the target for the asynchronous mode is >= 99%. Tokens/s relative to the run without
communication are reported too (on 2 shared CPU cores they also include the background threads'
competition for the cores).

    python scripts/bench_utilization.py          # every mode at 1-10,000 Mbit/s: long (at 1 Mbit/s an FP32
                                                 # round waits minutes on its link)
    python scripts/bench_utilization.py --modes "DiLoCo topk2 P=4 eager" --bandwidths-mbit 1 10 \
        --out results/bench/eager-1mbit          # issue 32's bar alone
    python scripts/bench_utilization.py --tiny
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco import comm, quant, sparse
from diloco.bench import common as bc
from diloco.config import run_dir_of
from diloco.dumb_diloco.store.throttled import ThrottledTransport

PAPER_PARAMS = 214_983_680  # 150M, every parameter (the pseudo-gradient covers them all)
PAPER_H = 500
PAPER_WORKERS = 8
PAPER_STEP_S = 1.65
TARGET_ASYNC = 0.99
TARGET_STREAMING_10MBIT = 0.95  # issue 13: overlap + 4-bit at 10 Mbit/s paper-equivalent
TARGET_EAGER_1MBIT = 0.95  # issue 32: eager updates (the whole round overlapped) at 1 Mbit/s paper-equivalent
BANDWIDTHS_MBIT = [1, 10, 100, 1000, 10000]
MODES = ["DiLoCo FP32", "DiLoCo FP16", "DiLoCo int4", "DiLoCo int4 P=4 overlap", "DumbDiLoCo v2"]
MODES += ["DiLoCo topk2", "DiLoCo int4 P=4 eager", "DiLoCo topk2 P=4 eager"]
DTYPES = {"FP32": "float32", "FP16": "float16", "int4": "int4", "topk2": "topk2"}  # a mode's second word


class RingTimedCollective(comm.Collective):
    """A group of one whose all-reduce takes the time a ring all-reduce of `workers` would take on a
    link of `bytes_per_s`: 2(W-1)/W x bytes / bytes_per_s (sleeping), so the math stays exact; the two
    shots of int8/int4 averaging, (W-1)/W x bytes each, take the same time for their payload."""

    def __init__(self, bytes_per_s: float, workers: int):
        super().__init__()
        self.bytes_per_s, self.workers = bytes_per_s, workers
        self._gather_shots = 1

    def _sleep(self, t: torch.Tensor, shots: int) -> None:
        share = shots * (self.workers - 1) / self.workers
        time.sleep(share * t.numel() * t.element_size() / self.bytes_per_s)

    def _all_reduce(self, t, op):  # ring: reduce-scatter + all-gather, each (W-1)/W of the payload
        self._sleep(t, shots=2)

    # int8/int4 (diloco.quant) in a group of one: all-to-all of the whole payload, (W-1)/W of it leaves;
    # all-gather of what is here the whole mean, of which W workers would each own 1/W: (W-1)/W again
    def _all_to_all(self, t):
        self._sleep(t, shots=1)
        return t

    def all_gather(self, t: torch.Tensor, tag: str = "other") -> torch.Tensor:
        """topk2 all-gathers whole payloads: each worker receives the W-1 others' (W-1 shots of (W-1)/W
        each, counted here as one payload per peer); int8/int4's second shot gathers the mean's 1/W parts."""
        self._gather_shots = self.workers if tag.endswith(sparse.TOPK_DTYPE) else 1
        return super().all_gather(t, tag)

    def _all_gather(self, t):
        self._sleep(t, shots=self._gather_shots)
        return t.unsqueeze(0)

    def _broadcast(self, t, src):
        pass


class Timed:
    """Wraps a trainer strategy: for every optimizer step, when it ended and how long the step spent
    inside after_inner_step (blocked on the strategy)."""

    def __init__(self, inner):
        self.inner = inner
        self.ends: dict[int, float] = {}
        self.blocked: dict[int, float] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def after_inner_step(self, step: int):
        t = time.perf_counter()
        try:
            return self.inner.after_inner_step(step)
        finally:
            self.ends[step] = time.perf_counter()
            self.blocked[step] = self.ends[step] - t

    def window(self, after: int) -> tuple[float, float]:
        """(wall seconds, blocked seconds) of the steps after step `after` (the warm-up round)."""
        last = max(self.ends)
        return self.ends[last] - self.ends[after], sum(b for s, b in self.blocked.items() if s > after)


def payload(n: int, dtype: str) -> float:
    """Bytes of one worker's pseudo-gradient of n values in `dtype` (quant.payload_bytes for int4)."""
    if dtype in quant.QUANT_BITS:
        return quant.payload_bytes(n, quant.QUANT_BITS[dtype], 256)
    if dtype == sparse.TOPK_DTYPE:  # SparseLoCo's 64 of 4,096 (the schema's default)
        return sparse.payload_bytes(n, sparse.MAX_CHUNK, 64)
    return comm.WIRE_DTYPES[dtype].itemsize * n


def run_trainer(overrides: list[str], collective=None, transport=None, before=None) -> tuple[dict, Timed]:
    """diloco.train.run with `overrides` and build_strategy's seams (`collective`: DiLoCo's cross-worker
    Collective; `transport`: wraps the store a DumbDiLoCo node opens); the strategy wrapped in Timed.
    `before(cfg)`, if given, runs on the composed config before the run starts."""
    import diloco.train as train_mod
    from diloco.bench.trainer import compose_overrides

    cfg = compose_overrides(overrides)
    box = {}

    def build(*args, **seams):
        box["s"] = Timed(train_mod.build_strategy(*args, **seams))
        return box["s"]

    if before is not None:
        before(cfg)
    try:
        code = train_mod.run(cfg, collective=collective, transport=transport, build=build)
    finally:
        logging.getLogger("diloco").handlers.clear()
    if code != 0:
        raise RuntimeError(f"trainer exited with {code}")
    summary = json.loads((run_dir_of(cfg) / "summary.json").read_text())
    return summary, box["s"]


def throttled(bytes_per_s: float):
    """build_strategy's `transport` seam: the store a DumbDiLoCo node opens, behind a slow link."""
    return lambda transport: ThrottledTransport(transport, bytes_per_s)


def master_starter(bytes_per_s: float, repo: Path, state_dir: Path, h: int, poll: float):
    """`before` for a distributed=dumb_diloco worker's run: a master (outer loop only, no training) started
    in this process, with the worker's initial weights and its own link of the same bandwidth."""
    from diloco.dumb_diloco.node.strategy import DumbDiLoCo
    from diloco.dumb_diloco.settings import Settings
    from diloco.dumb_diloco.store.transport import DirectoryTransport
    from diloco.model import build_model

    box = {}

    def start(cfg) -> None:
        settings = Settings(
            role="master",
            node_id="master-1",
            repo_id=str(repo),
            inner_steps=h,
            poll_interval=poll,
            state_dir=str(state_dir),
            publish_hf_config=False,
            shutdown_timeout=600.0,
        )
        link = ThrottledTransport(DirectoryTransport(repo, keep_old_versions_s=60.0), bytes_per_s)
        master = DumbDiLoCo(build_model(cfg.model, seed=cfg.seed), settings, link)
        master.start()
        box["master"] = master

    return start, box


BASE = [
    "model=micro",
    "data=sample",
    "data.seq_len=256",
    "train.batch_size=8",
    "train.micro_batch_size=8",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.progress=false",
    "eval.tokens=512",
    "optim.lr=3e-3",
    "optim.warmup_steps=10",
    "optim.total_steps=1000",
    "device=cpu",
    "wandb.mode=disabled",
    "resume=never",
]
TINY_MODES = ["DiLoCo FP32", "DiLoCo int4 P=4 overlap", "DiLoCo topk2 P=4 eager", "DumbDiLoCo v2"]
TINY_BASE = ["data.seq_len=64", "train.batch_size=4", "train.micro_batch_size=4"]
COLUMNS = [
    "paper-equivalent link",
    "mode",
    "link here MB/s",
    "utilization",
    "analytic",
    "tokens/s vs no-comm",
    "target",
    "new globals installed",
]


@dataclass
class Setup:
    """What every measured run shares: its rounds, the no-communication run's pace, the scale to the paper."""

    h: int
    rounds: int
    common: list[str]  # every run's overrides
    tmp: Path
    workers: int  # W of the simulated ring
    wall0: float = 0.0  # the no-communication run's measured wall time
    step_s: float = 0.0
    n: int = 0  # the micro model's parameters
    scale: float = 1.0  # link here / paper link


def main(argv=None) -> int:
    p = bc.parser(__doc__.splitlines()[0], repeats=1, warmup=0)
    p.add_argument("--inner-steps", type=int, default=10, help="H of the runs here")
    p.add_argument("--rounds", type=int, default=4, help="measured rounds (after one warm-up round)")
    p.add_argument("--bandwidths-mbit", type=float, nargs="+", default=BANDWIDTHS_MBIT)
    p.add_argument("--paper-step-seconds", type=float, default=PAPER_STEP_S)
    p.add_argument("--workers", type=int, default=PAPER_WORKERS, help="W of the simulated ring all-reduce")
    p.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        help="only these modes (default: all; a slow link's FP32 rounds take minutes each)",
    )
    args = bc.finish_args(p.parse_args(argv))
    h, rounds, bandwidths, modes, base = (
        args.inner_steps,
        args.rounds,
        args.bandwidths_mbit,
        args.modes or MODES,
        BASE,
    )
    if args.tiny:
        h, rounds, bandwidths, modes, base = 2, 1, [100], TINY_MODES, [*BASE, *TINY_BASE]
    steps = h * (rounds + 1)  # the first round is warm-up, not measured
    logging.getLogger("diloco").setLevel(logging.WARNING)
    rows, raw = [], []
    with tempfile.TemporaryDirectory(prefix="bench_util_") as tmp:
        common = [*base, f"train.max_steps={steps}", f"train.log_every={h}", f"out_dir={tmp}"]
        setup = Setup(h, rounds, common, Path(tmp), args.workers)
        calibrate(setup, base, args.paper_step_seconds)
        for mbit in bandwidths:
            for mode in modes:
                row, record = measure(setup, mode, mbit)
                rows.append(row)
                raw.append(record)
    plot = plot_utilization(rows, args.out) if not args.tiny else None
    bc.write(
        "utilization",
        "Compute utilization vs bandwidth (paper-equivalent links)",
        args,
        rows,
        COLUMNS,
        notes=notes(setup, args),
        verdicts=verdict_lines(rows),
        extra={"runs": raw, "step_seconds": setup.step_s, "scale": setup.scale, "plot": plot},
    )
    return 0


def calibrate(setup: Setup, base: list[str], paper_step_seconds: float) -> None:
    """The no-communication run: its pace, and the scale that makes a link here cost what the paper's did."""
    from diloco.bench.trainer import compose_overrides
    from diloco.model import build_model  # N of the micro model

    _, timed = run_trainer([*setup.common, "run_name=nocomm"])
    steps = setup.h * (setup.rounds + 1)
    setup.wall0, _ = timed.window(after=setup.h)
    setup.step_s = setup.wall0 / (steps - setup.h)
    setup.n = sum(p.numel() for p in build_model(compose_overrides(base).model, seed=0).parameters())
    paper_round_s = PAPER_H * paper_step_seconds
    setup.scale = (setup.n / PAPER_PARAMS) * paper_round_s / (setup.h * setup.step_s)


def diloco_overrides(mode: str, h: int) -> list[str]:
    """A synchronous mode's overrides: its wire dtype, and Streaming or eager fragments when it has them."""
    over = [
        "distributed=diloco",
        f"distributed.inner_steps={h}",
        f"distributed.pseudo_grad_dtype={DTYPES[mode.split()[1]]}",
        "distributed.fp16_scaling=false",
        "distributed.cosine_sample_size=0",
    ]
    if "overlap" in mode:  # Streaming DiLoCo: 4 fragments, each overlapped with tau steps
        tau = max(1, h // 10)
        return over + [
            f"distributed.fragments={min(4, h)}",
            f"distributed.overlap_steps={tau}",
            "distributed.fragment_alpha=0.5",
        ]
    if "eager" in mode:  # eager updates: each fragment's exchange overlaps a whole round
        eager = ["distributed.eager_updates=true", "distributed.fragment_alpha=0.0"]
        return over + [f"distributed.fragments={min(4, h)}", f"distributed.overlap_steps={h}", *eager]
    return over


def dumb_overrides(setup: Setup, repo: Path) -> list[str]:
    """The DumbDiLoCo worker's overrides (its master runs in this process, behind the same link)."""
    return [
        "distributed=dumb_diloco",
        "distributed.role=worker",
        "distributed.node_id=worker-1",
        f"distributed.repo_id={repo}",
        f"distributed.inner_steps={setup.h}",
        f"distributed.poll_interval={max(setup.h * setup.step_s / 4, 0.05):.3f}",
        f"distributed.state_dir={setup.tmp / 'worker-state'}",
        "distributed.startup_timeout=120",
        "distributed.shutdown_timeout=600",
        "distributed.publish_hf_config=false",
        "data.shard=1",
        "data.num_shards=2",
    ]


def run_dumb(setup: Setup, name: str, mbit: float, bps: float) -> tuple[dict, Timed]:
    repo, state = setup.tmp / f"repo-{mbit:g}", setup.tmp / f"state-{mbit:g}"
    poll = max(setup.h * setup.step_s / 4, 0.05)
    start_master, box = master_starter(bps, repo, state, setup.h, poll=poll)
    try:
        over = [*setup.common, f"run_name={name}", *dumb_overrides(setup, repo)]
        return run_trainer(over, transport=throttled(bps), before=start_master)
    finally:
        if "master" in box:
            box["master"].close()


def measure(setup: Setup, mode: str, mbit: float) -> tuple[dict, dict]:
    """One mode on one paper-equivalent link: its row, and the raw figures the record keeps."""
    bps = mbit * 1e6 / 8 * setup.scale
    name = f"{mode.replace(' ', '-').replace('=', '')}-{mbit:g}"
    analytic = None
    if mode.startswith("DiLoCo"):
        over = [*setup.common, f"run_name={name}", *diloco_overrides(mode, setup.h)]
        summary, timed = run_trainer(over, collective=RingTimedCollective(bps, setup.workers))
    else:
        summary, timed = run_dumb(setup, name, mbit, bps)
    wall, blocked = timed.window(after=setup.h)
    if mode.startswith("DiLoCo") and " P=4 " not in mode:  # own compute, modelled ring time
        inner = wall - blocked
        analytic = inner / (inner + setup.rounds * round_bytes(setup, mode) / bps)
    row = {
        "paper-equivalent link": f"{mbit:g} Mbit/s",
        "Mbit/s": mbit,
        "mode": mode,
        "link here MB/s": bps / 1e6,
        "utilization": 1 - blocked / wall,
        "analytic": analytic,
        "tokens/s vs no-comm": setup.wall0 / wall,
        "target": target_of(mode),
        # the price of asynchrony on a slow link is staleness, not stall
        "new globals installed": summary["outer/installs"] - 1 if mode.startswith("Dumb") else None,
    }
    kept = {k: v for k, v in summary.items() if k.startswith(("comm/", "outer/"))}
    return row, {"name": name, "blocked_s": blocked, "wall_s": wall, "summary": kept}


def round_bytes(setup: Setup, mode: str) -> float:
    """A synchronous round's bytes on each worker's link: every fragment synced once a round, so one whole
    payload, all-gathered whole for topk2 (W-1 payloads) and ring all-reduced otherwise."""
    dtype = DTYPES[mode.split()[1]]
    shots = setup.workers - 1 if dtype == sparse.TOPK_DTYPE else 2 * (setup.workers - 1) / setup.workers
    return payload(setup.n, dtype) * shots


def target_of(mode: str) -> float | None:
    if mode.startswith("Dumb"):
        return TARGET_ASYNC
    if "eager" in mode:
        return TARGET_EAGER_1MBIT
    return TARGET_STREAMING_10MBIT if "overlap" in mode else None


def verdict_lines(rows: list[dict]) -> list[str]:
    """Each target at its link (DumbDiLoCo at every one, Streaming at 10 Mbit/s, eager at 1), and the
    synchronous modes against their analytic utilization."""

    def line(r: dict, target: float, where: str = "") -> str:
        met = "met" if r["utilization"] >= target else "NOT met"
        return (
            f"{r['mode']} at {r['paper-equivalent link']}: utilization {r['utilization']:.2%} (target >= "
            f"{target:.0%}{where}): {met}"
        )

    verdicts = [line(r, TARGET_ASYNC) for r in rows if r["mode"].startswith("Dumb")]
    verdicts += [
        line(r, TARGET_STREAMING_10MBIT, " at 10 Mbit/s")
        for r in rows
        if "overlap" in r["mode"] and r["Mbit/s"] == 10
    ]
    verdicts += [
        line(r, TARGET_EAGER_1MBIT, " at 1 Mbit/s") for r in rows if "eager" in r["mode"] and r["Mbit/s"] == 1
    ]
    return verdicts + [
        f"{r['mode']} at {r['paper-equivalent link']}: utilization {r['utilization']:.2%} (analytic "
        f"{r['analytic']:.2%})"
        for r in rows
        if r["analytic"] is not None
    ]


def notes(setup: Setup, args) -> list[str]:
    h, rounds = setup.h, setup.rounds
    return [
        f"Micro model ({setup.n} parameters), H={h}, {rounds} measured rounds after one warm-up round per run; "
        f"step time without communication {setup.step_s * 1e3:.0f} ms here; scale factor (link here / paper "
        f"link) {setup.scale:.3g}.",
        f"Paper setting: 150M ({PAPER_PARAMS} parameters), H={PAPER_H}, {setup.workers} workers, "
        f"{args.paper_step_seconds} s per inner step (assumed; one H100 at 40% MFU).",
        "Analytic (sync): c / (c + rounds x 2(W-1)/W x payload / link), c = the run's own time outside the "
        "strategy; the gap to the measured value is the outer step's own compute (pseudo-gradient, cast, Nesterov).",
        "FP16 here is the plain cast (fp16_scaling=false), as in the paper's FP16 runs.",
        "int4: 4-bit codes + a bfloat16 scale per 256 values (0.51 bytes per value, 7.88x fewer than FP32), "
        "averaged in two shots (all-to-all, all-gather; diloco.quant), each (W-1)/W of the payload on the wire.",
        f"int4 P=4 overlap: Streaming DiLoCo with 4 fragments, each synced once per round at its own offset, its "
        f"outer step applied tau = {max(1, h // 10)} inner step(s) later (H/10; 50 steps of H=500 at paper scale) "
        "with mixing alpha 0.5; the transfer runs on a thread during those steps.",
        "topk2: SparseLoCo's 64 of 4,096 values per chunk as 2-bit codes with 12-bit indices (0.23 bits per "
        "value), all-gathered whole: each worker receives W-1 payloads.",
        "P=4 eager: eager updates (Kale et al. 2025) on 4 fragments: each fragment's exchange overlaps the whole "
        "next round (tau = H), its outer step taken at once with the worker's own pseudo-gradient standing in.",
        f"New globals installed: globals the DumbDiLoCo worker installed during its {rounds + 1} rounds (besides the "
        "first). On a slow link a delta and a global each take most of a round to cross it, so the worker trains "
        "on while its view of the global model falls behind: the cost of asynchrony there is staleness, not stall.",
    ]


def plot_utilization(rows: list[dict], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {
        "DiLoCo FP32": "o-",
        "DiLoCo FP16": "s-",
        "DiLoCo int4": "d-",
        "DiLoCo int4 P=4 overlap": "v-",
        "DumbDiLoCo v2": "^-",
        "DiLoCo topk2": "x-",
        "DiLoCo int4 P=4 eager": "P-",
        "DiLoCo topk2 P=4 eager": "*-",
    }
    for mode, style in styles.items():
        pts = sorted((r["Mbit/s"], r["utilization"], r["analytic"]) for r in rows if r["mode"] == mode)
        if not pts:
            continue
        (line,) = ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], style, label=f"{mode} (measured)")
        if pts[0][2] is not None:
            ax.plot(
                [p[0] for p in pts],
                [100 * p[2] for p in pts],
                "--",
                color=line.get_color(),
                alpha=0.6,
                label=f"{mode} (analytic)",
            )
    ax.axhspan(90, 95, color="grey", alpha=0.15, label="OpenDiLoCo global run: 90-95%")
    ax.axhline(99, color="black", lw=0.8, ls=":", label="async target: 99%")
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth, 150M paper setting equivalent (Mbit/s)")
    ax.set_ylabel("compute utilization (%)")
    ax.set_ylim(0, 101)
    ax.set_title("Utilization vs bandwidth (150M, 8 workers, H=500 equivalent)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "utilization.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark 1 (issue #7): the synchronous DiLoCo outer step against this machine's memory bandwidth.

W in-process workers (threads, one `diloco.comm.InProcessGroup`) each hold a model's parameters and
run one outer step of the project's own `diloco.diloco.DiLoCo.outer_step`: pseudo-gradient, cast to
the wire dtype and back, averaging over the W workers, Nesterov step, installing the new global
weights. The figure is the wall time from the common start to the last worker's end, median of
repeats after a warm-up (the first outer step also creates the momentum buffers).

The floor: the bytes each phase must read and write at least once, divided by the copy bandwidth
measured in the same run (`common.copy_bandwidth`: `dst.copy_(src)`, bytes read + written
per second). Per worker, N float32 parameters, wire dtype of b bytes per element:

    pseudo-gradient   read params, read global, write pseudo-grad          12 N
    cast and back     (only when b < 4) read 4N, write bN; read bN, write 4N  (8 + 2b) N
    averaging         the W contributions read once, the mean written once   (W b + 4) N  for the group
    Nesterov step     read grad, read+write momentum, read+write global      20 N
    install           read global, write params                               8 N

Baseline row: a naive per-parameter outer step as in the papers' pseudo-code (one tensor at a time,
a collective per tensor, `torch.optim.SGD(foreach=False)`). Target: the project's step within 2x of
the floor. A `torch.profiler` table of the project's step (worker 0) shows where the time goes.

The 1.1B shape: its embedding and head and the first `--layers-1b` of its 22 decoder layers (every
tensor shape of the 1.1B model), because each worker holds four float32 copies (params, global,
momentum, pseudo-gradient): the full 1.1B model needs ~18 GB per worker, and W=2 workers would not
fit this 23 GB machine. With 4 layers (307M parameters) W=2 needs ~10 GB. Seconds scale linearly with
the parameter count; the ratio to the floor does not.

    python scripts/bench_outer_step.py                     # 150m and 1b shapes, W=2, ~5 minutes
    python scripts/bench_outer_step.py --layers-1b 22 --workers 2   # the full 1.1B (needs ~36 GB)
    python scripts/bench_outer_step.py --tiny
"""

from __future__ import annotations

import gc
import statistics
import sys
import threading
import time

import torch

from diloco import comm
from diloco.bench import common as bc
from diloco.diloco import DiLoCo
from diloco.schema import DiLoCoConfig

TARGET = 2.0
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


# ---------------------------------------------------------------------------------------------------
# shapes


def model_shapes(name: str, layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of configs/model/<name>.yaml, in model.parameters() order;
    with `layers`, only the first `layers` decoder layers (plus embedding, final norm and head)."""
    from omegaconf import OmegaConf
    from transformers import LlamaForCausalLM

    from diloco.model import llama_config

    cfg = OmegaConf.load(bc.ROOT / "configs" / "model" / f"{name}.yaml")
    if layers is not None:
        cfg.num_hidden_layers = layers
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(cfg))
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


class Params(torch.nn.Module):
    """A model's parameters and nothing else (the outer step only ever sees model.parameters())."""

    def __init__(self, shapes, value: float):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.full(s, value)) for _, s in shapes])


# ---------------------------------------------------------------------------------------------------
# the implementations


class ProjectWorker:
    """One worker running the project's own DiLoCo.outer_step."""

    label = "project: DiLoCo.outer_step"

    def __init__(self, shapes, coll: comm.Collective, dtype: str):
        self.model = Params(shapes, 0.01)
        inner = torch.optim.AdamW(self.model.parameters())  # only read for reset_inner_optimizer
        config = DiLoCoConfig(
            inner_steps=1,
            outer_lr=OUTER_LR,
            outer_momentum=OUTER_MOMENTUM,
            pseudo_grad_dtype=dtype,
            bucket_size_mb=128,
            cosine_sample_size=0,
        )
        self.diloco = DiLoCo(self.model, inner, coll, config)
        self.params = list(self.model.parameters())

    def local_training(self, rank: int) -> None:
        """Stands in for H inner steps: moves every parameter (untimed)."""
        with torch.no_grad():
            torch._foreach_add_(self.params, 1e-3 * (rank + 1))

    def outer_step(self) -> None:
        self.diloco.outer_step()


class NaiveWorker:
    """The papers' pseudo-code, one parameter at a time (DiLoCo arXiv 2311.08105, Algorithm 1)."""

    label = "naive per-parameter (baseline)"

    def __init__(self, shapes, coll: comm.Collective, dtype: str):
        self.coll, self.wire = coll, comm.WIRE_DTYPES[dtype]
        self.params = [torch.full(s, 0.01) for _, s in shapes]
        self.global_params = [p.clone() for p in self.params]
        self.opt = torch.optim.SGD(
            self.global_params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True, foreach=False
        )

    def local_training(self, rank: int) -> None:
        for p in self.params:
            p.add_(1e-3 * (rank + 1))

    @torch.no_grad()
    def outer_step(self) -> None:
        for p, g in zip(self.params, self.global_params):
            delta = g - p  # pseudo-gradient
            wire = delta.to(self.wire)
            self.coll.all_reduce_(wire)  # sum over workers, in the wire dtype
            g.grad = wire.float() / self.coll.size
        self.opt.step()
        self.opt.zero_grad()
        for p, g in zip(self.params, self.global_params):
            p.copy_(g)


IMPLS = {"naive": NaiveWorker, "project": ProjectWorker}


# ---------------------------------------------------------------------------------------------------
# running W workers


def run_round(workers, start: threading.Barrier) -> float:
    """One outer step on every worker at once; wall time from the common start to the last end."""
    t0, t1, errors = [0.0] * len(workers), [0.0] * len(workers), []

    def go(rank):
        try:
            workers[rank].local_training(rank)
            start.wait()
            t0[rank] = time.perf_counter()
            workers[rank].outer_step()
            t1[rank] = time.perf_counter()
        except BaseException as e:  # surfaced below
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(t1) - min(t0)


def bench_impl(impl: str, shapes, w: int, dtype: str, args) -> tuple[dict, list, list[float]]:
    """Seconds of the outer steps, the workers, and the copy bandwidth sampled right before each
    timed step (so floor and step see the same load on a shared machine)."""
    group = comm.InProcessGroup(w, timeout_seconds=600)
    workers = [IMPLS[impl](shapes, group.member(r), dtype) for r in range(w)]
    start = threading.Barrier(w)
    times, bandwidth = [], []
    for i in range(args.warmup + args.repeats):
        bw = bc.copy_bandwidth(nbytes=(32 if args.tiny else 512) * 2**20, repeats=3)["gb_per_s"]
        t = run_round(workers, start)
        if i >= args.warmup:
            times.append(t)
            bandwidth.append(bw)
    return bc.summarize(times), workers, bandwidth


def phase_timers(worker: ProjectWorker) -> dict[str, float]:
    """Wrap the pieces of the project's outer step on this instance (no source change): seconds each."""
    acc = {"averager.average_": 0.0, "meter.observe": 0.0, "meter.finish": 0.0, "outer_optimizer.step": 0.0}
    d = worker.diloco

    def timed(fn, key):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t

        return run

    d.averager.average_ = timed(d.averager.average_, "averager.average_")
    d.meter.observe = timed(d.meter.observe, "meter.observe")
    d.meter.finish = timed(d.meter.finish, "meter.finish")
    d.outer_optimizer.step = timed(d.outer_optimizer.step, "outer_optimizer.step")
    return acc


def profile_project(workers: list[ProjectWorker], top: int = 12) -> tuple[list[dict], dict]:
    """One more round with worker 0 under torch.profiler and every worker's phases timed."""
    from torch.profiler import ProfilerActivity, profile

    accs = [phase_timers(wk) for wk in workers]
    total = [0.0] * len(workers)
    start = threading.Barrier(len(workers))
    prof_box = {}

    def go(rank):
        workers[rank].local_training(rank)
        start.wait()
        t = time.perf_counter()
        if rank == 0:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                workers[rank].outer_step()
            prof_box["p"] = prof
        else:
            workers[rank].outer_step()
        total[rank] = time.perf_counter() - t

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = prof_box["p"].key_averages()
    ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    rows = [
        {
            "op": e.key,
            "calls": e.count,
            "self s": e.self_cpu_time_total / 1e6,
            "share": e.self_cpu_time_total / max(sum(x.self_cpu_time_total for x in events), 1),
            "allocated GB": max(getattr(e, "self_cpu_memory_usage", 0), 0) / bc.GB,
        }
        for e in ops
    ]
    phases = dict(accs[0])
    phases["everything else (pseudo-grad, norms, install)"] = total[0] - sum(accs[0].values())
    phases["total (worker 0, profiled)"] = total[0]
    return rows, phases


# ---------------------------------------------------------------------------------------------------
# floors


def floor_bytes(n: int, w: int, dtype: str) -> dict[str, int]:
    """Bytes the whole group of W workers must move at least once, by phase (module docstring)."""
    b = comm.WIRE_DTYPES[dtype].itemsize
    return {
        "pseudo-gradient": w * 12 * n,
        "cast and back": w * (8 + 2 * b) * n if b < 4 else 0,
        "averaging": (w * b + 4) * n,
        "Nesterov step": w * 20 * n,
        "install": w * 8 * n,
    }


def bench_shape(label: str, shapes, w: int, dtype: str, impls: list[str], args) -> tuple[list[dict], dict]:
    n = sum(torch.Size(s).numel() for _, s in shapes)
    floors = floor_bytes(n, w, dtype)
    rows, detail = [], {"shape": label, "params": n, "workers": w, "dtype": dtype, "bandwidth": {}}
    detail["floor_bytes"] = floors
    for impl in impls:
        m, workers, bw = bench_impl(impl, shapes, w, dtype, args)
        detail["bandwidth"][impl] = bw
        floor_s = sum(floors.values()) / (statistics.median(bw) * bc.GB)
        if impl == "project" and not args.no_profile:
            detail["profile_ops"], detail["profile_phases"] = profile_project(workers)
        rows.append(
            {
                "shape": label,
                "params": n,
                "W": w,
                "wire": dtype,
                "impl": impl,
                "implementation": workers[0].label,
                "seconds": m["median"],
                "floor_s": floor_s,
                "x_floor": m["median"] / floor_s,
                "GB/s moved (floor bytes)": sum(floors.values()) / m["median"] / bc.GB,
            }
        )
        detail[impl] = m
        del workers
        gc.collect()
    detail["copy_bandwidth_gb_s"] = statistics.median(b for v in detail["bandwidth"].values() for b in v)
    return rows, detail


def main(argv=None) -> int:
    p = bc.parser(__doc__.splitlines()[0], repeats=3, warmup=1)
    p.add_argument("--shapes", nargs="+", default=["150m", "1b"])
    p.add_argument("--workers", type=int, default=2, help="W in-process workers")
    p.add_argument("--layers-1b", type=int, default=4, help="decoder layers of the 1.1B shape (of 22)")
    p.add_argument("--dtypes", nargs="+", default=["float32"], help="wire dtypes (float32 float16 bfloat16)")
    p.add_argument("--impls", nargs="+", default=["naive", "project"], choices=list(IMPLS))
    p.add_argument("--no-profile", action="store_true")
    args = bc.finish_args(p.parse_args(argv))
    plan = [(s, None if s != "1b" else args.layers_1b) for s in args.shapes]
    if args.tiny:
        plan, args.workers = [("micro", None)], 2
    torch.manual_seed(0)
    rows, details = [], []
    for shape, layers in plan:
        shapes = model_shapes(shape, layers)
        label = shape if layers is None else f"{shape} ({layers} of 22 layers)"
        for dtype in args.dtypes:
            r, d = bench_shape(label, shapes, args.workers, dtype, args.impls, args)
            rows += r
            details.append(d)

    bc.write(
        "outer_step",
        "Outer step vs memory bandwidth (CPU, float32 global copy)",
        args,
        rows,
        COLUMNS,
        notes=notes(details, args),
        verdicts=verdict_lines(rows),
        tables=detail_tables(details),
        extra={"details": details},
    )
    return 0


COLUMNS = [
    "shape",
    "params",
    "W",
    "wire",
    "implementation",
    "seconds",
    "floor_s",
    "x_floor",
    "GB/s moved (floor bytes)",
]


def verdict_lines(rows: list[dict]) -> list[str]:
    """Each implementation against its bandwidth floor and TARGET, with its speed-up over the naive one."""
    verdicts = []
    for r in rows:
        if r["impl"] == "naive":
            continue
        same = (r["shape"], r["wire"])
        base = next((x for x in rows if x["impl"] == "naive" and (x["shape"], x["wire"]) == same), None)
        gain = f"; speed-up over the naive baseline {base['seconds'] / r['seconds']:.2f}x" if base else ""
        verdicts.append(
            f"{r['shape']} {r['wire']} W={r['W']}: {r['implementation']}: {r['seconds']:.2f} s = "
            f"{r['x_floor']:.2f}x its bandwidth floor ({r['floor_s']:.2f} s; target <= {TARGET}x): "
            f"{'met' if r['x_floor'] <= TARGET else 'NOT met'}{gain}"
        )
    return verdicts


def detail_tables(details: list[dict]) -> dict:
    """Per shape and dtype: where the profiled worker's time goes (phases, top ops) and the floor's bytes."""
    tables = {}
    for d in details:
        where = f"Where the time goes: {d['shape']} {d['dtype']}"
        if "profile_phases" in d:
            total = d["profile_phases"]["total (worker 0, profiled)"]
            phases = [{"phase": k, "seconds": v, "share": v / total} for k, v in d["profile_phases"].items()]
            tables[f"{where}, worker 0 of {d['workers']}, by phase"] = (phases, None)
            tables[f"{where}, worker 0, top ops (torch.profiler)"] = (d["profile_ops"], None)
        floor_rows = [
            {"phase": k, "bytes": v, "floor s": v / (d["copy_bandwidth_gb_s"] * bc.GB)}
            for k, v in d["floor_bytes"].items()
        ]
        tables[f"Floor: {d['shape']} {d['dtype']} W={d['workers']}, bytes by phase"] = (floor_rows, None)
    return tables


def notes(details: list[dict], args) -> list[str]:
    return [
        "Copy bandwidth (dst.copy_(src) of 512 MB, read + written bytes per second), sampled right before every "
        "timed outer step; each row's floor uses the median of its own samples. Medians: "
        + ", ".join(f"{d['shape']}: {d['copy_bandwidth_gb_s']:.1f} GB/s" for d in details),
        f"W={args.workers} workers are threads of one process sharing this machine's cores and memory bus, so "
        "the floor counts every worker's bytes; the averaging uses diloco.comm.InProcessCollective.",
        "seconds: wall time of one outer step of all W workers (common start to last end), median of "
        f"{args.repeats} after {args.warmup} warm-up.",
    ]


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark 2 (issue #7): how long DumbDiLoCo blocks the training thread at an inner boundary.

A worker node (`diloco.dumb_diloco.node.strategy.DumbDiLoCo`, the project's own code) on a shared-
directory repository whose first global was published by a master (then stopped, so no new global
arrives and nothing is installed: the boundary is snapshot, delta, enqueue). Its transport sits behind
a link throttled to 10 MB/s or unlimited (`diloco.dumb_diloco.store.throttled`). Each measured boundary
finds the uploader idle (the benchmark waits, untimed, for the previous upload to finish), so every
measured boundary captures and dispatches a delta. The stall is the wall time of `DumbDiLoCo.on_step`
on the training thread (the coordinator's own `comm/boundary_stall_seconds` agrees).

v2 (async_delta_upload: true, the default) must not depend on the link speed and must stay within
1.5x of the floor: copying the model's state once (`torch._foreach_copy_` into buffers allocated
beforehand, measured in the same run). v1 (all I/O on the training thread) is shown for contrast. A
"v2 before" row runs a bench-only subclass with the boundary as it was before the one-copy change (the
subtraction and a fresh baseline copy on the training thread), so the gain stays visible. A v2 boundary
that finds an upload in flight is skipped; its stall is reported too.

    python scripts/bench_boundary.py         # 14m at 10 MB/s and unlimited, 150m unlimited; ~4 minutes
    python scripts/bench_boundary.py --tiny
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from diloco.bench import common as bc
from diloco.bench.outer_step import model_shapes
from diloco.dumb_diloco.node import strategy as node_mod
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import Settings
from diloco.dumb_diloco.store.throttled import ThrottledTransport
from diloco.dumb_diloco.store.transport import DirectoryTransport

TARGET = 1.5
MB = 1e6


class Params(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.full(s, 0.01)) for _, s in shapes])


# ---------------------------------------------------------------------------------------------------
# the boundary before the one-copy change (commit 956d36f), kept as the contrast row


class TwoCopyCoordinator(DumbDiLoCo):
    """The v2 boundary as it was: the training thread computed the delta (reads baseline and weights,
    writes a fresh float32 delta) and then copied the weights into a fresh baseline."""

    def capture(self, local_step):
        state = self.model.state_dict()
        current = {k: state[k] for k in self.delta_keys}
        job = super().capture(local_step)
        job.materialize()  # the subtraction on the training thread, as before
        fresh = {k: t.detach().to("cpu", copy=True) for k, t in current.items()}  # a fresh copy
        self.uploader.rebase(fresh, restart=False)  # the baseline, not the reused snapshot buffer
        self.buffers.free.clear()
        return job


# ---------------------------------------------------------------------------------------------------


def publish_first_global(repo: Path, shapes, state_dir: Path) -> None:
    """A master publishes global outer step 0, then stops (so nothing new is ever installed)."""
    settings = Settings(
        role="master",
        node_id="master-1",
        repo_id=str(repo),
        state_dir=str(state_dir),
        poll_interval=3600.0,
        publish_hf_config=False,
    )
    master = DumbDiLoCo(Params(shapes), settings, DirectoryTransport(repo, keep_old_versions_s=0.0))
    master.start()
    master.close()


class CopyFloor:
    """One copy of a model's state into buffers allocated beforehand: the least a boundary must do."""

    def __init__(self, model: torch.nn.Module):
        self.src = [t.detach() for t in model.state_dict().values()]
        self.dst = [torch.empty_like(t) for t in self.src]
        torch._foreach_copy_(self.dst, self.src)

    def __call__(self, repeats: int = 3) -> float:
        """The fastest of `repeats` copies (taken right before each boundary, so that floor and stall
        see the same load on a shared machine)."""
        return bc.measure(lambda: torch._foreach_copy_(self.dst, self.src), repeats=repeats, warmup=0)["min"]


def wait_idle(c: DumbDiLoCo, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while c.uploader.uploading and time.monotonic() < deadline:
        time.sleep(0.005)


class PhaseTimers(dict):
    """Seconds spent in each of the boundary's phases (the node's public steps), summed over calls."""

    def wrap(self, name: str, fn):
        self[name] = 0.0

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self[name] += time.perf_counter() - t

        return timed


def phase_timers(c: DumbDiLoCo) -> PhaseTimers:
    """Time the phases of `c`'s boundary: collecting the lanes, the capture (step 3), the dispatch (4),
    the poll (5) and the install (6)."""
    acc = PhaseTimers()
    c.collect = acc.wrap("collect", c.collect)
    c.capture = acc.wrap("capture", c.capture)
    c.uploader.dispatch = acc.wrap("dispatch", c.uploader.dispatch)
    c.poll = acc.wrap("poll", c.poll)
    c.install_staged = acc.wrap("install_staged", c.install_staged)
    return acc


def bench_case(shapes, tmp: Path, version: str, bytes_per_s, args) -> dict:
    repo, state = tmp / "repo", tmp / "state"
    publish_first_global(repo, shapes, state)
    model = Params(shapes)
    v2 = version != "v1"
    settings = Settings(
        role="worker",
        node_id="worker-1",
        repo_id=str(repo),
        inner_steps=1,  # every on_step is a boundary
        poll_interval=3600.0,
        state_dir=str(state),
        async_delta_upload=v2,
        async_global_poll=v2,
        startup_timeout=60.0,
        shutdown_timeout=900.0,
        publish_hf_config=False,
    )
    cls = TwoCopyCoordinator if version == "before" else DumbDiLoCo
    transport = ThrottledTransport(DirectoryTransport(repo, keep_old_versions_s=0.0), bytes_per_s)
    c = cls(model, settings, transport)
    c.start()
    params = list(model.parameters())
    phases = phase_timers(c)
    floor = CopyFloor(model)
    stalls, own, skipped, floors = [], [], [], []
    step = 0
    for i in range(args.warmup + args.repeats):
        with torch.no_grad():
            torch._foreach_add_(params, 1e-3)  # stands in for H inner steps
        wait_idle(c)
        f = floor()
        for k in phases:
            phases[k] = 0.0 if i == args.warmup else phases[k]
        step += 1
        t = time.perf_counter()
        result = c.on_step(step)
        dt = time.perf_counter() - t
        if i >= args.warmup:
            stalls.append(dt)
            floors.append(f)
            own.append(result.metrics.get("comm/boundary_stall_seconds", float("nan")))
        if v2 and bytes_per_s and i >= args.warmup:  # the next boundary, while the upload is in flight
            step += 1
            t = time.perf_counter()
            c.on_step(step)
            skipped.append(time.perf_counter() - t)
    wait_idle(c)
    c.close()
    summary = c.summary()
    return {
        "stall": bc.summarize(stalls),
        "floor": bc.summarize(floors),
        "x_floor": statistics.median(t / f for t, f in zip(stalls, floors)),
        "coordinator_stall": bc.summarize(own),
        "skipped_stall": bc.summarize(skipped) if skipped else None,
        "phases_per_boundary": {k: v / args.repeats for k, v in phases.items()},
        "uploads": summary.get("comm/uploads"),
        "skipped_boundaries": summary.get("comm/skipped_boundaries"),
        "delta_bytes": summary.get("comm/delta_bytes"),
        "bytes_uploaded": transport.bytes_up,
    }


def profile_capture(shapes, tmp: Path) -> list[dict]:
    """torch.profiler over one v2 boundary (unlimited link): which ops the training thread runs."""
    from torch.profiler import ProfilerActivity, profile

    repo, state = tmp / "repo", tmp / "state"
    publish_first_global(repo, shapes, state)
    model = Params(shapes)
    settings = Settings(
        role="worker",
        node_id="worker-1",
        repo_id=str(repo),
        inner_steps=1,
        poll_interval=3600.0,
        state_dir=str(state),
        startup_timeout=60.0,
        shutdown_timeout=900.0,
        publish_hf_config=False,
    )
    c = DumbDiLoCo(model, settings, DirectoryTransport(repo, keep_old_versions_s=0.0))
    c.start()
    c.on_step(1)
    wait_idle(c)
    with torch.no_grad():
        torch._foreach_add_(list(model.parameters()), 1e-3)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        c.on_step(2)
    wait_idle(c)
    c.close()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events) or 1
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {
            "op": e.key,
            "calls": e.count,
            "self s": e.self_cpu_time_total / 1e6,
            "share": e.self_cpu_time_total / total,
            "allocated GB": max(e.self_cpu_memory_usage, 0) / bc.GB,
        }
        for e in events[:8]
    ]


def main(argv=None) -> int:
    # two warm-up boundaries: the coordinator reuses a snapshot buffer from the third capture on
    p = bc.parser(__doc__.splitlines()[0], repeats=3, warmup=2)
    p.add_argument("--throttled-model", default="14m", help="model measured at 10 MB/s and unlimited")
    p.add_argument("--large-model", default="150m", help="model measured unlimited only ('' to skip)")
    p.add_argument("--slow-mb-per-s", type=float, default=10.0)
    args = bc.finish_args(p.parse_args(argv))
    logging.getLogger("diloco").setLevel(logging.WARNING)
    slow = args.slow_mb_per_s * MB
    plan = [(args.throttled_model, v, bw) for v in ("v2", "before", "v1") for bw in (None, slow)]
    if args.large_model:  # v1's contrast is shown on the throttled model
        plan += [(args.large_model, v, None) for v in ("v2", "before")]
    if args.tiny:
        plan = [("micro", v, bw) for v in ("v2", "before", "v1") for bw in (None, 100 * MB)]
    rows, details, profiles = [], [], {}
    for model_name, version, bw in plan:
        shapes = model_shapes(model_name)
        if model_name not in profiles:
            with tempfile.TemporaryDirectory(prefix="bench_boundary_") as tmp:
                profiles[model_name] = profile_capture(shapes, Path(tmp))
        with tempfile.TemporaryDirectory(prefix="bench_boundary_") as tmp:
            d = bench_case(shapes, Path(tmp), version, bw, args)
        rows.append(case_row(model_name, version, bw, d))
        details.append({"model": model_name, "version": version, "bytes_per_s": bw, **d})
    bc.write(
        "boundary",
        "DumbDiLoCo boundary stall vs one copy of the state",
        args,
        rows,
        notes=notes(args),
        verdicts=verdict_lines(rows),
        tables=detail_tables(details, profiles),
        extra={"details": details, "node_module": node_mod.__file__},
    )
    return 0


MODES = {"v2": "v2 (async upload)", "v1": "v1 (sync upload)", "before": "v2 before (delta + copy)"}


def case_row(model_name: str, version: str, bw: float | None, d: dict) -> dict:
    """One case's row: its stall and floor medians, their ratio, and the skipped boundary's stall."""
    return {
        "model": model_name,
        "mode": MODES[version],
        "link": "unlimited" if bw is None else f"{bw / MB:g} MB/s",
        "delta MB": (d["delta_bytes"] or 0) / MB,
        "stall s": d["stall"]["median"],
        "floor s (one copy)": d["floor"]["median"],
        "x_floor": d["x_floor"],
        "target": TARGET if version == "v2" else None,
        "skipped-boundary stall s": d["skipped_stall"]["median"] if d["skipped_stall"] else None,
    }


def verdict_lines(rows: list[dict]) -> list[str]:
    """v2's stall against its target on each link, and how much longer v1 blocks."""
    by = {(r["model"], r["mode"], r["link"]): r for r in rows}
    verdicts = []
    for r in rows:
        if r["target"] is None:
            continue
        other = [x for x in rows if (x["model"], x["mode"]) == (r["model"], r["mode"]) and x is not r]
        dep = ""
        if other and r["link"] == "unlimited":
            o = other[0]
            dep = f"; at {o['link']} {o['stall s']:.3f} s ({o['stall s'] / r['stall s']:.2f}x the unlimited stall)"
        verdicts.append(
            f"{r['model']} {r['mode']} {r['link']}: stall {r['stall s']:.3f} s = {r['x_floor']:.2f}x the one-copy "
            f"floor ({r['floor s (one copy)']:.3f} s; target <= {TARGET}x): "
            f"{'met' if r['x_floor'] <= TARGET else 'NOT met'}{dep}"
        )
    for (m, mode, link), r in by.items():
        if mode.startswith("v1") and link == "unlimited":
            v2 = by.get((m, "v2 (async upload)", link))
            if v2:
                verdicts.append(
                    f"{m}: v1 blocks {r['stall s'] / v2['stall s']:.1f}x longer than v2 (unlimited link)"
                )
    return verdicts


def detail_tables(details: list[dict], profiles: dict) -> dict:
    """Where a v2 boundary's time goes: by coordinator method, and the top ops of each model's profile."""
    tables = {}
    for d in details:
        if d["version"] == "v2" and d["bytes_per_s"] is None:
            tables[
                f"Where a v2 boundary's time goes: {d['model']}, by coordinator method (s per boundary)"
            ] = (
                [{"method": k, "seconds": v} for k, v in d["phases_per_boundary"].items()],
                None,
            )
    for m, prof in profiles.items():
        tables[f"Where a v2 boundary's time goes: {m}, top ops (torch.profiler)"] = (prof, None)
    return tables


def notes(args) -> list[str]:
    return [
        "Stall: wall time of DumbDiLoCo.on_step on the training thread at a boundary that captures a delta "
        f"(median of {args.repeats} after {args.warmup} warm-up); the uploader is idle when it starts.",
        "Floor: torch._foreach_copy_ of the model's state into buffers allocated beforehand, the fastest of 3 "
        "copies taken right before each measured boundary; x_floor is the median over boundaries of stall / floor.",
        "Skipped-boundary stall: a v2 boundary reached while the previous upload is still in flight (it "
        "captures nothing; its progress goes into the next delta).",
        "v2 is the project's boundary: one copy of the weights into a reused snapshot buffer; the uploader "
        "thread computes the delta. 'v2 before' is a bench-only subclass with the boundary as it was before "
        "(delta and a fresh baseline copy on the training thread), for contrast.",
    ]


if __name__ == "__main__":
    sys.exit(main())

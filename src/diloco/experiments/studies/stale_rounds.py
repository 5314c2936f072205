"""`make stale-rounds` (issue 55): does the paper's delayed Nesterov keep the global improving when the
master's rounds are uneven and stale?

    python scripts/stale_rounds.py                 # every variant, schedule and seed -> results/stale-rounds

A loaded machine gave the spec-default asynchronous run (3 nodes) rounds of 1 to 7 deltas, several of them
increments of one node, and its final global was worse than the initial one. Here that schedule is
emulated in one process, in a fixed order and without timing: 3 real DumbDiLoCo nodes (their uploader,
installer and codec, the spec's `replace` install and inner-optimizer reset) train the micro model on
their shards of the bundled sample, and one real master outer loop (`OuterLoop.run_once`) over a shared
directory takes the deltas that the schedule says arrived in each round. `UNEVEN`: 24 deltas (8 per node
of H steps) in 5 rounds of 1, 3, 7, 5 and 8, up to 4 increments of one node in one round; `EVEN`: the same
24 deltas in 8 rounds of one per node (even, but not synchronous: a node uploads before the master
aggregates its round, so each delta is one round stale; results/stale-rounds/README.md). The variants are the
master's outer optimizer: the spec's Nesterov step per round, the paper's delayed Nesterov (period 3, the
node count; src/diloco/outer.py), and delayed Nesterov with staleness weighting. Each run ends with the
final global's held-out loss beside the initial one's, at 2 seeds (each orders the data and seeds the
initial weights). Writes results/stale-rounds/{summary.json, table.md}. The 12 runs go to `--jobs`
processes of one torch thread each (default 2: the two cores).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from multiprocessing import get_context
from pathlib import Path

import torch

from diloco.experiments import records
from diloco.experiments.plan import compose_experiment

ROOT = records.ROOT
NODES = ("a", "b", "c")
H = 25  # the tiny family's inner steps
UNEVEN = (
    (("a", 1),),
    (("a", 2), ("b", 1)),
    (("b", 3), ("c", 4)),
    (("a", 3), ("c", 2)),
    (("a", 2), ("b", 4), ("c", 2)),
)
EVEN = tuple(tuple((n, 1) for n in NODES) for _ in range(8))
SCHEDULES = {"uneven": UNEVEN, "even": EVEN}
VARIANTS = {  # the master's outer optimizer, on top of the spec's (lr 0.7, Nesterov 0.9)
    "spec": {},
    "delayed Nesterov": {"delayed_nesterov": True, "delayed_nesterov_period": 3},
    "delayed Nesterov + staleness weights": {
        "delayed_nesterov": True,
        "delayed_nesterov_period": 3,
        "staleness_weighting": True,
    },
}
SEEDS = (1337, 1)
EXPERIMENT = "tiny/ddp_1x"  # the micro model on the packed sample, batch 8 x 128, AdamW 2e-3


def steps_per_node(schedule) -> int:
    return H * sum(n for rnd in schedule for node, n in rnd if node == NODES[0])


def config(seed: int, steps: int):
    from diloco.config import validate

    overrides = [f"seed={seed}", f"optim.total_steps={steps}", f"train.max_steps={steps}", "device=cpu"]
    return validate(compose_experiment(EXPERIMENT, overrides))


class Node:
    """One DumbDiLoCo worker node in the calling thread: its model, AdamW and schedule, data shard and
    the real node strategy (synchronous lanes, a clock that never moves)."""

    def __init__(self, cfg, repo: Path, state_dir: Path, index: int, tokenizer):
        from diloco.data import SequenceStream
        from diloco.dumb_diloco.node.strategy import DumbDiLoCo
        from diloco.dumb_diloco.settings import Settings
        from diloco.model import build_model
        from diloco.schedule import build_schedule
        from diloco.train import build_optimizer

        self.model = build_model(cfg.model, seed=cfg.seed)
        self.opt = build_optimizer(cfg, self.model, torch.device("cpu"))
        self.sched = build_schedule(cfg, self.opt, lambda step: step)
        d = cfg.data
        self.stream = SequenceStream(
            d, tokenizer, d.train_split, index, len(NODES), shuffle_seed=d.shuffle_seed
        )
        settings = Settings(
            role="worker",
            node_id=NODES[index],
            repo_id=str(repo),
            inner_steps=H,
            poll_interval=1.0,
            async_delta_upload=False,
            async_global_poll=False,
            state_dir=str(state_dir),
        )
        self.node = DumbDiLoCo(
            self.model, settings, optimizer=self.opt, clock=lambda: 0.0, sleep=lambda s: None
        )
        self.batch, self.step = cfg.train.batch_size, 0

    def train(self, increments: int) -> None:
        for _ in range(increments * H):
            b = self.stream.next_batch(self.batch)
            loss = self.model(input_ids=b.input_ids, labels=b.labels).loss
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            self.node.after_inner_step(self.step)  # a boundary uploads, then installs a newer global


def run(variant: str, schedule: str, seed: int) -> dict:
    """One emulated run: the initial and the final global's held-out loss, and each round's deltas."""
    from diloco.data import eval_batches, load_tokenizer
    from diloco.dumb_diloco.master.loop import OuterConfig, OuterLoop
    from diloco.dumb_diloco.master.recovery import MasterState
    from diloco.dumb_diloco.store.transport import DirectoryTransport
    from diloco.model import build_model
    from diloco.train import evaluate

    rounds = SCHEDULES[schedule]
    cfg = config(seed, steps_per_node(rounds))
    tok = load_tokenizer(cfg.data.tokenizer)
    held_out = eval_batches(cfg.data, tok, cfg.eval.tokens, cfg.eval.micro_batch_size)
    model = build_model(cfg.model, seed=cfg.seed)
    v = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        transport = DirectoryTransport(repo)
        period = v.get("delayed_nesterov_period", 0)
        outer = OuterConfig(
            "master",
            0.7,
            0.9,
            max_file_bytes=2**28,
            delayed_nesterov_period=period,
            staleness_weighting=v.get("staleness_weighting", False),
        )
        loop = OuterLoop(transport, MasterState.from_model_state(model.state_dict()), outer)
        loop.publish()
        initial = evaluate(model, held_out, torch.device("cpu"), nullcontext())
        nodes = [Node(cfg, repo, Path(tmp) / "state", i, tok) for i in range(len(NODES))]
        for node in nodes:
            node.node.start()
        applied, staleness = [], []
        for rnd in rounds:
            for name, increments in rnd:
                nodes[NODES.index(name)].train(increments)
            result = loop.run_once()
            applied.append(len(result.applied))
            staleness.append([e.staleness for e in result.applied])
        for node in nodes:
            node.node.close()
        model.load_state_dict(loop.state.published())
        final = evaluate(model, held_out, torch.device("cpu"), nullcontext())
    return {"initial_loss": initial, "final_loss": final, "deltas_per_round": applied, "staleness": staleness}


def _one_thread() -> None:
    torch.set_num_threads(1)


def _run(key: tuple[str, str, int]) -> dict:
    return run(*key)


def table(rows: list[dict]) -> str:
    lines = [
        "| outer optimizer | schedule | deltas per round | initial loss | final loss per seed | final - initial, mean ± sd |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        gains = [x["final_loss"] - x["initial_loss"] for x in r["runs"]]
        per = ", ".join(f"{x['final_loss']:.4f}" for x in r["runs"])
        sd = statistics.stdev(gains) if len(gains) > 1 else 0.0
        init = ", ".join(f"{x['initial_loss']:.4f}" for x in r["runs"])
        lines.append(
            f"| {r['variant']} | {r['schedule']} | {r['runs'][0]['deltas_per_round']} | {init} | {per} "
            f"| {statistics.fmean(gains):+.4f} ± {sd:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "results" / "stale-rounds")
    p.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    p.add_argument("--jobs", type=int, default=2, help="runs at once, a process of one thread each")
    args = p.parse_args(argv)
    keys = [(v, s, seed) for v in VARIANTS for s in SCHEDULES for seed in args.seeds]
    # every run is independent and deterministic: a pool only changes when it ends, not what it computes
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn"), initializer=_one_thread) as pool:
        done = dict(zip(keys, pool.map(_run, keys)))
    rows = []
    for variant in VARIANTS:
        for schedule in SCHEDULES:
            runs = [done[variant, schedule, seed] for seed in args.seeds]
            rows.append({"variant": variant, "schedule": schedule, "seeds": args.seeds, "runs": runs})
    print(table(rows), flush=True)
    record = {
        **records.provenance(records.command_line()),
        "experiment": EXPERIMENT,
        "inner_steps": H,
        "outer": {"lr": 0.7, "momentum": 0.9},
        "schedules": {k: [list(map(list, r)) for r in v] for k, v in SCHEDULES.items()},
        "rows": rows,
    }
    records.write_tuning_record(args.out, record, table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

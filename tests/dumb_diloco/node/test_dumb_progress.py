"""`distributed.budget: global` (issue 12; src/diloco/dumb_diloco/node/progress.py, src/diloco/schedule.py): the
nodes share num_nodes x max_steps node-steps and the inner lr follows the run's step.

- the schedule is transformers' warmup + cosine bit for bit at the local step (`budget: local` unchanged),
  and never rises again past optim.total_steps;
- the trainer (train.py) stops and schedules at the run step the strategy reports (a half-pace strategy);
- equal-speed nodes in lock step: every node's run step is its local step exactly, at every step (so its
  lr is the plain schedule's, bit for bit), and each stops at max_steps: the total is the budget exactly;
- one node stepping at half (or a quarter of) the others' pace, in a fixed interleaving: the fast nodes run
  more steps, every node stops (the slow one within about one of its inner loops of the fast ones), the
  total is the budget within one round of deltas (num_nodes x H; measured: within 2 of 144), and every
  step lands in the global exactly once (the applied deltas' steps sum to the nodes' steps).

Lock step in one process, no threads (v1 upload and poll), a clock that never moves: no timing.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from dumb_helpers import FakeClock, Tiny, make_loop, nudge, publish, settings
from omegaconf import OmegaConf
from trainer_utils import compose_cfg, read_metrics, train
from transformers import get_cosine_schedule_with_warmup

from diloco.config import ConfigError, validate
from diloco.dumb_diloco.node.progress import GlobalProgress
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.dumb_diloco.wire.tensor_format import parse_header
from diloco.schedule import build_schedule, cosine_with_warmup

pytestmark = pytest.mark.usefixtures("no_network")
H = 3


def schedules(warmup: int, total: int, progress):
    """transformers' scheduler and ours (at `progress`), each on its own optimizer with lr 1."""
    cfg = SimpleNamespace(optim=SimpleNamespace(warmup_steps=warmup, total_steps=total))
    opts = [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0) for _ in range(2)]
    return get_cosine_schedule_with_warmup(opts[0], warmup, total), build_schedule(cfg, opts[1], progress)


@pytest.mark.parametrize("warmup,total", [(30, 400), (0, 7), (5, 5)])
def test_the_schedule_at_the_local_step_is_transformers_bit_for_bit(warmup, total):
    reference, ours = schedules(warmup, total, lambda step: step)
    for _ in range(total + 1):
        assert ours.get_last_lr() == reference.get_last_lr()
        reference.step(), ours.step()


def test_the_schedule_never_rises_past_its_end():
    factors = [cosine_with_warmup(s / 4, 10, 100) for s in range(0, 4 * 300)]
    peak = factors.index(max(factors))
    assert all(a >= b for a, b in zip(factors[peak:], factors[peak + 1 :]))  # down from the peak, never up
    assert factors[-1] == cosine_with_warmup(100, 10, 100) == 0.0
    assert cosine_with_warmup(-3, 10, 100) == 0.0


def test_the_run_step_by_hand():
    progress = GlobalProgress("a", num_nodes=4, global_budget=False)
    progress.installed({"a": 10, "b": 50, "c": 90}, 12)
    assert [progress.step(s) for s in (0, 11, 400)] == [0, 11, 400]
    progress = GlobalProgress("a", num_nodes=4, global_budget=True)
    progress.installed({"a": 10, "b": 50, "c": 90, "d": -1}, 12)  # d: nothing applied yet
    assert progress.step(14) == 150 / 4 + 4
    progress.installed({"a": 14, "b": 50, "c": 90, "d": 2}, 14)  # lower (d is behind): held until caught up
    held = 150 / 4 + 4  # the run step before the install; after it the estimate is 156 / 4 + (step - 14)
    assert [progress.step(s) for s in (14, 15, 16, 17, 18)] == [held, held, held, 156 / 4 + 3, 156 / 4 + 4]


def test_the_pace_and_a_round_by_hand():
    progress = GlobalProgress("a", num_nodes=3, global_budget=True)
    assert (progress.pace, progress.round_steps(25)) == (1.0, 25)  # nothing installed yet: H
    progress.installed({"a": 10, "b": 50}, 24, {}, 2000)  # no node's time in the global: no measure
    assert progress.pace == 1.0
    progress.installed({"a": 10, "b": 50}, 24, {"b": 1000, "c": 0}, 0)  # this node's own time unknown
    assert progress.pace == 1.0
    progress.installed({"a": 10, "b": 50}, 24, {"a": 2100, "b": 1000, "c": 1250}, 2000)  # "b": the fastest
    assert (progress.pace, progress.round_steps(25), progress.round_steps(1)) == (0.5, 12, 1)
    progress.installed({"a": 30, "b": 50}, 60, {"a": 2000, "b": 1000}, 900)  # faster than every node: 1
    assert (progress.pace, progress.round_steps(25)) == (1.0, 25)
    restored = GlobalProgress("a", num_nodes=3, global_budget=True)
    restored.load_state_dict(progress.state_dict() | {"pace": 0.5})
    assert restored.round_steps(25) == 12 and restored.state_dict()["pace"] == 0.5


def run(tmp_path, pace: list[int], max_steps: int, tick_seconds: float = 0.0, **kw):
    """Nodes i = 0..N-1 (workers, `budget: global`, translate + install when staged) and a master loop
    with a quorum of N nodes. Node i takes a turn every pace[i] ticks: the trainer's loop check (stop
    once its run step reaches max_steps: its last delta and final marker), else one step. The master
    runs one round after every tick. The nodes' clock moves `tick_seconds` a tick (0: they poll only at
    boundaries; 1: at every turn, poll_interval being 1 s). Returns the nodes, the master loop and its repository, and each
    node's (local step, run step) before every step it took."""
    repo = DirectoryTransport(tmp_path / "repo")
    publish(repo, Tiny().state_dict(), 0)
    loop, _ = make_loop(repo, min_deltas_per_round=len(pace), lr=1.0, momentum=0.0)
    nodes, clock = [], FakeClock()
    for i in range(len(pace)):
        s = settings(tmp_path / "repo", node_id=f"n{i}", budget="global", **kw)
        node = DumbDiLoCo(Tiny(), s, repo, num_workers=len(pace), tokens_per_step=1, clock=clock)
        node.start()
        nodes.append(node)
    seen: list[list[tuple[int, float]]] = [[] for _ in pace]
    running, tick = set(range(len(pace))), 0
    while running:
        tick += 1
        clock.advance(tick_seconds)
        assert tick < 100 * max_steps, "a node never stopped"
        for i in sorted(running):
            node = nodes[i]
            if tick % pace[i]:
                continue
            if node.progress(node.local_step) >= max_steps:  # train.py's loop condition
                node.send_final(node.clock() + 5)
                running.discard(i)
                continue
            seen[i].append((node.local_step, node.progress(node.local_step)))
            g = torch.Generator().manual_seed(1000 * i + node.local_step)  # every delta a distinct payload
            nudge(node.model, 1e-3 * float(torch.rand(1, generator=g)))
            node.on_step(node.local_step + 1)
        loop.run_once()
    for _ in range(3):  # the last deltas (below the quorum once the others finished)
        loop.run_once(flush=True)
    return nodes, loop, repo, seen


def landed_once(nodes, loop, repo) -> int:
    """Every node's every step is in exactly one applied delta (the deltas' step counts, from their
    headers, sum to the node's steps; no delta is applied twice); returns the run's node-steps."""
    rows = [r for r in loop.state.ledger.to_json() if r["status"] == "applied"]
    for node in nodes:
        mine = [r for r in rows if r["node_id"] == node.s.node_id]
        assert len({r["local_step"] for r in mine}) == len(mine)
        assert max(r["local_step"] for r in mine) == node.local_step  # the final delta is in
        assert sum(header_steps(node, repo, [r["local_step"] for r in mine])) == node.local_step
    assert sum(loop.state.ledger.included.values()) == sum(n.local_step for n in nodes)
    return sum(n.local_step for n in nodes)


@pytest.mark.parametrize("install", ["translate", "replace"])
def test_equal_nodes_in_lock_step_spend_the_budget_exactly_at_the_plain_schedule(tmp_path, install):
    max_steps, n = 4 * H + 1, 3  # the last step is not a boundary: the final delta carries it
    kw = dict(install=install, install_when_staged=install == "translate")
    nodes, loop, repo, seen = run(tmp_path, [1] * n, max_steps, **kw)
    for node_seen in seen:
        assert [run_step for _, run_step in node_seen] == list(range(max_steps))  # exactly the local step
    assert [node.local_step for node in nodes] == [max_steps] * n
    assert landed_once(nodes, loop, repo) == n * max_steps

    # the lr of a node at these run steps is the plain schedule's, bit for bit
    reference, ours = schedules(2, max_steps, lambda step: seen[0][step][1] if step < max_steps else step)
    for _ in range(max_steps):
        assert ours.get_last_lr() == reference.get_last_lr()
        reference.step(), ours.step()


@pytest.mark.parametrize("slow_pace", [2, 4])
def test_a_slow_node_stops_with_the_fast_ones_and_the_budget_is_spent_within_a_round(tmp_path, slow_pace):
    max_steps, n = 12 * H, 4
    pace = [1, 1, 1, slow_pace]
    nodes, loop, repo, seen = run(tmp_path, pace, max_steps, install="translate", install_when_staged=True)
    steps = [node.local_step for node in nodes]
    assert min(steps[:3]) > max_steps > steps[3]  # the fast nodes train on, the slow one stops early
    total = landed_once(nodes, loop, repo)
    assert abs(total - n * max_steps) <= n * H, (steps, total)  # within one round of deltas
    # the nodes stop together: each fast node's last step is within a round of the slow node's end
    ends = [len(s) * p for s, p in zip(seen, pace)]  # the tick of each node's last step
    assert max(ends) - min(ends) <= slow_pace * 2 * H, ends
    for node_seen in seen:  # the run step (hence the lr) never goes back, and ends at max_steps
        run_steps = [r for _, r in node_seen]
        assert run_steps == sorted(run_steps) and run_steps[-1] < max_steps


def header_steps(node, repo, local_steps: list[int]) -> list[int]:
    """The steps each of `node`'s deltas at `local_steps` covers (from their headers: 1 token per step)."""
    paths = [f"nodes/{node.s.node_id}/delta_{step}.safetensors" for step in local_steps]
    return [int(parse_header(repo.read(path)).metadata["tokens_since_baseline"]) for path in paths]


def delta_steps(node, repo) -> list[int]:
    """The steps each of `node`'s uploaded deltas covers, in the order it uploaded them."""
    steps = sorted(int(p.stem.split("_")[1]) for p in (repo.root / "nodes" / node.s.node_id).glob("delta_*"))
    return header_steps(node, repo, steps)


def test_dynamic_local_steps_give_a_slow_node_shorter_rounds_and_the_master_more_steps(tmp_path):
    """Async Local-SGD's dynamic local updates: a node at half the others' pace runs about H/2 steps a round,
    so the quorum of every node fills twice as often; every step still lands once, within the budget."""
    h, max_steps, pace = 8, 96, [1, 1, 1, 2]
    kw = dict(install="translate", install_when_staged=True, inner_steps=h)
    runs = {}
    for dynamic in (False, True):
        path = tmp_path / str(dynamic)
        nodes, loop, repo, _ = run(path, pace, max_steps, 1.0, dynamic_local_steps=dynamic, **kw)
        total = landed_once(nodes, loop, repo)
        assert abs(total - len(pace) * max_steps) <= len(pace) * h, total
        runs[dynamic] = (nodes, loop, repo)
    nodes, loop, repo = runs[True]
    slow, fast = delta_steps(nodes[3], repo), [delta_steps(n, repo) for n in nodes[:3]]
    assert slow[0] == h and sorted(slow[1:-1])[len(slow) // 2] == h // 2, slow  # after the first round: H/2
    assert all(set(f[:-1]) == {h} for f in fast), fast  # the fast nodes keep H
    assert loop.state.outer_step >= 1.6 * runs[False][1].state.outer_step  # no round waits for 2H slow steps
    assert nodes[3].global_progress.pace == pytest.approx(0.5, abs=0.1)


NODE = ["distributed.node_id=n0", "distributed.repo_id=/tmp/repo"]


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["distributed.budget=tokens"], "distributed.budget must be local or global, got 'tokens'"),
        (
            ["distributed.budget=global", "launch.nodes=1"],
            "distributed.budget=global needs nodes",
        ),
        (
            ["distributed.dynamic_local_steps=true"],
            "distributed.dynamic_local_steps needs distributed.budget=global (a slow node would train alone",
        ),
    ],
)
def test_a_bad_budget_stops_with_one_line(overrides, line):
    cfg = compose_cfg(["experiment=tiny/dumb_diloco", *NODE, *overrides])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert line in str(err.value) and "\n" not in str(err.value)


def test_the_heterogeneous_experiment_is_tiny_dumb_diloco_with_a_global_budget():
    hetero = compose_cfg(["experiment=tiny/dumb_diloco_hetero", *NODE, "data.shard=3", "data.num_shards=4"])
    validate(hetero)
    plain = compose_cfg(["experiment=tiny/dumb_diloco", *NODE, "data.shard=3", "data.num_shards=4"])
    block = [OmegaConf.to_container(c.distributed, resolve=False) for c in (hetero, plain)]
    differ = {k for k, v in block[0].items() if block[1][k] != v}
    assert (
        differ == {"budget", "drain_timeout", "dynamic_local_steps", "poll_interval"}
        and hetero.distributed.budget == "global"
    )
    assert OmegaConf.to_container(hetero.optim) == OmegaConf.to_container(plain.optim)
    assert hetero.launch.nodes == 4


def test_the_trainer_stops_and_schedules_at_the_strategys_run_step(tmp_path):
    """train.py's seam: a strategy whose run step is half its local step trains twice train.max_steps, and
    its lr after step s is the schedule at s / 2."""
    from diloco.distributed import LocalTraining

    class HalfPace(LocalTraining):
        def progress(self, step: int) -> float:
            return step / 2

    def build(cfg, ctx, model, optimizer, **seams):
        return HalfPace(ctx)

    run_dir = train(tmp_path, "train.max_steps=6", "optim.total_steps=6", "optim.warmup_steps=2", build=build)
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 12
    lrs = {r["step"]: r["lr"] for r in read_metrics(run_dir) if "lr" in r}
    assert sorted(lrs) == list(range(1, 13))
    for step, lr in lrs.items():
        assert lr == pytest.approx(3e-3 * cosine_with_warmup(step / 2, 2, 6), rel=1e-12, abs=1e-15)

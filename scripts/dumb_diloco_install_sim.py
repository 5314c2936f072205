"""How a DumbDiLoCo node installs a global, measured (issue 12): `replace` (the specification) against
`translate` (src/diloco/dumb_diloco/node/install.py), and how soon after the master's round the install comes.

Four nodes (the project's own DumbDiLoCo nodes and OuterLoop over a shared directory) train the micro
model in one process, in lock step, each on its own shard of the bundled sample: H=10, AdamW lr 3e-3
with a cosine schedule, the tiny family's outer optimizer (lr 0.5, Nesterov 0.8) and a quorum of 4, so
the master makes one round of all four deltas after every boundary. What differs is when each node
installs that round's global:

- `sync`: at once (zero delay): synchronous DiLoCo exactly (tests/dumb_diloco/node/test_dumb_translate.py);
- `replace@boundary`: at the node's next boundary, as the specification's node does (polls there);
- `translate@boundary`, `translate@+5`, `translate@+3`: translate on install, at the next boundary or
  as soon as it is staged, which here is 5 or 3 steps after the round (a poll delay).

Printed and written to results/bench/install_sim.{json,md}: the held-out perplexity of the final global
(after a last round) per seed and the mean over seeds, and each mode's gap to `sync`.

    python scripts/dumb_diloco_install_sim.py                  # 2 seeds x 400 steps: ~6 min on 2 cores
    python scripts/dumb_diloco_install_sim.py --steps 2000      # the issue's longer horizon
    python scripts/dumb_diloco_install_sim.py --regime paper    # the paper configs' regime (below)

`--regime paper` (the 150M config's 8 nodes and the paper's outer lr 0.7, Nesterov 0.9) asks whether the
paper-scale DumbDiLoCo configs converge: `sync`; `spec@per-delta`, the specification (replace at the
boundary, quorum 0), where boundaries 10-60 minutes apart and a 60 s poll make every delta its own outer
step at the full outer lr (emulated: a master round after each node's upload); `translate@+5,per-delta`,
the same one-step-per-delta rounds with translate; `translate@+5,quorum`, what the configs use: a quorum
of every node and translate as soon as staged.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from transformers import get_cosine_schedule_with_warmup

from diloco.data import SequenceStream, eval_batches, load_tokenizer
from diloco.dumb_diloco.master.loop import OuterLoop
from diloco.dumb_diloco.master.recovery import MasterState
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import Settings
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.model import build_model
from diloco.train import evaluate

ROOT = Path(__file__).resolve().parents[1]
H = 10
REGIMES = {  # name: nodes, outer lr, outer momentum, modes
    "tiny": (
        4,
        0.5,
        0.8,
        {  # mode: (install, delay after the round in steps (None: the node's next boundary), quorum)
            "sync": ("translate", 0, True),
            "replace@boundary": ("replace", None, True),
            "translate@boundary": ("translate", None, True),
            "translate@+5": ("translate", 5, True),
            "translate@+3": ("translate", 3, True),
        },
    ),
    "paper": (
        8,
        0.7,
        0.9,
        {  # quorum False: a round after each node's upload (each delta its own step)
            "sync": ("translate", 0, True),
            "spec@per-delta": ("replace", None, False),
            "translate@+5,per-delta": ("translate", 5, False),
            "translate@+5,quorum": ("translate", 5, True),
        },
    ),
}
NODES, OUTER_LR, OUTER_MU, MODES = REGIMES["tiny"]


def run(
    cfg, tokenizer, batches, steps: int, seed: int, install: str, delay: int | None, quorum: bool = True
) -> float:
    root = Path(tempfile.mkdtemp())
    repo = DirectoryTransport(root / "repo")
    init = build_model(cfg.model, seed=seed)
    outer = OuterLoop(
        repo,
        MasterState.from_model_state(init.state_dict()),
        node_id="master",
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MU,
        poll_interval=1e9,
        state_dir=None,
        max_file_bytes=2**30,
        min_deltas_per_round=NODES if quorum else 0,
    )
    outer.publish()
    nodes = []
    for i in range(NODES):
        model = build_model(cfg.model, seed=seed)
        s = Settings(
            role="worker",
            node_id=f"w{i}",
            repo_id=str(root / "repo"),
            inner_steps=H,
            poll_interval=1e9,
            async_delta_upload=False,
            async_global_poll=False,
            state_dir=str(root / "state"),
            reset_inner_optimizer=False,
            install=install,
            install_when_staged=install == "translate" and delay is not None,
        )
        coord = DumbDiLoCo(model, s, repo)
        coord.start()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        sched = get_cosine_schedule_with_warmup(opt, 20, steps)
        stream = SequenceStream(cfg.data, tokenizer, "train", i, NODES)
        nodes.append((model, coord, opt, sched, stream))
    due: list[tuple[int, object]] = []  # (step at which the nodes get it, snapshot)
    for step in range(1, steps + 1):
        for _, snap in [d for d in due if d[0] == step]:
            for _, coord, *_ in nodes:
                coord.stage(snap)
        due = [d for d in due if d[0] != step]
        for model, coord, opt, sched, stream in nodes:
            batch = stream.next_batch(4)
            model(input_ids=batch.input_ids, labels=batch.labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            coord.on_step(step)  # at a boundary: upload, poll the repository, install what is staged
            if step % H == 0 and not quorum:  # one outer step per delta, as it arrives
                outer.run_once()
                if delay is not None:
                    due.append((step + delay, outer.snapshot()))
        if step % H == 0 and quorum:
            outer.run_once()
            if delay == 0:  # synchronous: every node installs the round at once
                for _, coord, *_ in nodes:
                    coord.stage(outer.snapshot())
                    coord.install_staged()
            elif delay is not None:
                due.append((step + delay, outer.snapshot()))
            # delay None: the nodes find it in the repository at their next boundary's poll
    final = build_model(cfg.model, seed=seed)
    final.load_state_dict(outer.state.published())
    return evaluate(final, batches, torch.device("cpu"), torch.autocast("cpu", enabled=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=str(ROOT / "results" / "bench"))
    ap.add_argument("--regime", choices=REGIMES, default="tiny")
    args = ap.parse_args()
    global NODES, OUTER_LR, OUTER_MU, MODES
    NODES, OUTER_LR, OUTER_MU, MODES = REGIMES[args.regime]
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=micro", "data=sample", "data.seq_len=64"])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    batches = eval_batches(cfg.data, tokenizer, 8192, 4)  # the held-out split, never trained on
    t0, rows = time.time(), {}
    commit = subprocess.run(  # at the start: the code this run imported
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout
    )
    for name, (install, delay, quorum) in MODES.items():
        ppl = [
            math.exp(run(cfg, tokenizer, batches, args.steps, s, install, delay, quorum)) for s in args.seeds
        ]
        rows[name] = {"ppl": ppl, "mean": sum(ppl) / len(ppl), "spread": max(ppl) - min(ppl)}
        print(f"{name}: {[round(p, 2) for p in ppl]}", flush=True)
    sync = rows["sync"]["mean"]
    record = {
        "command": f"python scripts/dumb_diloco_install_sim.py --steps {args.steps} --seeds {' '.join(map(str, args.seeds))}"
        + ("" if args.regime == "tiny" else f" --regime {args.regime}"),
        "commit": commit,
        "dirty": dirty,
        "machine": f"{platform.node()} {platform.machine()}, {torch.get_num_threads()} thread",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - t0),
        "setup": {
            "regime": args.regime,
            "nodes": NODES,
            "H": H,
            "outer_lr": OUTER_LR,
            "outer_momentum": OUTER_MU,
            "steps": args.steps,
            "seeds": args.seeds,
            "model": "micro",
            "data": "sample (4 shards), held-out eval",
        },
        "results": {k: v | {"vs_sync": v["mean"] / sync - 1} for k, v in rows.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"install_sim_{args.steps}" + ("" if args.regime == "tiny" else f"_{args.regime}")
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        f"# DumbDiLoCo install modes, {args.steps} steps, seeds {args.seeds}, {NODES} nodes, outer lr {OUTER_LR}, "
        f"Nesterov {OUTER_MU}",
        "",
        f"`{record['command']}` at {commit[:10]}{' (dirty)' if dirty else ''}, {record['date']}, {record['seconds']} s.",
        "",
        "| mode | held-out ppl per seed | mean | spread | vs sync |",
        "|---|---|---|---|---|",
    ]
    for k, v in record["results"].items():
        per = ", ".join(f"{p:.2f}" for p in v["ppl"])
        lines.append(f"| {k} | {per} | {v['mean']:.2f} | {v['spread']:.2f} | {v['vs_sync']:+.1%} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

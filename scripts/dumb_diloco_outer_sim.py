"""How DumbDiLoCo's outer learning rate and momentum behave when rounds do not line up with boundaries.

Three nodes (a master and two workers, the project's own `Coordinator` and `OuterLoop` over a shared
directory) train the micro model in one process, in lock step, on three shards of the bundled sample:
30 steps, H=5, AdamW lr 3e-3. The master's outer round runs either once per H steps after every node's
boundary ("all": one round averages the 3 deltas, as synchronous DiLoCo) or after each node's boundary
("delta": one round per delta, what a short poll_interval does to nodes that drift apart). Printed: the
held-out loss of the final global model, for several (outer_lr, outer_momentum). docs/dumb_diloco.md
quotes the table.

    python scripts/dumb_diloco_outer_sim.py       # ~3 minutes on 2 CPU cores
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from transformers import get_cosine_schedule_with_warmup

from diloco.data import SequenceStream, eval_batches, load_tokenizer
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import Settings
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.model import build_model
from diloco.train import evaluate

STEPS, H, NODES = 30, 5, ("master-1", "worker-1", "worker-2")
GRID = [(0.7, 0.9), (0.5, 0.5), (0.7, 0.3), (0.7, 0.0)]


def run(cfg, tokenizer, batches, outer_lr: float, outer_momentum: float, rounds: str) -> tuple[float, int]:
    root = Path(tempfile.mkdtemp())
    repo = DirectoryTransport(root / "repo")
    nodes = []
    for i, node_id in enumerate(NODES):
        model = build_model(cfg.model, seed=cfg.seed)
        settings = Settings(
            role="master" if i == 0 else "worker",
            node_id=node_id,
            repo_id=str(root / "repo"),
            inner_steps=H,
            poll_interval=1e9,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            async_delta_upload=False,
            async_global_poll=False,
            state_dir=str(root / "state"),
        )
        coord = DumbDiLoCo(model, settings, repo, manual_rounds=i == 0)  # the master's rounds: by hand below
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        sched = get_cosine_schedule_with_warmup(opt, 2, STEPS)
        nodes.append((model, coord, opt, sched, SequenceStream(cfg.data, tokenizer, "train", i, len(NODES))))
    nodes[0][1].start()
    outer = nodes[0][1].outer  # never started: each run_once below is one round
    for _, coord, *_ in nodes[1:]:
        coord.start()
    for step in range(1, STEPS + 1):
        for model, coord, opt, sched, stream in nodes:
            batch = stream.next_batch(4)
            model(input_ids=batch.input_ids, labels=batch.labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if coord.on_step(step).reset_optimizer:
                opt.state.clear()
            if rounds == "delta" and step % H == 0:
                outer.run_once()
        if rounds == "all" and step % H == 0:
            outer.run_once()
    outer.run_once()
    final = build_model(cfg.model, seed=cfg.seed)
    final.load_state_dict(outer.state.published())
    return evaluate(
        final, batches, torch.device("cpu"), torch.autocast("cpu", enabled=False)
    ), outer.state.outer_step


def main() -> None:
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    config_dir = str(Path(__file__).resolve().parents[1] / "configs")
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["model=micro", "data=sample", "data.seq_len=64"])
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    batches = eval_batches(cfg.data, tokenizer, 4096, 4)
    initial = evaluate(
        build_model(cfg.model, seed=cfg.seed),
        batches,
        torch.device("cpu"),
        torch.autocast("cpu", enabled=False),
    )
    print(f"initial global eval loss {initial:.2f}")
    print("| outer lr, momentum | one round of all 3 deltas per H | one round per delta |")
    print("|---|---|---|")
    for lr, mu in GRID:
        cells = [run(cfg, tokenizer, batches, lr, mu, rounds) for rounds in ("all", "delta")]
        print(
            f"| {lr}, {mu} | " + " | ".join(f"{loss:.2f} ({n} outer steps)" for loss, n in cells) + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()

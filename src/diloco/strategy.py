"""What the trainer (train.py) asks of a distributed strategy, in the order it asks it.

    strategy = build_strategy(cfg, ctx, model, optimizer)   # cfg: validate's; no I/O, threads, collectives
    train_model = strategy.wrap(model)                     # DDP inside a worker, or the model itself
    strategy.load_state_dict(state["strategy"])            # only when resuming
    strategy.start()                                       # connect, start threads, first rendezvous
    while strategy.progress(step) < max_steps:             # the run's step (the lr schedule's too)
        with strategy.grad_sync(last_micro_step):          # around each micro-step's backward
            ...
        metrics = strategy.after_inner_step(step)          # after each optimizer step: outer rounds
        with strategy.eval_weights(step): evaluate(model)  # the weights that represent the run
    changed = strategy.finish()                            # end of training, before the final evaluation
    strategy.state_dict()                                  # any checkpoint, the last one after finish()
    strategy.summary()                                     # pure: figures for summary.json
    strategy.close()                                       # always, also after an error; idempotent

`num_workers` is how many workers' samples one step stands for (effective_step, tokens_seen).
`progress(step)` is the run's step after `step` local steps: `step` itself, except for a DumbDiLoCo node
under `budget: global`, whose estimate of the whole run's step lets fast nodes train on and slow ones stop
early, and sets the lr (diloco.schedule).
Implementations: LocalTraining and DataParallel (distributed.py), DiLoCo (diloco.py), DumbDiLoCo
(dumb_diloco/node/strategy.py), NodeRanks (dumb_diloco/node/ranks.py); tests/test_strategy_protocol.py checks that each
has these members with these signatures. docs/architecture.md draws the whole data flow.

A strategy is built from its own typed `distributed:` block (what `diloco.config.validate` returned) and,
if it needs more of the run, a `RunShape`; never from the whole config tree.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from diloco.schema import Config


@dataclass(frozen=True)
class RunShape:
    """What a strategy may know of the run outside its own `distributed:` block."""

    batch_size: int  # train.batch_size: sequences per optimizer step (per worker or node)
    seq_len: int  # data.seq_len
    shard: int | None  # data.shard: this node's data shard (None: not set)
    num_shards: int | None  # data.num_shards
    nodes: int  # launch.nodes
    tokenizer: str | None = None  # data.tokenizer: what a published model is read with

    @classmethod
    def of(cls, cfg: Config) -> RunShape:
        """The shape of a validated config (schema.Config)."""
        return cls(
            batch_size=cfg.train.batch_size,
            seq_len=cfg.data.seq_len,
            shard=cfg.data.shard,
            num_shards=cfg.data.num_shards,
            nodes=cfg.launch.nodes,
            tokenizer=cfg.data.tokenizer,
        )


@runtime_checkable
class Strategy(Protocol):
    name: str
    num_workers: int

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def start(self) -> None: ...

    def grad_sync(self, last_micro_step: bool) -> AbstractContextManager: ...

    def after_inner_step(self, step: int) -> dict[str, float]: ...

    def progress(self, step: int) -> float: ...

    def eval_weights(self, step: int) -> AbstractContextManager: ...

    def finish(self) -> bool: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def summary(self) -> dict: ...

    def close(self) -> None: ...

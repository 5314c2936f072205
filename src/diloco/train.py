"""Train a Llama on C4 (or the bundled sample): single process, DDP, DiLoCo or DumbDiLoCo.

    python -m diloco.train <hydra overrides>                      # one process
    torchrun --nproc_per_node G -m diloco.train distributed=ddp   # the same, several ranks

`run()` reads top to bottom: set-up, data, model, optimizers and strategy, resume, loop, the end. The
loop and the end are `Trainer.train()`'s, an ordinary training loop (gradient accumulation, clip, AdamW,
schedule, eval, checkpoint) whose per-step body is `Trainer.inner_step()`; the distributed strategy attaches at the named lifecycle points of `diloco.strategy.Strategy`
(start, grad_sync, after_inner_step, eval_weights, finish, state, summary, close).
docs/architecture.md draws the data flow.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from diloco import checkpoint, preflight, schema
from diloco.checkpoint import CheckpointError
from diloco.comm import Collective, CommError
from diloco.config import (
    ConfigError,
    check_batch_split,
    check_command_line,
    print_error,
    schedule_notice,
    validate,
)
from diloco.data import DataError, PrefetchedStream, SequenceStream, eval_batches, load_tokenizer
from diloco.distributed import (
    DistContext,
    DistributedError,
    LocalShards,
    StopAgreement,
    StopFlag,
    check_same_start,
    init_distributed,
    shard_model,
    shutdown_distributed,
)
from diloco.errors import RunError
from diloco.metrics import RunLogger, git_commit, nothing_left_on
from diloco.model import build_model, count_parameters, shape_fingerprint
from diloco.schedule import build_schedule
from diloco.strategy import RunShape, Strategy
from diloco.timing import Clock, InjectedPace

log = logging.getLogger("diloco")

USER_ERRORS = (ConfigError, RunError, DataError, CheckpointError, CommError, DistributedError)


def build_strategy(
    cfg: schema.Config | DictConfig,
    ctx: DistContext,
    model,
    optimizer,
    *,
    collective: Collective | None = None,
    transport: Callable | None = None,
) -> Strategy:
    """The one place that knows the distributed modes; each result satisfies diloco.strategy.Strategy
    (tests/test_strategy_protocol.py). `cfg`: what validate returned (a raw config is validated here).
    Each strategy gets its own typed `distributed` block and, if it needs more, the run's RunShape.
    Seams for scripts and tests: `collective`, DiLoCo's cross-worker Collective (default: over the
    process group); `transport`, a function that wraps the store a DumbDiLoCo node opens (a Transport
    to a Transport, e.g. a throttled link)."""
    if not isinstance(cfg, schema.Config):
        cfg = validate(cfg)
    dcfg = cfg.distributed
    mode = dcfg.mode
    if mode == "none":
        from diloco.distributed import LocalTraining

        return LocalTraining(ctx)
    if mode == "ddp":
        from diloco.distributed import DataParallel, FullyShardedData

        if ctx.sharded:
            return FullyShardedData(ctx, model, log_every=dcfg.comm_log_every)
        return DataParallel(ctx, model, bucket_cap_mb=dcfg.ddp_bucket_cap_mb, log_every=dcfg.comm_log_every)
    if mode == "diloco":
        from diloco.diloco import DiLoCo

        return DiLoCo.from_config(dcfg, ctx, model, optimizer, collective=collective)
    if mode == "dumb_diloco":
        from diloco.distributed import DataParallel, LocalTraining
        from diloco.dumb_diloco.node.strategy import DumbDiLoCo

        if dcfg.role == "single" or not dcfg.enabled:  # no node: trains like distributed=none (or ddp)
            return DataParallel(ctx, model) if ctx.world_size > 1 else LocalTraining(ctx)
        return DumbDiLoCo.from_config(dcfg, RunShape.of(cfg), ctx, model, optimizer, transport=transport)
    raise ConfigError(f"distributed.mode must be none, ddp, diloco or dumb_diloco, got {mode!r}")


@torch.no_grad()
def evaluate(model, batches, device, autocast) -> float:
    """Mean next-token loss over every target token of the fixed held-out set."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for b in batches:
        ids, labels = b.input_ids.to(device), b.labels.to(device)
        with autocast:
            logits = model(input_ids=ids).logits  # [B, T, V]
        targets = labels[:, 1:]
        total += F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        count += int((targets != -100).sum())
    model.train()
    return float(total) / max(count, 1)


def setup_logging(run_dir: Path, ctx: DistContext) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    name = "train.log" if ctx.is_main else f"train.rank{ctx.rank}.log"
    handlers = [logging.FileHandler(run_dir / name)]
    if ctx.is_main:
        handlers.append(logging.StreamHandler(sys.stderr))
    fmt = "%(asctime)s %(levelname)s " + (f"[rank {ctx.rank}] " if ctx.world_size > 1 else "") + "%(message)s"
    logging.basicConfig(
        level=logging.INFO if ctx.is_main else logging.WARNING, format=fmt, handlers=handlers, force=True
    )


def run(
    cfg: DictConfig,
    *,
    collective: Collective | None = None,
    transport: Callable | None = None,
    build: Callable[..., Strategy] = build_strategy,
) -> int:
    """One rank's run of the composed config `cfg`, read through what validate returns (schema.Config);
    the raw tree is kept only for the records (config.yaml, W&B's config). Seams for scripts and
    tests: `collective` and `transport` go to build_strategy; `build` replaces it (same signature)."""
    # ----------------------------------------------------------------------------- set-up
    raw, cfg = cfg, validate(cfg)
    run_dir = Path(cfg.out_dir) / cfg.run_name  # a DumbDiLoCo node's carries its node id (validate)
    preflight.check(cfg, run_dir)  # the run folder is this run's; out_dir and a repository can be written
    ctx = init_distributed(cfg.distributed, cfg.device, cfg.launch.ranks_per_gpu)
    check_batch_split(cfg.train.batch_size, cfg.train.micro_batch_size, ctx.ranks_per_worker)
    setup_logging(run_dir, ctx)
    if notice := schedule_notice(cfg):
        log.warning(notice)
    torch.manual_seed(cfg.seed + ctx.rank)
    device = ctx.device
    use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    resolved = record_config(raw, run_dir, ctx, cfg.run_name)
    accum = cfg.train.batch_size // ctx.ranks_per_worker // cfg.train.micro_batch_size  # checked above

    # ----------------------------------------------------------------------------- data
    train_stream, eval_sets = build_data(cfg, ctx)

    # ----------------------------------------------------------------------------- model
    model, counts, fingerprint = build_counted_model(cfg, ctx)

    # ----------------------------------------------------------------------------- optimizers, strategy
    optimizer = build_optimizer(cfg, model, device)
    strategy = build(cfg, ctx, model, optimizer, collective=collective, transport=transport)
    scheduler = build_schedule(cfg, optimizer, strategy.progress)  # at the run's step (Strategy.progress)
    train_model = strategy.wrap(model)
    if cfg.compile if cfg.compile is not None else device.type == "cuda":
        train_model = torch.compile(train_model)
    stateful = dict(
        model=LocalShards(model) if ctx.sharded else model,
        optimizer=LocalShards(optimizer) if ctx.sharded else optimizer,
        scheduler=scheduler,
        data=train_stream,
        strategy=strategy,
    )

    # ----------------------------------------------------------------------------- resume, start
    clock = Clock()
    ckpt_dir = checkpoint_to_resume(cfg, run_dir)
    step = resume(ckpt_dir, stateful, clock, ctx.rank, fingerprint)
    check_same_start(ctx, step)  # every node found the same checkpoint (or none)
    start_strategy(strategy)
    logger = RunLogger(
        run_dir, resolved, cfg.wandb, enabled=ctx.is_main, resume_step=step if ckpt_dir else None
    )

    # ----------------------------------------------------------------------------- loop, the end
    trainer = Trainer(
        cfg=cfg,
        ctx=ctx,
        run_dir=run_dir,
        model=model,
        train_model=train_model,
        optimizer=optimizer,
        scheduler=scheduler,
        strategy=strategy,
        train_stream=train_stream,
        eval_sets=eval_sets,
        autocast=autocast,
        accum=accum,
        logger=logger,
        clock=clock,
        step=step,
        stateful=stateful,
        records=RunRecords(fingerprint=fingerprint, counts=counts, commit=git_commit(), resolved=resolved),
    )
    exit_code = trainer.train()
    shutdown_distributed(ctx, clean=exit_code == 0)
    return exit_code


def build_counted_model(cfg: schema.Config, ctx: DistContext) -> tuple[torch.nn.Module, dict, str]:
    """The model on this rank's device (sharded by FSDP2 over the worker's ranks with worker_parallel=fsdp,
    before the optimizer sees its parameters), its parameter counts (logged) and its shape fingerprint."""
    model = build_model(cfg.model, seed=cfg.seed).to(ctx.device)
    if cfg.train.activation_checkpointing:  # per decoder layer, the library's mechanism
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    counts, fingerprint = count_parameters(model), shape_fingerprint(model)
    if ctx.sharded:  # over the worker's ranks (distributed=ddp: all of them)
        shard_model(ctx, model, ctx.worker_group if cfg.distributed.mode == "diloco" else None)
    log.info(
        "model %s: %.1fM parameters (%.1fM without embeddings)",
        cfg.model.name,
        counts["total"] / 1e6,
        counts["non_embedding"] / 1e6,
    )
    return model, counts, fingerprint


def resume(ckpt_dir: Path | None, stateful: dict, clock: Clock, rank: int, fingerprint: str) -> int:
    """The step to start from: 0, or the checkpoint's, with every stateful object, the RNGs and the
    clock restored from it."""
    if ckpt_dir is None:
        return 0
    state = checkpoint.load(ckpt_dir, rank, fingerprint)
    for key, obj in stateful.items():
        obj.load_state_dict(state[key])
    checkpoint.set_rng_state(state["rng"])
    step = int(state["step"])
    clock.resume(float(state["wall_seconds"]), float(state.get("inner_seconds", 0.0)))
    log.info("resumed from %s at step %d", ckpt_dir, step)
    return step


def start_strategy(strategy: Strategy) -> None:
    """After the restore: connect, start background threads."""
    try:
        strategy.start()
    except BaseException:
        strategy.close()  # whatever start() began (a lane, a master thread) ends with it
        raise


@dataclass(frozen=True)
class RunRecords:
    """What the checkpoints' meta.json and summary.json record about the run, fixed at its start."""

    fingerprint: str
    counts: dict
    commit: str | None
    resolved: dict


@dataclass
class Trainer:
    """One rank's training loop from its (resumed) step to the end: the parts it drives and the loop's
    state (the step, the clock, the last evaluation). `train()` writes the records whatever happens."""

    cfg: schema.Config  # what validate returned
    ctx: DistContext
    run_dir: Path
    model: torch.nn.Module
    train_model: torch.nn.Module  # the strategy's wrap of `model`, maybe compiled
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    strategy: Strategy
    train_stream: PrefetchedStream
    eval_sets: dict
    autocast: AbstractContextManager
    accum: int  # micro-batches per optimizer step
    logger: RunLogger
    clock: Clock
    step: int
    stateful: dict  # what a checkpoint holds, by key
    records: RunRecords
    eval_loss: float = math.nan
    last_eval_step: int = -1

    def train(self) -> int:
        """The loop and the end; the exit code (0, or 130 when stopped or aborted)."""
        cfg, ctx = self.cfg, self.ctx
        pace = InjectedPace(cfg.train, slow=data_shard(cfg, ctx)[0] in cfg.train.slow_shards)
        stop, agree_to_stop = StopFlag(), StopAgreement(ctx)  # ranks see a Ctrl+C at different steps
        stop.install()
        show = ctx.is_main and cfg.train.progress
        bar = tqdm(
            total=cfg.train.max_steps,
            initial=self.step,
            disable=not show,
            dynamic_ncols=True,
            desc=cfg.run_name,
        )
        status, exit_code = "completed", 0
        try:
            stopping = self.loop(pace, stop, agree_to_stop, bar)
            if stopping or agree_to_stop.finish():  # the ranks' last posted requests, waited for
                status, exit_code = "interrupted", 130
                self.checkpoint_on_stop()
            else:
                self.finish_run()
        except KeyboardInterrupt:
            status, exit_code = "aborted", 130
            log.warning("aborted at step %d; the last complete checkpoint is intact", self.step)
        except BaseException:
            status = "failed"  # recorded in summary.json, then the error propagates
            raise
        finally:
            self.train_stream.close()
            stop.restore()
            bar.close()
            wall = self.write_summary(status, exit_code, pace)
            self.strategy.close()
        if ctx.is_main and status == "completed":
            loss = self.eval_loss
            log.info(
                "final eval loss %.4f, perplexity %.2f (step %d, %.0f s)", loss, _ppl(loss), self.step, wall
            )
            print(f"final eval perplexity: {_ppl(loss):.2f}")
        return exit_code

    def loop(self, pace: InjectedPace, stop: StopFlag, agree_to_stop: StopAgreement, bar: tqdm) -> bool:
        """Inner steps until the run's step reaches max_steps, or until the ranks agree to stop (True)."""
        train, strategy = self.cfg.train, self.strategy
        tokens_per_step = train.batch_size * self.cfg.data.seq_len  # per DiLoCo worker; global for DDP
        window_start, window_tokens = time.perf_counter(), 0
        stopping = False
        while strategy.progress(self.step) < train.max_steps and not (
            stopping := agree_to_stop(stop.requested)
        ):
            t0 = time.perf_counter()
            step_loss = self.inner_step()
            if pace.active:  # injected heterogeneity (experiments only)
                time.sleep(pace.rest(time.perf_counter() - t0))
            step_seconds = time.perf_counter() - t0
            self.clock.inner_seconds += step_seconds
            window_tokens += tokens_per_step
            outer = strategy.after_inner_step(self.step)  # DiLoCo: communicate and step the outer optimizer

            if self.step % train.log_every == 0 or self.step == train.max_steps or outer:
                now = time.perf_counter()
                tokens_per_second = window_tokens / max(now - window_start, 1e-9)
                self.log_step(step_loss, step_seconds, tokens_per_second, outer, bar)
                window_start, window_tokens = now, 0
            bar.update(1)
            self.eval_and_checkpoint()
        return stopping

    def inner_step(self) -> torch.Tensor:
        """One optimizer step over `accum` micro-batches (gradient accumulation, clip, AdamW, schedule);
        the micro-batches' summed loss."""
        device, micro = self.ctx.device, self.cfg.train.micro_batch_size
        step_loss = torch.zeros((), device=device)
        for i in range(self.accum):
            batch = self.train_stream.next_batch(micro)
            with self.strategy.grad_sync(last_micro_step=i == self.accum - 1), self.autocast:
                loss = self.train_model(
                    input_ids=batch.input_ids.to(device), labels=batch.labels.to(device)
                ).loss
                (loss / self.accum).backward()
            step_loss += loss.detach()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return step_loss

    def log_step(
        self, step_loss: torch.Tensor, step_seconds: float, tokens_per_second: float, outer: dict, bar: tqdm
    ) -> None:
        loss_value = step_loss.item() / self.accum
        step, num_workers = self.step, self.strategy.num_workers
        metrics = {
            "Loss": loss_value,
            "Perplexity": _ppl(loss_value),
            "lr": self.scheduler.get_last_lr()[0],
            "effective_step": step * num_workers,
            "total_samples": step * self.cfg.train.batch_size * num_workers,
            "tokens_per_second": tokens_per_second,
            "time_taken": step_seconds,
            **outer,
        }
        self.logger.log(metrics, step)
        bar.set_postfix(loss=f"{loss_value:.3f}", ppl=f"{_ppl(loss_value):.1f}", refresh=False)

    def eval_and_checkpoint(self) -> None:
        """After a step: evaluate every eval_every steps and at max_steps; checkpoint every checkpoint_every."""
        train, step = self.cfg.train, self.step
        if (train.eval_every and step % train.eval_every == 0) or step == train.max_steps:
            self.eval_loss, self.last_eval_step = self.evaluate_now(), step
        periodic = train.checkpoint_every and step % train.checkpoint_every == 0
        if (
            periodic and self.strategy.progress(step) < train.max_steps
        ):  # the last one: after the final evaluation
            self.save_checkpoint()

    def finish_run(self) -> None:
        """The end of a run that was not stopped: the final evaluation and the last checkpoint."""
        # finish(): e.g. the DumbDiLoCo master takes the workers' last deltas and installs the final global
        if self.strategy.finish() or self.last_eval_step != self.step:
            self.eval_loss = self.evaluate_now()
        train = self.cfg.train
        ends_on_period = train.checkpoint_every and self.step % train.checkpoint_every == 0
        if self.strategy.progress(self.step) >= train.max_steps and (
            train.checkpoint_at_end or ends_on_period
        ):
            self.save_checkpoint()  # the model that was evaluated, and the strategy's final state

    def checkpoint_on_stop(self) -> None:
        try:
            self.save_checkpoint()
            log.warning("stopped at step %d; resume with the same command", self.step)
        except Exception as e:  # e.g. a peer already gone: the last periodic checkpoint stands
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.warning(
                "stopped at step %d without a new checkpoint (%s); the last one is intact", self.step, reason
            )

    def evaluate_now(self) -> float:
        return run_eval(
            self.model,
            self.strategy,
            self.eval_sets,
            self.ctx.device,
            self.autocast,
            self.logger,
            self.step,
            self.ctx,
        )

    def save_checkpoint(self) -> None:
        cfg, ctx, clock = self.cfg, self.ctx, self.clock
        state = {k: obj.state_dict() for k, obj in self.stateful.items()} | {"rng": checkpoint.rng_state()}
        state |= {"step": self.step, "wall_seconds": clock.wall(), "inner_seconds": clock.inner_seconds}
        meta = {"model": cfg.model.name, "fingerprint": self.records.fingerprint, "run_name": cfg.run_name}
        meta |= {"world_size": ctx.world_size, "commit": self.records.commit}
        checkpoint.save(
            self.run_dir, self.step, ctx.rank, state, meta, ctx.barrier, keep=cfg.train.keep_checkpoints
        )

    def write_summary(self, status: str, exit_code: int, pace: InjectedPace) -> float:
        """summary.json and the logger's end; the run's wall seconds."""
        wall, records = self.clock.wall(), self.records
        ran = dict(
            status=status, step=self.step, eval_loss=self.eval_loss, wall=wall, inner=self.clock.inner_seconds
        )
        ran["pace"] = pace.summary()
        summary = run_summary(
            self.cfg, self.ctx, self.strategy, ran, records.counts, records.commit, records.resolved
        )
        self.logger.write_summary(summary)
        self.logger.close(exit_code)
        return wall


# ----------------------------------------------------------------------------- run()'s helpers
def run_summary(
    cfg: schema.Config, ctx, strategy, ran: dict, counts: dict, commit: str | None, resolved: dict
) -> dict:
    """summary.json: how the run ended, what it cost, and the whole (redacted) config."""
    loss, wall, step = ran["eval_loss"], ran["wall"], ran["step"]
    return {
        "run_name": cfg.run_name,
        "status": ran["status"],
        "step": step,
        "config_choices": _config_choices(),
        "final_eval_loss": None if math.isnan(loss) else loss,
        **(
            {"final_eval_loss_why": f"no final evaluation (the run ended {ran['status']})"}
            if math.isnan(loss)
            else {}
        ),
        "final_eval_perplexity": None if math.isnan(loss) else _ppl(loss),
        "tokens_seen": step * cfg.train.batch_size * cfg.data.seq_len * strategy.num_workers,
        "wall_seconds": wall,
        "compute_utilization": ran["inner"] / max(wall, 1e-9),
        "parameters": counts,
        "world_size": ctx.world_size,
        "num_workers": strategy.num_workers,
        "seed": cfg.seed,
        "git_commit": commit,
        "device": str(ctx.device),
        **strategy.summary(),
        **ran.get("pace", {}),
        "config": resolved,
    }


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50))


def record_config(cfg: DictConfig, run_dir: Path, ctx: DistContext, run_name: str) -> dict:
    """The resolved config, token redacted (a credential is never written to records or W&B), with the
    run's own name (a DumbDiLoCo node's carries its node id)."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["run_name"] = run_name
    if token := resolved["distributed"].get("token"):
        resolved["distributed"]["token"] = "<redacted>"
        # W&B records the program's arguments (sys.argv) in its run files: the token leaves them too
        sys.argv[:] = [a.replace(token, "<redacted>") for a in sys.argv]
    if ctx.is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    return resolved


def build_optimizer(cfg: schema.Config, model, device: torch.device) -> torch.optim.AdamW:
    """The inner optimizer (AdamW, fused on CUDA by default); its schedule: diloco.schedule."""
    fused = cfg.optim.fused if cfg.optim.fused is not None else (device.type == "cuda" or None)
    return torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        weight_decay=cfg.optim.weight_decay,
        foreach=cfg.optim.foreach,
        fused=fused,
    )


def data_shard(cfg: schema.Config, ctx: DistContext) -> tuple[int, int]:
    """(shard, number of shards) of this rank's training data: data.shard, else its rank (a DumbDiLoCo
    node, ctx.shard_per_node: data.shard, else 0, shared by the node's ranks)."""
    if ctx.shard_per_node:
        return cfg.data.shard or 0, cfg.data.num_shards or 1
    shard = cfg.data.shard if cfg.data.shard is not None else ctx.rank
    return shard, cfg.data.num_shards if cfg.data.num_shards is not None else ctx.world_size


def build_data(cfg: schema.Config, ctx: DistContext) -> tuple[PrefetchedStream, dict]:
    """This rank's training stream (its shard, prefetched) and rank 0's fixed held-out batches: "all",
    and with non-IID shards each shard's own distribution."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if len(tokenizer) > cfg.model.vocab_size:
        raise ConfigError(
            f"tokenizer {cfg.data.tokenizer} has {len(tokenizer)} tokens but model.vocab_size={cfg.model.vocab_size}"
        )
    (shard, num_shards), part = data_shard(cfg, ctx), (0, 1)
    if ctx.shard_per_node:  # a node's shard (data.shard), split among the node's ranks
        part = (ctx.rank, ctx.world_size)
    stream = SequenceStream(
        cfg.data,
        tokenizer,
        cfg.data.train_split,
        shard,
        num_shards,
        part=part,
        shuffle_seed=cfg.data.shuffle_seed,
    )
    train_stream = PrefetchedStream(stream, cfg.train.micro_batch_size)
    if not ctx.evaluates:
        return train_stream, {}
    sets = {"all": eval_batches(cfg.data, tokenizer, cfg.eval.tokens, cfg.eval.micro_batch_size)}
    if cfg.data.sharding == "noniid" and num_shards > 1:
        for s in range(num_shards):
            sets[s] = eval_batches(
                cfg.data, tokenizer, cfg.eval.tokens // num_shards, cfg.eval.micro_batch_size, s, num_shards
            )
    return train_stream, sets


def checkpoint_to_resume(cfg: schema.Config, run_dir: Path) -> Path | None:
    if cfg.resume == "auto":
        return checkpoint.latest(run_dir)
    if cfg.resume == "never":
        return None
    if not Path(cfg.resume).exists():
        raise CheckpointError(f"resume={cfg.resume}: no such checkpoint directory")
    return Path(cfg.resume)


def run_eval(model, strategy, eval_sets, device, autocast, logger, step, ctx) -> float:
    """Rank 0 evaluates the model the strategy says was averaged (DDP: the live weights; DiLoCo: the
    global weights); the others go on and wait at their next collective. A sharded model's forward needs
    every rank of its group: worker 0's ranks all evaluate the same batches; rank 0 logs."""
    if not ctx.evaluates:
        return math.nan
    with strategy.eval_weights(step):  # DiLoCo mid-round: the last averaged weights, not rank 0's own
        loss = evaluate(model, eval_sets["all"], device, autocast)
        metrics = {"eval/loss": loss, "eval/perplexity": _ppl(loss)}
        for s, batches in eval_sets.items():
            if s != "all":
                metrics[f"eval/shard{s}/loss"] = evaluate(model, batches, device, autocast)
    logger.log(metrics, step)
    log.info("step %d: eval loss %.4f, perplexity %.2f", step, loss, metrics["eval/perplexity"])
    return loss


def _config_choices() -> dict:
    try:
        from hydra.core.hydra_config import HydraConfig

        return dict(HydraConfig.get().runtime.choices)
    except Exception:
        return {}


# configs/ is installed as the package diloco.configs (pyproject.toml), so a wheel finds it too.
@hydra.main(version_base="1.3", config_path="pkg://diloco.configs", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        with nothing_left_on(USER_ERRORS, cfg):
            code = run(cfg)
    except USER_ERRORS as e:  # a config error is every rank's: printed once; others may be one rank's
        print_error(str(e), every_rank=not isinstance(e, ConfigError))
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    if (error := check_command_line(sys.argv[1:])) is not None:  # before Hydra, which hints at `+key`
        print_error(error)
        sys.exit(2)
    main()

"""Train a Llama on C4 (or the bundled sample): single process, DDP, DiLoCo or DumbDiLoCo.

    python -m diloco.train <hydra overrides>                      # one process
    torchrun --nproc_per_node G -m diloco.train distributed=ddp   # the same, several ranks

The loop is an ordinary training loop (gradient accumulation, clip, AdamW, schedule, eval,
checkpoint). The distributed strategy attaches at two points only: `grad_sync` around each
micro-step (DDP's no_sync while accumulating) and `after_inner_step` after every optimizer step
(where DiLoCo communicates once every H steps and DumbDiLoCo uploads/installs).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import signal
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers import get_cosine_schedule_with_warmup

from diloco import checkpoint
from diloco.checkpoint import CheckpointError
from diloco.comm import CommError
from diloco.config import (
    ConfigError,
    check_batch_split,
    check_command_line,
    print_error,
    schedule_notice,
    validate,
)
from diloco.data import DataError, SequenceStream, eval_batches, load_tokenizer, noniid_shard_of  # noqa: F401
from diloco.distributed import (
    DistContext,
    DistributedError,
    init_distributed,
    shutdown_distributed,
)
from diloco.metrics import RunLogger, git_commit, nothing_left_on
from diloco.model import build_model, count_parameters, shape_fingerprint

log = logging.getLogger("diloco")

USER_ERRORS = (ConfigError, DataError, CheckpointError, CommError, DistributedError)


def build_strategy(cfg: DictConfig, ctx: DistContext, model, optimizer):
    """The one place that knows the distributed modes."""
    mode = cfg.distributed.mode
    if mode == "none":
        from diloco.distributed import LocalTraining

        return LocalTraining(ctx)
    if mode == "ddp":
        from diloco.distributed import DataParallel

        return DataParallel(cfg.distributed, ctx, model)
    if mode == "diloco":
        from diloco.diloco import DiLoCo

        return DiLoCo.from_config(cfg.distributed, ctx, model, optimizer)
    if mode == "dumb_diloco":
        from diloco.dumb_diloco.coordinator import DumbDiLoCo

        return DumbDiLoCo.from_config(cfg, ctx, model, optimizer)
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


class StopFlag:
    """Ctrl+C / SIGTERM finish the current step, checkpoint, and exit; a second Ctrl+C aborts."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def install(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("stop requested: finishing this step, then writing a checkpoint")

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class PrefetchedStream:
    """The training stream with the next micro-batches read and tokenised on a background thread while
    the model computes (tokenizers and torch release the GIL): data preparation leaves the step's
    critical path. `state_dict()` is the position after the last batch handed out, so checkpoints and
    resume stay exact."""

    def __init__(self, stream: SequenceStream, batch_size: int, depth: int = 2):
        # This thread is the data pipeline's parallelism: a tokenizer thread pool on top would compete
        # with torch's threads for the cores (an explicit TOKENIZERS_PARALLELISM is respected).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.stream, self.batch_size = stream, batch_size
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._state = stream.state_dict()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _fill(self) -> None:
        while not self._stop.is_set():
            try:
                item = (self.stream.next_batch(self.batch_size), self.stream.state_dict(), None)
            except Exception as e:  # raised on the training thread when it asks for this batch
                item = (None, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    pass
            if item[2] is not None:
                return

    def next_batch(self, batch_size: int):
        if batch_size != self.batch_size:
            raise ValueError(f"prefetching batches of {self.batch_size}, asked for {batch_size}")
        if self._thread is None:  # started late: a resumed position is loaded first
            self._thread = threading.Thread(target=self._fill, name="data-prefetch", daemon=True)
            self._thread.start()
        batch, state, error = self._queue.get()
        if error is not None:
            raise error
        self._state = state
        return batch

    def state_dict(self) -> dict:
        return self._state

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("the data position can only be restored before the first batch")
        self.stream.load_state_dict(state)
        self._state = self.stream.state_dict()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


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


def run(cfg: DictConfig) -> int:
    # ----------------------------------------------------------------------------- set-up
    validate(cfg)
    ctx = init_distributed(cfg)
    check_batch_split(cfg.train.batch_size, cfg.train.micro_batch_size, ctx.ranks_per_worker)
    run_dir = Path(cfg.out_dir) / cfg.run_name
    setup_logging(run_dir, ctx)
    if notice := schedule_notice(cfg):
        log.warning(notice)
    torch.manual_seed(cfg.seed + ctx.rank)
    device = ctx.device
    use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if resolved["distributed"].get("token"):  # a credential: never written to the run's records or W&B
        resolved["distributed"]["token"] = "<redacted>"
    if ctx.is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    accum = cfg.train.batch_size // ctx.ranks_per_worker // cfg.train.micro_batch_size

    # ----------------------------------------------------------------------------- data
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if len(tokenizer) > cfg.model.vocab_size:
        raise ConfigError(
            f"tokenizer {cfg.data.tokenizer} has {len(tokenizer)} tokens but model.vocab_size={cfg.model.vocab_size}"
        )
    shard = cfg.data.shard if cfg.data.shard is not None else ctx.rank
    num_shards = cfg.data.num_shards if cfg.data.num_shards is not None else ctx.world_size
    train_stream = PrefetchedStream(
        SequenceStream(cfg.data, tokenizer, cfg.data.train_split, shard, num_shards),
        cfg.train.micro_batch_size,
    )
    eval_set, shard_eval_sets = [], {}  # held-out data, evaluated on rank 0 only
    if ctx.is_main:
        eval_set = eval_batches(cfg.data, tokenizer, cfg.eval.tokens, cfg.eval.micro_batch_size)
    if ctx.is_main and cfg.data.sharding == "noniid" and num_shards > 1:  # each shard's own distribution
        for s in range(num_shards):
            shard_eval_sets[s] = eval_batches(
                cfg.data, tokenizer, cfg.eval.tokens // num_shards, cfg.eval.micro_batch_size, s, num_shards
            )

    # ----------------------------------------------------------------------------- model
    model = build_model(cfg.model, seed=cfg.seed).to(device)
    counts = count_parameters(model)
    fingerprint = shape_fingerprint(model)
    log.info(
        "model %s: %.1fM parameters (%.1fM without embeddings)",
        cfg.model.name,
        counts["total"] / 1e6,
        counts["non_embedding"] / 1e6,
    )

    # ----------------------------------------------------------------------------- optimizers
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        weight_decay=cfg.optim.weight_decay,
        foreach=cfg.optim.foreach,
        fused=cfg.optim.fused if cfg.optim.fused is not None else (device.type == "cuda" or None),
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.optim.warmup_steps, cfg.optim.total_steps)
    strategy = build_strategy(cfg, ctx, model, optimizer)
    train_model = strategy.wrap(model)
    if cfg.compile if cfg.compile is not None else device.type == "cuda":
        train_model = torch.compile(train_model)

    # ----------------------------------------------------------------------------- resume
    step, start_time_offset, inner_seconds_before = 0, 0.0, 0.0
    ckpt_dir = None
    if cfg.resume == "auto":
        ckpt_dir = checkpoint.latest(run_dir)
    elif cfg.resume != "never":
        ckpt_dir = Path(cfg.resume)
        if not ckpt_dir.exists():
            raise CheckpointError(f"resume={cfg.resume}: no such checkpoint directory")
    if ckpt_dir is not None:
        state = checkpoint.load(ckpt_dir, ctx.rank, fingerprint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        train_stream.load_state_dict(state["data"])
        strategy.load_state_dict(state["strategy"])
        checkpoint.set_rng_state(state["rng"])
        step, start_time_offset = int(state["step"]), float(state["wall_seconds"])
        inner_seconds_before = float(state.get("inner_seconds", 0.0))
        log.info("resumed from %s at step %d", ckpt_dir, step)

    logger = RunLogger(
        run_dir, resolved, cfg.wandb, enabled=ctx.is_main, resume_step=step if ckpt_dir is not None else None
    )

    def save_checkpoint():
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "data": train_stream.state_dict(),
            "strategy": strategy.state_dict(),
            "rng": checkpoint.rng_state(),
            "step": step,
            "wall_seconds": wall_seconds(),
            "inner_seconds": inner_seconds,
        }
        meta = {
            "model": cfg.model.name,
            "fingerprint": fingerprint,
            "run_name": cfg.run_name,
            "world_size": ctx.world_size,
            "commit": commit,
        }
        checkpoint.save(run_dir, step, ctx.rank, state, meta, ctx.barrier, keep=cfg.train.keep_checkpoints)

    # ----------------------------------------------------------------------------- loop
    commit = git_commit()
    seq_len, micro = cfg.data.seq_len, cfg.train.micro_batch_size
    tokens_per_step = cfg.train.batch_size * seq_len  # per DiLoCo worker; global for DDP
    max_steps = cfg.train.max_steps
    started = time.perf_counter()

    def wall_seconds():
        return start_time_offset + time.perf_counter() - started

    stop = StopFlag()
    stop.install()
    bar = tqdm(
        total=max_steps,
        initial=step,
        disable=not (ctx.is_main and cfg.train.progress),
        dynamic_ncols=True,
        desc=cfg.run_name,
    )
    eval_loss = math.nan
    last_eval_step = -1
    inner_seconds = inner_seconds_before  # forward/backward/optimizer time, across resumes
    window_start, window_tokens = time.perf_counter(), 0
    status = "completed"
    exit_code = 0
    try:
        while step < max_steps and not stop.requested:
            t0 = time.perf_counter()
            step_loss = torch.zeros((), device=device)
            for i in range(accum):
                batch = train_stream.next_batch(micro)
                with strategy.grad_sync(last_micro_step=i == accum - 1), autocast:
                    loss = train_model(
                        input_ids=batch.input_ids.to(device), labels=batch.labels.to(device)
                    ).loss
                    (loss / accum).backward()
                step_loss += loss.detach()
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            step_seconds = time.perf_counter() - t0
            inner_seconds += step_seconds
            window_tokens += tokens_per_step
            outer = strategy.after_inner_step(step)  # DiLoCo: communicate and step the outer optimizer

            if step % cfg.train.log_every == 0 or step == max_steps or outer:
                now = time.perf_counter()
                loss_value = step_loss.item() / accum
                metrics = {
                    "Loss": loss_value,
                    "Perplexity": math.exp(min(loss_value, 50)),
                    "lr": scheduler.get_last_lr()[0],
                    "effective_step": step * ctx.num_workers,
                    "total_samples": step * cfg.train.batch_size * ctx.num_workers,
                    "tokens_per_second": window_tokens / max(now - window_start, 1e-9),
                    "time_taken": step_seconds,
                    **outer,
                }
                window_start, window_tokens = now, 0
                logger.log(metrics, step)
                bar.set_postfix(
                    loss=f"{loss_value:.3f}",
                    ppl=f"{metrics['Perplexity']:.1f}",
                    tok_s=f"{metrics['tokens_per_second']:.0f}",
                    refresh=False,
                )
            bar.update(1)

            if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or step == max_steps:
                eval_loss = run_eval(
                    cfg, model, strategy, eval_set, shard_eval_sets, device, autocast, logger, step, ctx
                )
                last_eval_step = step
            periodic = cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0
            if periodic and step < max_steps:  # the last one is written after the final evaluation
                save_checkpoint()
        if stop.requested:
            status, exit_code = "interrupted", 130
            try:
                save_checkpoint()
                log.warning("stopped at step %d; resume with the same command", step)
            except Exception as e:  # e.g. a peer already gone: the last periodic checkpoint stands
                log.warning(
                    "stopped at step %d without a new checkpoint (%s); the last complete one is intact",
                    step,
                    str(e).splitlines()[0] if str(e) else type(e).__name__,
                )
        else:
            if (finish := getattr(strategy, "finish", None)) is not None and finish():
                # DumbDiLoCo master: the last deltas are in; evaluate the final global model
                eval_loss = run_eval(
                    cfg, model, strategy, eval_set, shard_eval_sets, device, autocast, logger, step, ctx
                )
            elif last_eval_step != step:
                eval_loss = run_eval(
                    cfg, model, strategy, eval_set, shard_eval_sets, device, autocast, logger, step, ctx
                )
            ends_on_period = cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0
            if step == max_steps and (cfg.train.checkpoint_at_end or ends_on_period):
                save_checkpoint()  # the model that was evaluated, and the strategy's final state
    except KeyboardInterrupt:
        status, exit_code = "aborted", 130
        log.warning("aborted at step %d; the last complete checkpoint is intact", step)
    except BaseException:
        status = "failed"  # recorded in summary.json, then the error propagates
        raise
    finally:
        train_stream.close()
        stop.restore()
        bar.close()
        wall = wall_seconds()
        summary = {
            "run_name": cfg.run_name,
            "status": status,
            "step": step,
            "config_choices": _config_choices(),
            "final_eval_loss": eval_loss,
            "final_eval_perplexity": math.exp(min(eval_loss, 50)) if not math.isnan(eval_loss) else None,
            "tokens_seen": step * tokens_per_step * ctx.num_workers,
            "wall_seconds": wall,
            "compute_utilization": inner_seconds / max(wall, 1e-9),
            "parameters": counts,
            "world_size": ctx.world_size,
            "num_workers": ctx.num_workers,
            "seed": cfg.seed,
            "git_commit": commit,
            "device": str(device),
            **strategy.summary(),
            "config": resolved,
        }
        logger.write_summary(summary)
        logger.close(exit_code)
        strategy.close()
    if ctx.is_main and status == "completed":
        log.info(
            "final eval loss %.4f, perplexity %.2f (step %d, %.0f s)",
            eval_loss,
            math.exp(min(eval_loss, 50)),
            step,
            wall,
        )
        print(f"final eval perplexity: {math.exp(min(eval_loss, 50)):.2f}")
    shutdown_distributed(ctx, clean=exit_code == 0)
    return exit_code


def run_eval(cfg, model, strategy, eval_set, shard_eval_sets, device, autocast, logger, step, ctx) -> float:
    """Rank 0 evaluates the model the strategy says was averaged (DDP: the live weights; DiLoCo: the
    global weights); the others go on and wait at their next collective."""
    if not ctx.is_main:
        return math.nan
    with strategy.eval_weights(step):  # DiLoCo mid-round: the last averaged weights, not rank 0's own
        loss = evaluate(model, eval_set, device, autocast)
        metrics = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50))}
        for s, batches in shard_eval_sets.items():
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

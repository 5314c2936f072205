"""Benchmark 4 (issue #7): tokens/s of the project's trainer against a minimal plain PyTorch loop.

The trainer is `diloco.train.run` itself (distributed=none, on the bundled sample), its speed read
from its own metrics.jsonl: the logging windows after the warm-up steps, so set-up, the final
evaluation and the final checkpoint are excluded, and everything the loop does per step (data
pipeline, tokenisation, logging, strategy hooks) is included. The plain loop builds the same model
(`diloco.model.build_model`, same seed), the same AdamW, schedule and gradient clipping, and trains
on the same micro-batches, tokenised beforehand and held in memory. The two alternate, `repeats`
times; the ratio is taken per pair and its median reported. Target: trainer >= 0.97x the plain loop.

    python scripts/bench_trainer.py                # micro and 14m on CPU, 3 pairs each, ~4 minutes
    python scripts/bench_trainer.py --tiny
    python scripts/bench_trainer.py --models 150m --device cuda   # on a GPU (bf16 autocast, as the trainer)
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from diloco.bench import common as bc
from diloco.config import run_dir_of

TARGET = 0.97

# per model: batch (sequences per step), micro-batch, sequence length, steps, logging window, warm-up steps
SETTINGS = {
    "micro": dict(batch=16, micro=16, seq_len=256, steps=25, window=5, warmup_steps=5),
    "14m": dict(batch=8, micro=8, seq_len=256, steps=10, window=2, warmup_steps=4),
    "150m": dict(batch=64, micro=16, seq_len=1024, steps=30, window=5, warmup_steps=10),
    "tiny": dict(batch=4, micro=2, seq_len=64, steps=4, window=2, warmup_steps=2),
}


def compose_overrides(overrides: list[str]):
    """The trainer's config from configs/ with command-line style overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import diloco.config  # noqa: F401  (registers the structured configs and resolvers)

    with initialize_config_dir(config_dir=str(bc.ROOT / "configs"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def compose(model: str, s: dict, out_dir: Path, run_name: str, device: str):
    return compose_overrides(
        [
            f"model={model}",
            "data=sample",
            f"data.seq_len={s['seq_len']}",
            f"train.batch_size={s['batch']}",
            f"train.micro_batch_size={s['micro']}",
            f"train.max_steps={s['steps']}",
            f"train.log_every={s['window']}",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "train.progress=false",
            "eval.tokens=512",
            "optim.warmup_steps=10",
            "optim.total_steps=1000",
            f"device={device}",
            "wandb.mode=disabled",
            "resume=never",
            f"out_dir={out_dir}",
            f"run_name={run_name}",
        ]
    )


def trainer_tokens_per_second(cfg, s: dict) -> float:
    """Run the real trainer; tokens/s over the logging windows after the warm-up steps."""
    from diloco.train import run

    code = run(cfg)
    if code != 0:
        raise RuntimeError(f"trainer exited with {code}")
    run_dir = run_dir_of(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "tokens_per_second" in r and r["step"] > s["warmup_steps"]]
    tokens_per_window = s["window"] * s["batch"] * s["seq_len"]
    seconds = sum(tokens_per_window / r["tokens_per_second"] for r in windows)
    return tokens_per_window * len(windows) / seconds


def plain_loop_tokens_per_second(cfg, s: dict, batches: list) -> float:
    """The same training, as the shortest loop PyTorch allows, on in-memory batches."""
    from transformers import get_cosine_schedule_with_warmup

    from diloco.model import build_model

    device = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, seed=cfg.seed).to(device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
    )
    sched = get_cosine_schedule_with_warmup(opt, cfg.optim.warmup_steps, cfg.optim.total_steps)
    batches = [(b.input_ids.to(device), b.labels.to(device)) for b in batches]
    accum = s["batch"] // s["micro"]
    it = iter(batches)
    start = None
    for step in range(1, s["steps"] + 1):
        for _ in range(accum):
            ids, labels = next(it)
            with autocast:
                loss = model(input_ids=ids, labels=labels).loss
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step == s["warmup_steps"]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return (s["steps"] - s["warmup_steps"]) * s["batch"] * s["seq_len"] / seconds


def fetch_batches(cfg, s: dict) -> list:
    """The micro-batches the trainer will see, in order (the same stream, shard 0 of 1)."""
    from diloco.data import SequenceStream, load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer)
    stream = SequenceStream(cfg.data, tok, cfg.data.train_split, 0, 1, shuffle_seed=cfg.data.shuffle_seed)
    n = s["steps"] * (s["batch"] // s["micro"])
    return [stream.next_batch(s["micro"]) for _ in range(n)]


class _MemoryStream:
    """Stands in for SequenceStream inside the trainer: the same batches, already in memory."""

    batches: list = []

    def __init__(self, *args, **kwargs):
        self._it = itertools.cycle(self.batches)  # the prefetch thread reads a little past the end

    def next_batch(self, batch_size: int):
        return next(self._it)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def trainer_in_memory_tokens_per_second(cfg, s: dict, batches: list) -> float:
    """The trainer with its data stream replaced by the in-memory batches (a diagnosis: what the
    trainer costs besides reading and tokenising data)."""
    import diloco.train as train_mod

    original = train_mod.SequenceStream
    _MemoryStream.batches = batches
    train_mod.SequenceStream = _MemoryStream
    try:
        return trainer_tokens_per_second(cfg, s)
    finally:
        train_mod.SequenceStream = original


def bench_model(model: str, s: dict, args, tmp: Path, in_memory_leg: bool) -> tuple[dict, dict]:
    import logging

    cfg = compose(model, s, tmp, f"bench-{model}", args.device)
    batches = fetch_batches(cfg, s)
    trainer, plain, memory, ratios, memory_ratios = [], [], [], [], []
    for i in range(args.warmup + args.repeats):
        cfg = compose(model, s, tmp, f"bench-{model}-{i}", args.device)
        if i % 2:  # alternate the order so that a drift in the machine's load cancels out
            p = plain_loop_tokens_per_second(cfg, s, batches)
        t = trainer_tokens_per_second(cfg, s)
        logging.getLogger("diloco").handlers.clear()
        if in_memory_leg:
            cfg = compose(model, s, tmp, f"bench-{model}-{i}-mem", args.device)
            m = trainer_in_memory_tokens_per_second(cfg, s, batches)
            logging.getLogger("diloco").handlers.clear()
        if not i % 2:
            p = plain_loop_tokens_per_second(cfg, s, batches)
        if i >= args.warmup:
            trainer.append(t)
            plain.append(p)
            ratios.append(t / p)
            if in_memory_leg:
                memory.append(m)
                memory_ratios.append(m / p)
    ratio = statistics.median(ratios)
    row = {
        "model": model,
        "device": args.device,
        "tokens/step": s["batch"] * s["seq_len"],
        "timed steps": s["steps"] - s["warmup_steps"],
        "trainer tok/s": statistics.median(trainer),
        "plain loop tok/s": statistics.median(plain),
        "ratio": ratio,
        "ratio IQR": f"{_quantile(ratios, 0.25):.3f}-{_quantile(ratios, 0.75):.3f}",
        "target": TARGET,
        "met": "yes" if ratio >= TARGET else "NO",
        "trainer, data in memory: ratio": statistics.median(memory_ratios) if memory_ratios else None,
    }
    detail = {"model": model, "settings": s, "trainer": trainer, "plain": plain, "ratios": ratios}
    detail |= {"trainer_in_memory": memory, "in_memory_ratios": memory_ratios}
    return row, detail


def _quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    return statistics.quantiles(v, n=4, method="inclusive")[int(q * 4) - 1]


def main(argv=None) -> int:
    p = bc.parser(__doc__.splitlines()[0], repeats=3, warmup=0)
    p.add_argument("--models", nargs="+", default=["micro", "14m"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--in-memory-leg",
        nargs="*",
        default=["micro"],
        help="models also timed with the trainer's data in memory",
    )
    args = bc.finish_args(p.parse_args(argv))
    rows, details = [], []
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as tmp:
        for model in ["micro"] if args.tiny else args.models:
            s = SETTINGS["tiny" if args.tiny else model]
            row, detail = bench_model(model, s, args, Path(tmp), model in args.in_memory_leg)
            rows.append(row)
            details.append(detail)
    verdicts = [
        f"{r['model']}: trainer at {r['ratio']:.3f}x the plain loop (median of {args.repeats} paired runs; "
        f"target >= {TARGET}): {'met' if r['ratio'] >= TARGET else 'NOT met'}"
        for r in rows
    ]
    notes = [
        "Trainer tokens/s: its own metrics.jsonl windows after the warm-up steps (includes the data pipeline: "
        "streaming json.gz + tokenisation on its prefetch thread, logging and the strategy hooks). Plain loop: "
        "same model, seed, AdamW, schedule, clipping and micro-batches, pre-tokenised in memory.",
        "Tokens are sequences x seq_len (pads included), the trainer's own count.",
        "'trainer, data in memory': the same trainer with its SequenceStream replaced by the plain loop's in-memory "
        "batches: the trainer's cost besides reading and tokenising data.",
        f"Settings: {json.dumps({d['model']: d['settings'] for d in details})}",
    ]
    if any(math.isnan(r["ratio"]) for r in rows):
        notes.append("a ratio is NaN: a run logged no window after warm-up")
    bc.write(
        "trainer" if args.device == "cpu" else "trainer_gpu",
        "Trainer overhead: diloco.train.run vs a plain PyTorch loop",
        args,
        rows,
        notes=notes,
        verdicts=verdicts,
        extra={"details": details},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

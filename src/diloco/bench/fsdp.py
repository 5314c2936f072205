"""Sharded workers (issue 53): what FSDP saves a DiLoCo worker's rank, measured on the real trainer.

1. Outer step and outer state. One DiLoCo worker of G=2 ranks (2 gloo processes on this machine's two
   cores, `scripts/launch_ranks.py`, the trainer the README runs) trains `--model` for `--rounds` outer
   rounds of H=2 inner steps, once with DDP inside the worker and once with FSDP (`worker_parallel`).
   Per rank: the outer step's mean wall time (`outer/seconds` / `outer/rounds` from rank 0's
   summary.json: pseudo-gradient, averaging over the workers, Nesterov step, install) and the bytes of
   outer state (the float32 global copy and the outer momentum, counted from rank 0's checkpoint).
   Expected: FSDP about 0.5x both, since each rank steps only its shard of the model.
2. Activation checkpointing. One process builds `--model`, runs one warm-up forward and backward of a
   micro-batch, resets its peak resident memory (/proc/self/clear_refs, as bench/node_memory.py does),
   runs a second, and reports the peak above the resident memory before it, with
   `train.activation_checkpointing` off and on (transformers' gradient checkpointing, non-reentrant),
   beside `diloco.memory`'s estimate of the same activations (its bf16 figure doubled for float32 on
   the CPU). glibc's mmap threshold is fixed at 64 KiB so freed activations return their pages at once.

    python scripts/bench_fsdp.py                  # 14m, 4 rounds, ~3 minutes on 2 idle cores
    python scripts/bench_fsdp.py --tiny --out /tmp/x
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from diloco.bench import common as bc

H = 2


def trainer(model: str, parallel: str, rounds: int, out: Path, seq_len: int) -> list[str]:
    launcher = [sys.executable, str(bc.ROOT / "scripts" / "launch_ranks.py")]
    launcher += ["--nnodes", "1", "--nproc_per_node", "2", "--standalone", "-m", "diloco.train"]
    return [
        *launcher,
        f"model={model}",
        "data=sample",
        f"data.seq_len={seq_len}",
        "device=cpu",
        "distributed=diloco",
        "distributed.ranks_per_worker=2",
        f"distributed.inner_steps={H}",
        f"distributed.worker_parallel={parallel}",
        f"train.max_steps={H * rounds}",
        "train.batch_size=2",
        "train.micro_batch_size=1",
        "train.eval_every=0",
        "train.log_every=1",
        "train.progress=false",
        "eval.tokens=256",
        f"optim.total_steps={H * rounds}",
        "optim.warmup_steps=1",
        f"out_dir={out}",
        f"run_name={parallel}",
    ]


def outer_row(model: str, parallel: str, rounds: int, tmp: Path, seq_len: int) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    cmd = trainer(model, parallel, rounds, tmp, seq_len)
    done = subprocess.run(cmd, cwd=bc.ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{parallel} run failed:\n{done.stderr[-3000:]}")
    run = tmp / parallel
    summary = json.loads((run / "summary.json").read_text())
    from diloco import checkpoint

    state = torch.load(checkpoint.latest(run) / "rank0.pt", weights_only=True)["strategy"]
    kept = _tensors([state["global_params"], state["outer_optimizer"]])
    outer_bytes = sum(t.numel() * t.element_size() for t in kept)
    return {
        "worker_parallel": parallel,
        "outer_rounds": summary["outer/rounds"],
        "outer_step_s": summary["outer/seconds"] / summary["outer/rounds"],
        "outer_state_bytes_per_rank": outer_bytes,
    }


def _tensors(state) -> list[torch.Tensor]:
    """The global copy and the outer optimizer's buffers in a rank's strategy state."""
    if isinstance(state, torch.Tensor):
        return [state] if state.is_floating_point() and state.dim() else []
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


# ------------------------------------------------------------------------------- activation checkpointing
def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def ac_probe(model_name: str, micro_batch: int, seq_len: int, checkpointing: bool) -> dict:
    """In this (fresh) process: the peak resident memory of one forward and backward above the memory
    before it, in MiB."""
    from omegaconf import OmegaConf

    from diloco import memory
    from diloco.model import build_model

    torch.set_num_threads(1)
    cfg = OmegaConf.load(bc.ROOT / "configs" / "model" / f"{model_name}.yaml")
    model = build_model(cfg, seed=0)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    step()  # gradients, allocator arenas and lazy state exist from here on
    before = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    step()
    peak = _status_mib("VmHWM")
    est = memory.estimate(
        cfg,
        micro_batch=micro_batch,
        seq_len=seq_len,
        shards=1,
        diloco=False,
        global_on_gpu=False,
        checkpointing=checkpointing,
    )
    return {
        "activation_checkpointing": checkpointing,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "peak_above_model_mib": peak - before,
        "estimate_float32_mib": 2 * est.activations / 2**20,
    }


def ac_row(model: str, micro_batch: int, seq_len: int, checkpointing: bool) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024), "OMP_NUM_THREADS": "1"}
    args = [model, str(micro_batch), str(seq_len), str(int(checkpointing))]
    done = subprocess.run(
        [sys.executable, "-m", "diloco.bench.fsdp", "--probe", *args],
        cwd=bc.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:
        model, b, s, ac = argv[1:5]
        print(json.dumps(ac_probe(model, int(b), int(s), bool(int(ac)))))
        return 0
    p = bc.parser(__doc__.splitlines()[0], repeats=1, warmup=0)
    p.add_argument("--model", default="14m")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ac-micro-batch", type=int, default=8)
    args = bc.finish_args(p.parse_args(argv))
    if args.tiny:
        args.model, args.rounds, args.seq_len, args.ac_micro_batch = "micro", 2, 64, 2
    with tempfile.TemporaryDirectory() as tmp:
        rows = [outer_row(args.model, par, args.rounds, Path(tmp), args.seq_len) for par in ("ddp", "fsdp")]
    ddp, fsdp = rows
    for r in rows:
        r["time_vs_ddp"] = r["outer_step_s"] / ddp["outer_step_s"]
        r["state_vs_ddp"] = r["outer_state_bytes_per_rank"] / ddp["outer_state_bytes_per_rank"]
    ac = [ac_row(args.model, args.ac_micro_batch, args.seq_len, on) for on in (False, True)]
    verdicts = [
        f"FSDP G=2 outer step per rank: {fsdp['time_vs_ddp']:.2f}x DDP's; outer state per rank: "
        f"{fsdp['state_vs_ddp']:.2f}x (expected about 0.5x both)",
        f"activation checkpointing: peak {ac[1]['peak_above_model_mib']:.0f} MiB against "
        f"{ac[0]['peak_above_model_mib']:.0f} MiB without "
        f"({ac[1]['peak_above_model_mib'] / ac[0]['peak_above_model_mib']:.2f}x; the estimate says "
        f"{ac[1]['estimate_float32_mib'] / ac[0]['estimate_float32_mib']:.2f}x)",
    ]
    notes = [
        f"model {args.model}, 1 DiLoCo worker of 2 gloo ranks on this machine, H={H}, {args.rounds} "
        f"outer rounds, micro-batch 1 x {args.seq_len} tokens; the outer step's time is rank 0's mean",
        "activation memory: one process, one forward and backward after a warm-up one, float32 on the CPU",
    ]
    bc.write(
        "fsdp",
        "Sharded workers: FSDP against DDP inside a DiLoCo worker",
        args,
        rows,
        notes=notes,
        verdicts=verdicts,
        tables={"activation checkpointing": (ac, None)},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

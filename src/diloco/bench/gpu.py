"""Benchmark 7 (issue #7): the 150M shape on one GPU: tokens/s, model FLOPs utilization, outer step.

One script, at most ~8 minutes on an H100/H200 (`make bench-gpu`):

1. training throughput of the 150M Llama (configs/model/150m.yaml, built by `diloco.model.build_model`,
   SDPA attention) at sequence length 1024 with bf16 autocast, the trainer's AdamW and gradient
   clipping, on random tokens held on the GPU: eager, then `torch.compile` (compile time reported
   apart);
2. MFU = tokens/s x FLOPs per token / peak bf16 dense FLOPs of the GPU, with the standard count
   FLOPs/token = 6 N + 12 L H Q T (N: parameters in matmuls, i.e. all but the input embedding; L layers,
   H heads, Q head dim, T sequence length; the attention term counts the full T x T score matrix,
   as PaLM's appendix B does, though causal SDPA computes about half of it). Peaks assumed (dense
   bf16, no sparsity): H100 SXM / H200 989 TFLOPs, H100 NVL 835, H100 PCIe 756, A100 312
   (`--peak-tflops` overrides). Target: >= 40% MFU;
3. the project's DiLoCo outer step (`diloco.diloco.DiLoCo.outer_step`, one worker, float32 wire) with
   the global copy on the GPU and on the CPU, against the GPU copy bandwidth measured in the same run.

Without CUDA it prints why and exits 0 without writing anything (a CPU result would overwrite
nothing useful). `--allow-cpu` runs the same code on the CPU at a tiny size (the test suite's check
that the script works).

    python scripts/bench_gpu.py                     # on a GPU node
    python scripts/bench_gpu.py --tiny --allow-cpu  # CPU smoke run
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import nullcontext

import torch

from diloco.bench import common as bc

TARGET_MFU = 0.40
BUDGET_S = 8 * 60

PEAK_BF16_TFLOPS = [  # (substring of torch.cuda.get_device_name, dense bf16 TFLOPs)
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
]


def peak_tflops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS:
        if key in device_name:
            return value
    return None


def flops_per_token(model, seq_len: int) -> dict:
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    n = total - embedding  # the input embedding is a lookup, the untied head is a matmul
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq_len
    return {
        "params_total": total,
        "params_matmul": n,
        "dense": 6 * n,
        "attention": attn,
        "total": 6 * n + attn,
    }


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_throughput(model, device, args, compiled: bool, deadline: float) -> dict:
    """Tokens/s of forward + backward + clip + AdamW over micro-batches of random tokens."""
    # the trainer's AdamW: fused on CUDA (one kernel for the whole update, optim.fused's default there)
    opt = torch.optim.AdamW(
        model.parameters(), lr=4e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda" or None
    )
    run_model = torch.compile(model) if compiled else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else nullcontext()
    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(0)
    batches = [
        torch.randint(0, vocab, (args.micro_batch, args.seq_len), device=device, generator=gen)
        for _ in range(args.accum)
    ]

    def step():
        for ids in batches:
            with autocast:
                loss = run_model(input_ids=ids, labels=ids).loss
            (loss / args.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()  # compiles when compiled
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(args.warmup_steps - 1):
        step()
    sync(device)
    times = []
    for _ in range(args.steps):
        if time.perf_counter() > deadline and times:
            break
        t = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t)
    tokens = args.accum * args.micro_batch * args.seq_len
    med = statistics.median(times)
    out = {
        "first_step_s": first,
        "step_s": med,
        "steps_timed": len(times),
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / med,
    }
    if device.type == "cuda":
        out["max_memory_gb"] = torch.cuda.max_memory_allocated(device) / bc.GB
        torch.cuda.reset_peak_memory_stats(device)
    return out


def device_copy_bandwidth(device, nbytes: int) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(8):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times) / bc.GB


def outer_step_time(model, device, global_copy_device: str, repeats: int) -> dict:
    """The project's DiLoCo.outer_step, one worker (nothing to average with), float32 wire."""
    from diloco import comm
    from diloco.diloco import DiLoCo
    from diloco.schema import DiLoCoConfig

    inner = torch.optim.AdamW(model.parameters())
    config = DiLoCoConfig(
        inner_steps=1,
        outer_lr=0.7,
        global_copy_device=global_copy_device,
        bucket_size_mb=128,
        cosine_sample_size=0,
    )
    dl = DiLoCo(model, inner, comm.SoloCollective(), config)
    params = list(model.parameters())
    times = []
    for i in range(repeats + 1):
        with torch.no_grad():
            torch._foreach_add_(params, 1e-4)  # stands in for H inner steps
        sync(device)
        t = time.perf_counter()
        dl.outer_step()
        sync(device)
        if i:  # the first step also creates the momentum buffers
            times.append(time.perf_counter() - t)
    del dl, inner
    return bc.summarize(times)


def main(argv=None) -> int:
    p = bc.parser(__doc__.splitlines()[0], repeats=5, warmup=1)
    p.add_argument("--model", default="150m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=15, help="timed optimizer steps")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-bf16", dest="bf16", action="store_false")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOPs of this GPU")
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU (smoke test of this script)")
    args = bc.finish_args(p.parse_args(argv))
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            "bench_gpu: no CUDA device here; nothing measured, nothing written. Run `make bench-gpu` on a "
            "GPU node (H100/H200); `--allow-cpu` runs the script on the CPU as a smoke test."
        )
        return 0
    if args.tiny:
        args.model, args.seq_len, args.micro_batch, args.accum = "micro", 64, 2, 1
        args.steps, args.warmup_steps, args.repeats = 2, 1, 1
        args.no_compile = True  # compiling takes minutes on a CPU
    deadline = time.perf_counter() + BUDGET_S
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from omegaconf import OmegaConf

    from diloco.model import build_model

    model_cfg = OmegaConf.load(bc.ROOT / "configs" / "model" / f"{args.model}.yaml")
    model_cfg.attn_implementation = "sdpa"
    model = build_model(model_cfg, seed=0).to(device)
    flops = flops_per_token(model, args.seq_len)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else bc.machine()["cpu"]
    peak = args.peak_tflops or peak_tflops(name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    rows = train_rows(model, device, args, flops["total"], peak, deadline)
    if not args.no_compile:
        torch.compiler.reset()
    outer, bw = outer_rows(model, device, args, deadline)
    verdicts = [
        f"{r['what']}: {r['tokens/s']:,.0f} tokens/s, MFU {r['MFU']:.1%} (target >= {TARGET_MFU:.0%}): "
        f"{'met' if r['MFU'] >= TARGET_MFU else 'NOT met'}"
        for r in rows
        if r["MFU"] is not None
    ]
    bc.write(
        "gpu" if device.type == "cuda" else "gpu_cpu_smoke",
        f"GPU: {args.model} training throughput, MFU and outer step ({name})",
        args,
        [{k: v for k, v in r.items() if k != "detail"} for r in rows],
        notes=notes(name, peak, args, flops, bw),
        verdicts=verdicts,
        tables={
            "Outer step on this device": (
                [{k: v for k, v in o.items() if k != "detail"} for o in outer],
                None,
            )
        },
        extra={"flops": flops, "peak_tflops": peak, "train": rows, "outer": outer, "device_copy_gb_s": bw},
    )
    return 0


def train_rows(
    model, device, args, flops_per_token: float, peak: float | None, deadline: float
) -> list[dict]:
    """Training throughput and MFU, eager then compiled (unless --no-compile), within the time budget."""
    rows = []
    for compiled in [False] if args.no_compile else [False, True]:
        if time.perf_counter() > deadline:
            break
        r = train_throughput(model, device, args, compiled, deadline)
        mfu = r["tokens_per_s"] * flops_per_token / (peak * 1e12) if peak else None
        rows.append(
            {
                "what": f"train step, {'torch.compile' if compiled else 'eager'}, "
                f"{'bf16 autocast' if args.bf16 else 'fp32'}, SDPA",
                "tokens/s": r["tokens_per_s"],
                "step s": r["step_s"],
                "first step s": r["first_step_s"],
                "MFU": mfu,
                "target": TARGET_MFU,
                "met": None if mfu is None else ("yes" if mfu >= TARGET_MFU else "NO"),
                "memory GB": r.get("max_memory_gb"),
                **{"detail": r},
            }
        )
    return rows


def outer_rows(model, device, args, deadline: float) -> tuple[list[dict], float]:
    """One worker's outer step with the global copy on the device and on the CPU, against the floor at
    the device's copy bandwidth (measured here, GB/s, returned beside the rows)."""
    n_bytes = 4 * sum(p.numel() for p in model.parameters())
    bw = device_copy_bandwidth(device, min(1 << 30, 4 * n_bytes))
    outer = []
    for where in ("device", "cpu"):
        if time.perf_counter() > deadline:
            break
        m = outer_step_time(model, device, where, args.repeats)
        # bench_outer_step's floor for one worker (nothing to average): 12N + 20N + 8N bytes
        floor = 40 * n_bytes / 4 / (bw * bc.GB)
        outer.append(
            {
                "global copy on": where,
                "seconds": m["median"],
                "floor s (device bandwidth)": floor,
                "x_floor": m["median"] / floor,
                "detail": m,
            }
        )
    return outer, bw


def notes(name: str, peak: float | None, args, flops: dict, bw: float) -> list[str]:
    return [
        f"Device: {name}; peak dense bf16 assumed {peak} TFLOPs"
        + (" (unknown device: pass --peak-tflops)" if peak is None else ""),
        f"Model {args.model}: {flops['params_total'] / 1e6:.1f}M parameters, {flops['params_matmul'] / 1e6:.1f}M in "
        f"matmuls; FLOPs/token = 6N + 12LHQT = {flops['dense'] / 1e9:.3f} + {flops['attention'] / 1e9:.3f} "
        f"= {flops['total'] / 1e9:.3f} GFLOP at T={args.seq_len}.",
        f"Batch: {args.accum} micro-batches of {args.micro_batch} x {args.seq_len} tokens per optimizer step; random "
        "tokens on the device (no data loading); AdamW (fused on CUDA, the trainer's default), clip 1.0; TF32 allowed for fp32 "
        "matmuls.",
        "Outer step: one worker, so nothing is averaged; floor 40 N bytes (pseudo-gradient 12N, Nesterov 20N, "
        f"install 8N) at the device copy bandwidth measured here ({bw:.0f} GB/s). With the global copy on the CPU "
        "the step also crosses PCIe twice and runs the Nesterov step on the CPU, so its x_floor is not a target.",
    ]


if __name__ == "__main__":
    sys.exit(main())

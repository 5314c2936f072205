"""Benchmark (issues #13, #32): int8 / 4-bit / topk2 encoding with error feedback against memory bandwidth.

One worker's share of a round for one bucket of N float32 elements, through the project's own code
(`diloco.quant`): add the residual, quantize (blockwise absmax, bfloat16 scales), decode what was sent,
keep the new residual; and decoding one received payload into the running mean. Both paths are timed:
the fused C kernel the CPU uses (`kernel` c, diloco.quant_kernel) and the eager torch ops (`kernel`
torch: GPU tensors, or no C compiler); the verdicts judge the path this machine runs. The floor is the bytes these steps must
read and write at least once, divided by the copy bandwidth measured right before (`dst.copy_(src)`,
bytes read + written per second), p the payload bytes:

    encode with error feedback   read pseudo-grad 4N, read residual 4N, write residual 4N, write p
    decode one payload           read p, add into the mean: read 4N, write 4N

topk2 (`diloco.sparse`) is timed the same way on both paths (the C kernel's `topk_encode` fuses it as
quant's does): carry + pseudo-grad, the chunks' top-k, codes, indices and levels, the carry left behind;
and decoding one payload into the mean (torch's scatter_add on either path, so timed once, as torch).

Target (issues #13, #32): at most 2x the floor. Nothing is asserted; `make bench` reports.

    python scripts/bench_quant.py            # a 128 MB bucket (the default bucket_size_mb), ~1 minute
    python scripts/bench_quant.py --tiny
"""

from __future__ import annotations

import os

import torch

from diloco import sparse
from diloco.bench import common as bc
from diloco.comm import SoloCollective
from diloco.quant import QuantizedAverager, dequantize, payload_bytes
from diloco.quant_kernel import kernel


def measure_dtype(dtype: str, bits: int, pseudo_grad: torch.Tensor, path: str, args) -> list[dict]:
    os.environ["DILOCO_QUANT_KERNEL"] = path
    n = pseudo_grad.numel()
    avg = QuantizedAverager(SoloCollective(), dtype, block_size=256, error_feedback=True)
    avg.residuals[0] = torch.randn(n) * 1e-5
    v, mean = torch.empty(n), torch.zeros(n)
    payload_n = payload_bytes(n, bits, 256)
    bw = bc.copy_bandwidth(nbytes=4 * n, repeats=3)["gb_per_s"] * bc.GB
    encode = bc.measure(lambda: avg.encode(v.view(1, -1), avg.residuals, 0), args.repeats, args.warmup)
    payload = avg.encode(v.copy_(pseudo_grad).view(1, -1), avg.residuals, 0)[0].view(-1)
    decode = bc.measure(
        lambda: dequantize(payload, n, bits, 256, out=mean, accumulate=True), args.repeats, args.warmup
    )
    rows = []
    for what, m, floor_bytes in (
        ("encode + error feedback", encode, 12 * n + payload_n),
        ("decode one payload into the mean", decode, payload_n + 8 * n),
    ):
        floor = floor_bytes / bw
        rows.append(
            {
                "dtype": dtype,
                "kernel": path,
                "step": what,
                "elements": n,
                "payload bytes": payload_n,
                "seconds": m["median"],
                "floor s": floor,
                "x floor": m["median"] / floor,
                "copy GB/s": bw / bc.GB,
            }
        )
    return rows


def measure_topk(pseudo_grad: torch.Tensor, path: str, args) -> list[dict]:
    """topk2 at SparseLoCo's 64 of 4,096, through `path` (c: diloco.quant_kernel's topk_encode; torch:
    the eager ops)."""
    os.environ["DILOCO_QUANT_KERNEL"] = path
    n, chunk, k = pseudo_grad.numel(), sparse.MAX_CHUNK, 64
    avg = sparse.TopKAverager(SoloCollective(), density=k / chunk, chunk=chunk)
    carry = avg.carry(0, n, pseudo_grad.device)
    carry[:n].copy_(torch.randn(n) * 1e-5)
    payload_n = sparse.payload_bytes(n, chunk, k)
    out = torch.empty(payload_n, dtype=torch.uint8)

    def encode():  # what TopKAverager.average_ does before the all-gather: carry + pseudo_grad, encoded
        return sparse.encode_(carry.view(-1, chunk), k, n, out=out, add=pseudo_grad)

    bw = bc.copy_bandwidth(nbytes=4 * n, repeats=3)["gb_per_s"] * bc.GB
    steps = [("encode + error feedback", bc.measure(encode, args.repeats, args.warmup), 12 * n + payload_n)]
    if path == "torch":  # decoding is torch's scatter_add on either path: timed once
        payload, mean = encode()[0], torch.zeros_like(carry)
        decoded = bc.measure(lambda: sparse.decode_add_(payload, chunk, k, mean), args.repeats, args.warmup)
        steps.append(("decode one payload into the mean", decoded, payload_n + 8 * n))
    return [
        {
            "dtype": "topk2",
            "kernel": path,
            "step": what,
            "elements": n,
            "payload bytes": payload_n,
            "seconds": m["median"],
            "floor s": floor_bytes / bw,
            "x floor": m["median"] / (floor_bytes / bw),
            "copy GB/s": bw / bc.GB,
        }
        for what, m, floor_bytes in steps
    ]


def main(argv=None) -> int:
    p = bc.parser(__doc__.splitlines()[0], repeats=5)
    p.add_argument("--mb", type=float, default=128, help="bucket size in float32 MB")
    args = bc.finish_args(p.parse_args(argv))
    torch.manual_seed(0)
    pseudo_grad = torch.randn(int((1 if args.tiny else args.mb) * 2**20 / 4)) * 1e-3
    if kernel() is None:
        print("no C kernel could be built here: only the eager torch path is measured")
    paths = ("c", "torch") if kernel() is not None else ("torch",)
    rows = [
        r
        for path in paths
        for dtype, bits in (("int8", 8), ("int4", 4))
        for r in measure_dtype(dtype, bits, pseudo_grad, path, args)
    ]
    rows += [r for path in paths for r in measure_topk(pseudo_grad, path, args)]
    os.environ.pop("DILOCO_QUANT_KERNEL")
    verdicts = [
        f"{r['dtype']} {r['step']} ({r['kernel']}): {r['x floor']:.1f}x the bandwidth floor (target <= 2.0x): "
        + ("met" if r["x floor"] <= 2.0 else "NOT met")
        for r in rows
        if r["kernel"] == paths[0] or (r["dtype"] == "topk2" and r["step"].startswith("decode"))
    ]
    bc.write("quant", "int8 / 4-bit / topk2 encoding vs memory bandwidth", args, rows, verdicts=verdicts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

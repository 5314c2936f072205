"""Int8 and 4-bit pseudo-gradients with blockwise scales and error feedback (`pseudo_grad_dtype` int8 |
int4), behind the same `average_` seam as comm.Averager.

Wire format of one flat FP32 bucket of n elements, blocks of `block` elements (the last one zero-padded):

    codes   int8: n' bytes, one signed code in [-127, 127] per element  (n' = n rounded up to a block)
            int4: n'/2 bytes, two codes in [-7, 7] per byte (low nibble first), stored as code + 8
    scales  bfloat16, one per block: absmax(block) / qmax, so x ~= code * scale

Averaging is a quantized reduce-scatter and all-gather (INTELLECT-1's int8 all-reduce, in two shots),
so each worker sends 2(W-1)/W payloads per round, as a ring all-reduce of the codes would: the bucket is
cut into W chunks of whole blocks; every worker quantizes its pseudo-gradient and sends chunk j's codes
to worker j (all-to-all); worker j dequantizes the W codes of its chunk, sums them in FP32 in rank order
and divides by W, quantizes that mean once more and all-gathers it. Nothing is summed in low precision,
and every worker decodes the same gathered codes, so all get the same mean bit for bit. (All-gathering
every worker's codes instead costs (W-1) payloads per worker: W/2 times more at W > 2.)

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, EF-SGD) at both quantizations: each worker
adds what quantization lost last round to this round's pseudo-gradient before quantizing and keeps the
new loss; the owner of a chunk does the same for the chunk's mean. Over rounds nothing is dropped: what
arrived + the owners' residuals + the mean of the workers' residuals = the mean of the inputs. The
residuals (FP32, one bucket's worth per worker plus one chunk per owner) are checkpointed: resume stays
exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diloco import quant_kernel
from diloco.comm import CastStats, Collective

QUANT_BITS = {"int8": 8, "int4": 4}


def code_bytes(n: int, bits: int, block: int) -> int:
    """Bytes of the codes of n values (whole blocks); the bfloat16 scales follow them in a payload."""
    return -(-n // block) * block * bits // 8


def payload_bytes(n: int, bits: int, block: int) -> int:
    return code_bytes(n, bits, block) + 2 * -(-n // block)


def quantize(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """FP32 [n] -> uint8 [payload_bytes(n)]: codes, then bfloat16 scales (module docstring)."""
    qmax = 2 ** (bits - 1) - 1
    pad = (-x.numel()) % block
    xb = (F.pad(x, (0, pad)) if pad else x).view(-1, block)  # [blocks, block]
    # two reads, no |x| temporary; abs_: +0 for an all-zero block, not max(0, -0) = -0
    absmax = torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg_()).abs_()
    scales = (absmax / qmax).to(torch.bfloat16)  # [blocks], what is sent
    s = scales.float()
    inv = torch.where(s > 0, s, torch.ones_like(s)).reciprocal_()  # an all-zero block: codes 0
    q = torch.mul(xb, inv[:, None]).round_().clamp_(-qmax, qmax).to(torch.int8)  # [blocks, block]
    if bits == 4:
        u = (q + 8).to(torch.uint8)
        codes = u[:, 0::2] | (u[:, 1::2] << 4)  # [blocks, block / 2]
    else:
        codes = q.view(torch.uint8)
    return torch.cat([codes.reshape(-1), scales.view(torch.uint8)])


def dequantize(
    payload: torch.Tensor,
    n: int,
    bits: int,
    block: int,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """uint8 [payload_bytes(n)] -> FP32 [n]; with `out` (FP32, at most n elements), its first
    out.numel() elements written into out, or added to it with `accumulate` (code * scale, then +)."""
    blocks, cb = -(-n // block), code_bytes(n, bits, block)
    codes, scale_bytes = payload[:cb], payload[cb:]
    fast = out is not None and out.dtype == torch.float32 and payload.dtype == torch.uint8
    if fast and quant_kernel.usable(payload, out):
        quant_kernel.decode(codes, scale_bytes, out, bits, block, accumulate)
        return out
    scales = scale_bytes.clone().view(torch.bfloat16).float()  # [blocks]; clone: 2-byte aligned
    codes = codes.view(blocks, -1)
    if bits == 4:
        q = torch.stack([(codes & 0x0F), (codes >> 4)], dim=2).view(blocks, block).to(torch.int8) - 8
    else:
        q = codes.view(torch.int8)
    x = (q.float() * scales[:, None]).view(-1)[:n]
    if out is None:
        return x
    x = x[: out.numel()]
    return out.add_(x) if accumulate else out.copy_(x)


def encode(
    x: torch.Tensor,
    bits: int,
    block: int,
    carry: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[float, float, int]]:
    """The payload of y = x + carry (FP32 [n]; carry: the residual quantization left last time, or None)
    and (||y||^2, ||y - sent||^2, #non-zero elements sent as zero); residual (FP32 [n], may be carry
    itself) <- y - sent, what this payload loses; out: where to write the payload (uint8
    [payload_bytes(n)]), else a new tensor. x is not modified. On CPU the fused kernel
    (diloco.quant_kernel), elsewhere these torch ops: the same bits either way."""
    n = x.numel()
    if out is None:
        out = torch.empty(payload_bytes(n, bits, block), dtype=torch.uint8, device=x.device)
    f32 = all(t is None or t.dtype == torch.float32 for t in (x, carry, residual))
    if f32 and out.dtype == torch.uint8 and quant_kernel.usable(x, carry, residual, out):
        cb = code_bytes(n, bits, block)
        return out, quant_kernel.encode(x, carry, residual, bits, block, out[:cb], out[cb:])
    y = x + carry if carry is not None else x
    payload = out.copy_(quantize(y, bits, block))
    sent = dequantize(payload, n, bits, block)
    err = y - sent
    if residual is not None:
        residual.copy_(err)
    y64 = y.double()
    sq_norm, sq_err, under = torch.stack(
        [y64.square().sum(), err.double().square().sum(), ((y != 0) & (sent == 0)).sum().double()]
    ).tolist()
    return payload, (sq_norm, sq_err, int(under))


class QuantizedAverager:
    """Mean over the members of `coll` of flat FP32 buckets sent as int8/int4 codes (module docstring).
    `key` names a bucket, for its error-feedback residuals."""

    def __init__(self, coll: Collective, dtype: str, block_size: int = 256, error_feedback: bool = True):
        if dtype not in QUANT_BITS:
            raise ValueError(
                f"quantized pseudo_grad_dtype must be one of {sorted(QUANT_BITS)}, got {dtype!r}"
            )
        if block_size < 2 or block_size % 2:
            raise ValueError(f"quant_block_size must be an even number >= 2, got {block_size}")
        self.coll, self.dtype, self.bits, self.block = coll, dtype, QUANT_BITS[dtype], block_size
        self.wire = torch.uint8
        self.error_feedback = error_feedback
        self.residuals: dict[int, torch.Tensor] = {}  # this worker's, per bucket (padded to W chunks)
        self.mean_residuals: dict[int, torch.Tensor] = {}  # the mean's, per bucket, of the chunk it owns
        self.cast = CastStats()
        self._payloads: dict[tuple[bool, int], torch.Tensor] = {}  # the send buffers, per bucket

    def encode(self, v: torch.Tensor, residuals: dict, key: int) -> tuple[torch.Tensor, tuple]:
        """(codes of v + residual as [rows, one chunk's payload], the error sums of `encode`);
        residuals[key] <- what they lost. v: [rows, chunk], chunk a whole number of blocks (not modified)."""
        rows, chunk = v.shape
        carry = residuals.get(key) if self.error_feedback else None
        residual = None
        if self.error_feedback:
            residual = carry if carry is not None else torch.empty(v.numel(), device=v.device)
            residuals[key] = residual
        shape, slot = (rows, payload_bytes(chunk, self.bits, self.block)), (residuals is self.residuals, key)
        out = self._payloads.get(slot)
        if out is None or out.shape != shape:  # kept: a fresh buffer would page-fault every round
            out = self._payloads[slot] = torch.empty(shape, dtype=torch.uint8, device=v.device)
        sums = [0.0, 0.0, 0]
        for i in range(rows):  # one payload per row, written in place: what the collective sends
            part = slice(i * chunk, (i + 1) * chunk)
            _, stats = encode(
                v[i],
                self.bits,
                self.block,
                None if carry is None else carry[part],
                None if residual is None else residual[part],
                out=out[i],
            )
            sums = [a + b for a, b in zip(sums, stats)]
        return out, tuple(sums)

    def average_(self, flat: torch.Tensor, sizes: list[int], key: int = 0) -> torch.Tensor:
        """flat (FP32 [n]) <- the mean over all members of what each sends for it (module docstring)."""
        w, n = self.coll.size, flat.numel()
        chunk = -(-n // (w * self.block)) * self.block  # whole blocks, so a block never spans two chunks
        v = flat.new_zeros(w, chunk)  # flat, zero-padded to W chunks (flat is written only at the end)
        v.view(-1)[:n].copy_(flat)
        rows, (sq_norm, sq_err, under) = self.encode(v, self.residuals, key)
        c = self.cast
        c.sq_norm, c.sq_error, c.underflow = c.sq_norm + sq_norm, c.sq_error + sq_err, c.underflow + under
        c.numel += n
        tag = f"pseudo_grad_{self.dtype}"
        got = self.coll.all_to_all(rows, tag=tag)  # row i: worker i's codes of the chunk this one owns
        mine = torch.zeros(1, chunk, dtype=flat.dtype, device=flat.device)
        for row in got:  # rank order: the same sum on whichever worker owns it
            dequantize(row, chunk, self.bits, self.block, out=mine[0], accumulate=True)
        mine.div_(w)
        mean_rows, _ = self.encode(mine, self.mean_residuals, key)
        gathered = self.coll.all_gather(mean_rows[0], tag=tag)  # [W, one chunk's codes]
        for i, row in enumerate(gathered):
            lo, hi = i * chunk, min(n, (i + 1) * chunk)
            if lo < hi:
                dequantize(row, chunk, self.bits, self.block, out=flat[lo:hi])
        return flat

    def state_dict(self) -> dict:
        return {
            "residuals": {k: t.cpu() for k, t in self.residuals.items()},
            "mean_residuals": {k: t.cpu() for k, t in self.mean_residuals.items()},
        }

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        def on_device(saved: dict) -> dict[int, torch.Tensor]:
            return {int(k): t.to(device, copy=True) for k, t in saved.items()}

        self.residuals = on_device(state.get("residuals", {}))
        self.mean_residuals = on_device(state.get("mean_residuals", {}))

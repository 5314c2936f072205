"""Int8 and 4-bit pseudo-gradients with blockwise scales and error feedback (`pseudo_grad_dtype` int8 |
int4), behind the same `average_` seam as comm.Averager.

Wire format of one flat FP32 bucket of n elements, blocks of `block` elements (the last one zero-padded):

    codes   int8: n' bytes, one signed code in [-127, 127] per element  (n' = n rounded up to a block)
            int4: n'/2 bytes, two codes in [-7, 7] per byte (low nibble first), stored as code + 8
    scales  bfloat16, one per block: absmax(block) / qmax, so x ~= code * scale

Nothing is summed in low precision: every worker all-gathers the others' payloads (codes + scales, one
uint8 tensor) and sums the dequantized FP32 values in rank order, so every worker computes the same
mean bit for bit. Error feedback (Seide et al. 2014; Karimireddy et al. 2019, EF-SGD): each worker adds
what quantization lost last round to this round's pseudo-gradient before quantizing, and keeps the new
loss, so over rounds nothing is dropped (sum of what was sent + the residual = sum of the inputs).
The residuals (one FP32 copy of the buckets this rank averages) are checkpointed: resume stays exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diloco.comm import CastStats, Collective

QUANT_BITS = {"int8": 8, "int4": 4}


def payload_bytes(n: int, bits: int, block: int) -> int:
    blocks = -(-n // block)
    return blocks * block * bits // 8 + 2 * blocks


def quantize(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """FP32 [n] -> uint8 [payload_bytes(n)]: codes, then bfloat16 scales (module docstring)."""
    qmax = 2 ** (bits - 1) - 1
    pad = (-x.numel()) % block
    xb = (F.pad(x, (0, pad)) if pad else x).view(-1, block)  # [blocks, block]
    absmax = torch.maximum(xb.amax(dim=1), xb.amin(dim=1).neg_())  # two reads, no |x| temporary
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


def dequantize(payload: torch.Tensor, n: int, bits: int, block: int, out: torch.Tensor | None = None):
    """uint8 [payload_bytes(n)] -> FP32 [n] (into `out` when given)."""
    blocks = -(-n // block)
    code_bytes = blocks * block * bits // 8
    scales = payload[code_bytes:].clone().view(torch.bfloat16).float()  # [blocks]; clone: 2-byte aligned
    codes = payload[:code_bytes].view(blocks, -1)
    if bits == 4:
        q = torch.stack([(codes & 0x0F), (codes >> 4)], dim=2).view(blocks, block).to(torch.int8) - 8
    else:
        q = codes.view(torch.int8)
    x = (q.float() * scales[:, None]).view(-1)[:n]
    return x if out is None else out.copy_(x)


class QuantizedAverager:
    """Mean over the members of `coll` of flat FP32 buckets sent as int8/int4 codes (module docstring).
    `key` names a bucket, for its error-feedback residual."""

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
        self.residuals: dict[int, torch.Tensor] = {}
        self.cast = CastStats()

    def encode(self, flat: torch.Tensor, key: int = 0) -> torch.Tensor:
        """This member's payload for bucket `key`; with error feedback flat becomes v = flat + residual and
        the residual v - decode(payload)."""
        if self.error_feedback and key in self.residuals:
            flat.add_(self.residuals[key])  # v = pseudo_grad + what was lost last round
        payload = quantize(flat, self.bits, self.block)
        sent = dequantize(payload, flat.numel(), self.bits, self.block)
        self._measure(flat, sent)
        if self.error_feedback:
            self.residuals[key] = torch.sub(flat, sent, out=self.residuals.get(key))  # v - Q(v)
        return payload

    def average_(self, flat: torch.Tensor, sizes: list[int], key: int = 0) -> torch.Tensor:
        """flat (FP32 [n]) <- the mean over all members of what each sends for it."""
        rows = self.coll.all_gather(self.encode(flat, key), tag=f"pseudo_grad_{self.dtype}")  # [W, bytes]
        flat.zero_()
        for row in rows:  # rank order: every member adds in the same order, the same mean everywhere
            flat.add_(dequantize(row, flat.numel(), self.bits, self.block))
        return flat.div_(self.coll.size)

    def _measure(self, v: torch.Tensor, sent: torch.Tensor) -> None:
        v64 = v.double()
        sq_norm, sq_err, under = torch.stack(
            [
                v64.square().sum(),
                (sent.double() - v64).square().sum(),
                ((v != 0) & (sent == 0)).sum().double(),
            ]
        ).tolist()
        c = self.cast
        c.sq_norm, c.sq_error, c.underflow = (
            c.sq_norm + sq_norm,
            c.sq_error + sq_err,
            c.underflow + int(under),
        )
        c.numel += v.numel()

    def state_dict(self) -> dict:
        return {"residuals": {k: t.cpu() for k, t in self.residuals.items()}}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.residuals = {int(k): t.to(device, copy=True) for k, t in state.get("residuals", {}).items()}

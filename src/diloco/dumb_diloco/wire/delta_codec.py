"""DumbDiLoCo deltas on the wire as float32, int8 or int4 (`pseudo_grad_dtype`, issue 13), with error
feedback on the node. The quantizer is synchronous DiLoCo's (diloco.quant): blockwise codes with one
bfloat16 scale per `quant_block_size` elements.

Wire format of a quantized delta: for every tensor name of the float32 delta, one uint8 tensor of
shape [payload_bytes(numel, bits, block)], `quant.quantize` of the flattened tensor (codes, then the
scales); the metadata says `dtype` int8 | int4 and `quant_block_size` (tensor_format.DeltaMeta). A float32
delta is written exactly as before (no block size in its header).

Node (`DeltaCodec`): v = delta + residual; payload = quant.encode(v); the residual after it is v - Q(v),
committed only once the upload succeeded. A failed upload leaves the residual as it was and its
unquantized delta is carried into the next one (uploader.py), so nothing is lost or counted twice: the sum
of what the master decoded plus the residual equals the sum of the node's deltas. The residual is a
difference of deltas, not a position: install.translate does not shift it.

Master (`wire_layout`, `to_float32`): the layout a file in its announced format must have, checked by
tensor_format.decode before anything is used, then each payload dequantized to float32 in the model
tensor's shape; NaN or Inf (a hostile scale) rejects the file.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from diloco.quant import QUANT_BITS, dequantize, payload_bytes
from diloco.quant import encode as quant_encode

from .tensor_format import DeltaMeta, InvalidTensorFile, encode

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]
WIRE_DTYPES = ("float32", "int8", "int4")  # what the master decodes (config.check_dumb_diloco's choices)


def wire_layout(layout: Layout, meta: DeltaMeta) -> Layout:
    """(shape, dtype) of every tensor of a delta file in `meta`'s format, for the float32 `layout`."""
    if meta.dtype not in QUANT_BITS:
        return layout
    bits, block = QUANT_BITS[meta.dtype], meta.quant_block_size
    return {k: ((payload_bytes(math.prod(s), bits, block),), torch.uint8) for k, (s, _) in layout.items()}


def to_float32(tensors: dict[str, torch.Tensor], meta: DeltaMeta, layout: Layout) -> dict[str, torch.Tensor]:
    """The float32 delta of a file `decode` validated against `wire_layout(layout, meta)`. Raises
    InvalidTensorFile if a quantized tensor decodes to NaN or Inf."""
    if meta.dtype not in QUANT_BITS:
        return tensors
    bits, block, out = QUANT_BITS[meta.dtype], meta.quant_block_size, {}
    for k, (shape, _) in layout.items():
        n = math.prod(shape)
        x = torch.empty(shape)
        if n:
            dequantize(tensors[k], n, bits, block, out=x.view(-1))
        if not bool(torch.isfinite(x).all()):
            raise InvalidTensorFile(
                f"tensor {k!r}: its {meta.dtype} payload decodes to NaN or Inf (bad scales)"
            )
        out[k] = x
    return out


class DeltaCodec:
    """A node's encoder: float32 deltas as they are; int8/int4 with error feedback (module docstring)."""

    def __init__(self, dtype: str = "float32", block: int = 256, error_feedback: bool | None = None):
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"pseudo_grad_dtype must be one of {WIRE_DTYPES}, got {dtype!r}")
        self.dtype, self.block, self.bits = dtype, block, QUANT_BITS.get(dtype)
        self.error_feedback = self.bits is not None and error_feedback is not False
        self.residual: dict[str, torch.Tensor] = {}  # float32, the deltas' shapes; what no upload carried yet
        self.rel_error = 0.0  # ||Q(v) - v|| / ||v|| of the last delta encoded

    @classmethod
    def from_settings(cls, s) -> DeltaCodec:
        return cls(s.pseudo_grad_dtype, s.quant_block_size, s.error_feedback)

    def encode(self, delta: dict[str, torch.Tensor], meta: DeltaMeta) -> tuple[bytes, dict | None]:
        """The file of `delta` (not modified) in this format, and the residual to `commit` once it is
        uploaded (None without error feedback)."""
        if self.bits is None:
            return encode(delta, meta.to_header()), None
        meta = dataclasses.replace(meta, dtype=self.dtype, quant_block_size=self.block)
        payloads, residual, sq_norm, sq_err = {}, {}, 0.0, 0.0
        for k, d in delta.items():
            carry = self.residual[k].reshape(-1) if k in self.residual else None
            residual[k] = torch.empty(d.shape)  # v - Q(v), v = d + carry
            payloads[k], (sq, se, _) = quant_encode(
                d.reshape(-1), self.bits, self.block, carry, residual[k].view(-1)
            )
            sq_norm, sq_err = sq_norm + sq, sq_err + se
        self.rel_error = math.sqrt(sq_err / sq_norm) if sq_norm > 0 else 0.0
        return encode(payloads, meta.to_header()), residual if self.error_feedback else None

    def commit(self, residual: dict[str, torch.Tensor] | None) -> None:
        """The upload of the delta that gave `residual` succeeded: from now on it is the residual."""
        if residual is not None:
            self.residual = residual

    # ---- the node's checkpoint: the residual as it is once the upload in flight (if any) succeeds

    def state_dict(self, job=None, timeout: float = 60.0) -> dict:
        """The residual to checkpoint. `job`: the upload in flight, which the checkpoint counts as done
        (its delta is in no carry): its residual, once its encoding is done (`job.encoded`)."""
        if not self.error_feedback:
            return {}
        residual = self.residual
        if job is not None and job.encoded.wait(timeout) and job.residual is not None:
            residual = job.residual
        return {"residual": {k: t.clone() for k, t in residual.items()}}

    def load_state_dict(self, state: dict, layout: Layout) -> str | None:
        """Restore the residual (ValueError if it is not of this model's deltas); a warning when this run
        has no error feedback to continue it with (its quantization error is then dropped)."""
        if not state.get("residual"):
            return None
        if not self.error_feedback:
            return f"this run's pseudo_grad_dtype {self.dtype} has no error feedback: its residual is dropped"
        if {k: (tuple(t.shape), t.dtype) for k, t in state["residual"].items()} != layout:
            raise ValueError("the checkpoint's error-feedback residual is not of this model")
        self.residual = {k: t.detach().to("cpu", copy=True) for k, t in state["residual"].items()}
        return None

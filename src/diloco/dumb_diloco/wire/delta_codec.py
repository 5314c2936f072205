"""DumbDiLoCo deltas on the wire as float32, int8, int4 (`pseudo_grad_dtype`, issue 13) or topk2 (issue 32),
with error feedback on the node. The quantizer is synchronous DiLoCo's (diloco.quant): blockwise codes with
one bfloat16 scale per `quant_block_size` elements; topk2 is synchronous DiLoCo's sparse format
(diloco.sparse): per chunk of `topk_chunk` values the k largest as 2-bit codes with 12-bit indices.

Wire format of a quantized delta: for every tensor name of the float32 delta, one uint8 tensor of
shape [payload_bytes(numel, bits, block)], `quant.quantize` of the flattened tensor (codes, then the
scales); the metadata says `dtype` int8 | int4 and `quant_block_size` (tensor_format.DeltaMeta). A topk2
delta: for every tensor name one uint8 tensor of shape [sparse.payload_bytes(numel, chunk, k)], the
flattened tensor zero-padded to whole chunks and encoded by `sparse.encode_`; the metadata says `topk_chunk`
and `topk_k`. A float32 delta is written exactly as before (no block size in its header).

Node (`DeltaCodec`): v = delta + residual; payload = quant.encode(v); the residual after it is v - Q(v),
committed only once the upload succeeded. A failed upload leaves the residual as it was and its
unquantized delta is carried into the next one (uploader.py), so nothing is lost or counted twice: the sum
of what the master decoded plus the residual equals the sum of the node's deltas. The residual is a
difference of deltas, not a position: install.translate does not shift it.

Master (`wire_layout`, `to_float32`): the layout a file in its announced format must have, checked by
tensor_format.decode before anything is used, then each payload dequantized to float32 in the model
tensor's shape; NaN or Inf (a hostile scale) rejects the file, and so does a topk2 chunk whose indices are
not unique or not inside the chunk (they would add twice, or into another chunk).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from diloco import sparse
from diloco.quant import QUANT_BITS, dequantize, payload_bytes
from diloco.quant import encode as quant_encode

from .tensor_format import TOPK_DTYPE, DeltaMeta, InvalidTensorFile, encode

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]
WIRE_DTYPES = ("float32", "int8", "int4", TOPK_DTYPE)  # what the master decodes (config.check_dumb_diloco's)


def wire_layout(layout: Layout, meta: DeltaMeta) -> Layout:
    """(shape, dtype) of every tensor of a delta file in `meta`'s format, for the float32 `layout`."""
    if meta.dtype == TOPK_DTYPE:
        size = {
            k: sparse.payload_bytes(math.prod(s), meta.topk_chunk, meta.topk_k)
            for k, (s, _) in layout.items()
        }
        return {k: ((n,), torch.uint8) for k, n in size.items()}
    if meta.dtype not in QUANT_BITS:
        return layout
    bits, block = QUANT_BITS[meta.dtype], meta.quant_block_size
    return {k: ((payload_bytes(math.prod(s), bits, block),), torch.uint8) for k, (s, _) in layout.items()}


def to_float32(tensors: dict[str, torch.Tensor], meta: DeltaMeta, layout: Layout) -> dict[str, torch.Tensor]:
    """The float32 delta of a file `decode` validated against `wire_layout(layout, meta)`. Raises
    InvalidTensorFile if a quantized tensor decodes to NaN or Inf, or a topk2 chunk's indices are bad."""
    if meta.dtype not in QUANT_BITS and meta.dtype != TOPK_DTYPE:
        return tensors
    out = {}
    for k, (shape, _) in layout.items():
        x = _topk_to_float32(k, tensors[k], shape, meta) if meta.dtype == TOPK_DTYPE else torch.empty(shape)
        if meta.dtype in QUANT_BITS and x.numel():
            dequantize(tensors[k], x.numel(), QUANT_BITS[meta.dtype], meta.quant_block_size, out=x.view(-1))
        if not bool(torch.isfinite(x).all()):
            raise InvalidTensorFile(
                f"tensor {k!r}: its {meta.dtype} payload decodes to NaN or Inf (bad scales)"
            )
        out[k] = x
    return out


def _topk_to_float32(
    name: str, payload: torch.Tensor, shape: tuple[int, ...], meta: DeltaMeta
) -> torch.Tensor:
    """A topk2 payload of a tensor of `shape`, decoded, once every chunk's indices are inside the chunk and
    unique (a repeated index would add twice; the file's size already fixed k per chunk)."""
    n, chunk, k = math.prod(shape), meta.topk_chunk, meta.topk_k
    idx, _ = sparse.unpack(payload, sparse.num_chunks(n, chunk), k)
    if bool((idx >= chunk).any()):
        raise InvalidTensorFile(f"tensor {name!r}: a topk2 index is outside its chunk of {chunk}")
    ordered = idx.sort(dim=1).values
    if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise InvalidTensorFile(f"tensor {name!r}: a topk2 chunk repeats an index")
    return sparse.decode(payload, n, chunk, k).view(shape)


class DeltaCodec:
    """A node's encoder: float32 deltas as they are; int8/int4/topk2 with error feedback (module docstring)."""

    def __init__(
        self,
        dtype: str = "float32",
        block: int = 256,
        error_feedback: bool | None = None,
        topk_density: float = 1 / 64,
        topk_chunk: int = sparse.MAX_CHUNK,
        topk_ef_decay: float = 1.0,
    ):
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"pseudo_grad_dtype must be one of {WIRE_DTYPES}, got {dtype!r}")
        self.dtype, self.block, self.bits = dtype, block, QUANT_BITS.get(dtype)
        self.topk = dtype == TOPK_DTYPE
        if self.topk and error_feedback is False:
            raise ValueError("pseudo_grad_dtype topk2 needs error_feedback (it drops most of every delta)")
        self.chunk, self.k = topk_chunk, sparse.topk_count(topk_density, topk_chunk)
        self.decay = topk_ef_decay  # topk2: the carry is decayed by this before the next delta joins it
        self.error_feedback = self.lossy and error_feedback is not False
        self.residual: dict[str, torch.Tensor] = {}  # float32, the deltas' shapes; what no upload carried yet
        self.rel_error = 0.0  # ||Q(v) - v|| / ||v|| of the last delta encoded

    @property
    def lossy(self) -> bool:
        """int8/int4/topk2: what a delta's file holds is not the delta (rel_error says how far)."""
        return self.bits is not None or self.topk

    @classmethod
    def from_settings(cls, s) -> DeltaCodec:
        return cls(
            s.pseudo_grad_dtype,
            s.quant_block_size,
            s.error_feedback,
            s.topk_density,
            s.topk_chunk,
            s.topk_ef_decay,
        )

    def encode(self, delta: dict[str, torch.Tensor], meta: DeltaMeta) -> tuple[bytes, dict | None]:
        """The file of `delta` (not modified) in this format, and the residual to `commit` once it is
        uploaded (None without error feedback)."""
        if self.topk:
            return self._encode_topk(delta, meta)
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

    def _encode_topk(self, delta: dict[str, torch.Tensor], meta: DeltaMeta) -> tuple[bytes, dict]:
        """topk2: v = residual * decay + delta per tensor, zero-padded to whole chunks (as
        sparse.TopKAverager does for a bucket); sparse.encode_ leaves v - decoded(payload) in the padded
        buffer, whose first numel values are the new residual."""
        meta = dataclasses.replace(meta, dtype=self.dtype, topk_chunk=self.chunk, topk_k=self.k)
        payloads, residual, sq_norm, sq_err = {}, {}, 0.0, 0.0
        for name, d in delta.items():
            n = d.numel()
            y = torch.zeros(sparse.num_chunks(n, self.chunk) * self.chunk)
            if name in self.residual:
                y[:n].copy_(self.residual[name].reshape(-1))
            add = d.reshape(-1).float().contiguous()
            payloads[name], (sq, se, _) = sparse.encode_(
                y.view(-1, self.chunk), self.k, n, add=add, decay=self.decay
            )
            residual[name] = y[:n].view(d.shape)
            sq_norm, sq_err = sq_norm + sq, sq_err + se
        self.rel_error = math.sqrt(sq_err / sq_norm) if sq_norm > 0 else 0.0
        return encode(payloads, meta.to_header()), residual

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

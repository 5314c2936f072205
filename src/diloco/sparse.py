"""Sparse top-k pseudo-gradients with 2-bit values and error feedback (`pseudo_grad_dtype: topk2`),
behind the same `average_` seam as comm.Averager and quant.QuantizedAverager. SparseLoCo's format
(Sarfi et al., arXiv 2508.15706, Sec. 3: chunked top-k, 2-bit values, error feedback), scaled to
what one bucket of DiLoCo sends.

Wire format of one flat FP32 bucket of n elements, cut into chunks of C = `topk_chunk` values (the last
one zero-padded), keeping k = round(topk_density * C) of each (`topk_count`), listed in the order of
their in-chunk positions:

    codes    ceil(k/4) bytes per chunk: four 2-bit codes per byte (first code in the low bits)
    indices  3 * ceil(k/2) bytes per chunk: the in-chunk positions, increasing, 12 bits each (C <= 4096),
             packed in pairs (a, b) as bytes a & 0xff, a >> 8 | (b & 0xf) << 4, b >> 4; an odd k pads one 0
    scales   2 bfloat16 per chunk: the low and the high level (lo, hi)

so payload_bytes(n) = chunks * (ceil(k/4) + 3 ceil(k/2) + 4): 116 bytes per 4,096 values at k = 64, 0.227
bits per parameter. A code is bit 0 = sign (1: negative), bit 1 = level (1: hi), decoding to -+lo, -+hi.

The kept values are the k largest magnitudes of the chunk, ties going to the lower position: a total
order, so every path keeps the same ones. The levels: the ceil(k/2) largest take the high level, the
rest the low one, and each level is the mean magnitude of the values it stands for, summed in one fixed
order (`tree_sum`). That is the least-squares level of each half (Lloyd's condition), and it keeps each
half's L1 mass: the errors of one level sum to zero (up to the bfloat16 rounding of the level), so the
code is unbiased on average over a chunk, though not per element. Error feedback carries the rest. (A
chunk with fewer than k non-zero values, as the zero padding of a bucket's last one, sends some zeros at
the low level: the padding's are dropped on decoding, a real zero's error is carried.)

On CPU the encoding runs in diloco.quant_kernel's fused `topk_encode` (one pass to add the carry, a
sampled threshold, a few passes over the chunk in L1: about the memory-bandwidth floor,
results/bench/quant.json); elsewhere in the torch ops of `encode_`. Both give the same bytes and carry
bit for bit (tests/sync/test_sparse.py).

Averaging: payloads do not sum, so every worker all-gathers them and each decodes all W payloads, adds
them in FP32 in rank order and divides by W: every worker computes the same operations on the same bytes,
so all get the same mean bit for bit. Each worker hands one payload to the all-gather (what `comm/bytes`
counts; the network carries it to W-1 peers).

With `topk_normalize: median` (SparseLoCo, Sec. 3, as the authors' code does it) each worker's decoded
contribution to each parameter tensor is clipped to the median over workers of their norms for that
tensor before the sum: weight min(1, median_j ||sent_j,t|| / (||sent_r,t|| + 1e-8)) per worker r and
tensor t (the lower median for an even W). A large contribution is scaled down; a small one keeps weight
1 (it is never scaled up). The weights come from the gathered bytes, so they too are the same on every
worker. Off by default. Error feedback still carries against what the worker itself sent, unscaled. (A
tensor that the flat fragment layout cuts across fragments is clipped per piece.) Before issue 55 the
weight was median / norm, unclipped, per bucket: a worker at a tenth of the others' scale was scaled up
ten times.

Where this departs from the authors' code (SparseLoCo's records say so): its 2-bit values are two levels
per chunk of 4,096 consecutive values of a flat bucket (sign and the mean magnitude of the larger and the
smaller half of the kept values, bfloat16), where the authors quantize to 4 bins around the mean with a
per-tensor table and chunk each tensor into 64x64 tiles.

Error feedback (EF-SGD, Karimireddy et al. 2019), always on: carry <- (beta carry + pseudo_grad) -
decoded(own payload). The carry is one zero-padded FP32 bucket per worker, checkpointed, so resume stays
exact. With beta = 1 (`topk_ef_decay`, the default) nothing is lost over rounds: what was sent + the final
carry = the sum of the inputs. SparseLoCo (Sec. 3) decays it, beta = 0.95, and drops the outer momentum:
the decayed carry stands in for it (outer_momentum 0).
"""

from __future__ import annotations

import torch

from diloco import quant_kernel
from diloco.comm import CastStats, Collective

TOPK_DTYPE = "topk2"
NORMALIZE = ("none", "median")  # topk_normalize: SparseLoCo's median-norm normalisation, or none
MAX_CHUNK = 4096  # in-chunk indices are 12 bits
MEDIAN_EPS = 1e-8  # topk_normalize median: the authors' epsilon under a contribution's norm


def topk_count(density: float, chunk: int) -> int:
    """k, the values kept per chunk: round(density * chunk) (at least 1 for any valid config)."""
    return max(1, round(density * chunk))


def num_chunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


def chunk_payload_bytes(k: int) -> int:
    """Codes, indices and the two bfloat16 levels of one chunk (module docstring)."""
    return -(-k // 4) + 3 * -(-k // 2) + 4


def payload_bytes(n: int, chunk: int, k: int) -> int:
    return num_chunks(n, chunk) * chunk_payload_bytes(k)


# --------------------------------------------------------------------------- bit packing


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[chunks, k] values in 0..3 -> uint8 [chunks, ceil(k/4)], four per byte, first in the low bits."""
    pad = (-codes.shape[1]) % 4
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, pad)).view(codes.shape[0], -1, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_codes(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [chunks, ceil(k/4)] -> uint8 [chunks, k]."""
    parts = [(packed >> shift) & 3 for shift in (0, 2, 4, 6)]
    return torch.stack(parts, dim=2).view(packed.shape[0], -1)[:, :k]


def pack_indices(idx: torch.Tensor) -> torch.Tensor:
    """int64 [chunks, k] in [0, 4096) -> uint8 [chunks, 3 ceil(k/2)], 12 bits each (module docstring)."""
    pad = idx.shape[1] % 2
    i = torch.nn.functional.pad(idx, (0, pad)).view(idx.shape[0], -1, 2)
    a, b = i[..., 0], i[..., 1]
    packed = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=2)
    return packed.to(torch.uint8).view(idx.shape[0], -1)


def unpack_indices(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [chunks, 3 ceil(k/2)] -> int64 [chunks, k]."""
    p = packed.view(packed.shape[0], -1, 3).long()
    a = p[..., 0] | ((p[..., 1] & 0xF) << 8)
    b = (p[..., 1] >> 4) | (p[..., 2] << 4)
    return torch.stack([a, b], dim=2).view(packed.shape[0], -1)[:, :k]


def _sections(payload: torch.Tensor, chunks: int, k: int) -> tuple[torch.Tensor, ...]:
    """A payload's codes [chunks, ceil(k/4)], indices [chunks, 3 ceil(k/2)], scale bytes [chunks, 4]."""
    cb, ib = chunks * -(-k // 4), chunks * 3 * -(-k // 2)
    codes = payload[:cb].view(chunks, -1)
    indices = payload[cb : cb + ib].view(chunks, -1)
    return codes, indices, payload[cb + ib :].view(chunks, 4)


# --------------------------------------------------------------------------- encode, decode


def tree_sum(m: torch.Tensor) -> torch.Tensor:
    """[chunks, w] -> [chunks]: each row summed pairwise, zero-padded to a power of two. One fixed order of
    float additions, so the C kernel (diloco.quant_kernel) and any device give the same bits."""
    w = m.shape[1]
    m = torch.nn.functional.pad(m, (0, (1 << (w - 1).bit_length()) - w))
    while m.shape[1] > 1:
        m = m[:, 0::2] + m[:, 1::2]
    return m[:, 0]


def levels(magnitudes: torch.Tensor, is_hi: torch.Tensor) -> torch.Tensor:
    """[chunks, k] magnitudes and whether each is one of the ceil(k/2) largest -> bfloat16 [chunks, 2]:
    (lo, hi), each the mean of its half (lo is 0 when k = 1), summed by tree_sum over all k in order with
    the other half's entries as zeros."""
    k = magnitudes.shape[1]
    h = -(-k // 2)
    zero = torch.zeros((), device=magnitudes.device)
    hi = tree_sum(torch.where(is_hi, magnitudes, zero)) / h
    lo = tree_sum(torch.where(is_hi, zero, magnitudes)) / (k - h) if k > h else torch.zeros_like(hi)
    return torch.stack([lo, hi], dim=1).to(torch.bfloat16)


def values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 codes [chunks, k] and bfloat16 (lo, hi) [chunks, 2] -> the FP32 values [chunks, k]."""
    magnitude = scales.float().gather(1, (codes >> 1).long())
    return torch.where((codes & 1).bool(), -magnitude, magnitude)


def select(y: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """y [chunks, C] -> the k of each chunk largest in magnitude (ties: the lower index first), in the
    order of their indices: (indices int64 [chunks, k], their values FP32, their codes uint8, the chunk's
    levels bfloat16 [chunks, 2]). The order is total, so every path keeps the same ones: a magnitude's
    bits order as the magnitudes do, and the low 12 bits of a key rank the lower index higher."""
    low = MAX_CHUNK - 1
    bits = y.abs().view(torch.int32).long()  # non-negative (NaN above inf)
    keys, _ = ((bits << 12) | (low - torch.arange(y.shape[1], device=y.device))).topk(k, dim=1)
    idx, rank = (low - (keys & low)).sort(dim=1)  # rank: the place in descending order of magnitude
    is_hi = rank < -(-k // 2)  # the larger half: hi
    magnitudes = (keys >> 12).to(torch.int32).view(torch.float32).gather(1, rank)
    kept = y.gather(1, idx)
    codes = (kept < 0).to(torch.uint8) | (is_hi.to(torch.uint8) << 1)
    return idx, kept, codes, levels(magnitudes, is_hi)


def encode_(
    y: torch.Tensor,
    k: int,
    n: int,
    out: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    decay: float = 1.0,
):
    """y <- y * decay + add (FP32 [chunks, C]: n values, then zero padding; add: FP32 [n] or None), then
    the payload of y, and y <- y - decoded, what the payload loses (error feedback's carry; the padding
    stays zero). Returns (payload uint8 [payload_bytes], (||y||^2, ||y - sent||^2, #non-zero values sent
    as zero) over the n values), as quant.encode does. On CPU the fused kernel (diloco.quant_kernel),
    elsewhere these torch ops: the same bits either way (the float64 sums up to their order)."""
    chunks, chunk = y.shape
    if out is None:
        out = torch.empty(chunks * chunk_payload_bytes(k), dtype=torch.uint8, device=y.device)
    codes_out, indices_out, scales_out = _sections(out, chunks, k)
    if y.dtype == torch.float32 and quant_kernel.usable(y, add, out):
        return out, quant_kernel.topk_encode(y, add, decay, n, k, codes_out, indices_out, scales_out)
    flat = y.view(-1)
    if decay != 1:
        y.mul_(decay)
    if add is not None:
        flat[:n].add_(add)
    nonzero = torch.count_nonzero(flat[:n])
    sq_norm = flat[:n].double().square().sum()  # a metric
    idx, kept, codes, scales = select(y, k)
    sent = values(codes, scales)
    y.scatter_(1, idx, kept - sent)  # the rest of y was not sent at all
    flat[n:].zero_()  # a kept zero of the padding decodes to the low level: not carried
    sq_err = flat[:n].double().square().sum()
    real = idx + torch.arange(chunks, device=y.device)[:, None] * chunk < n
    under = nonzero - ((kept != 0) & (sent != 0) & real).sum()
    codes_out.copy_(pack_codes(codes))
    indices_out.copy_(pack_indices(idx))
    scales_out.copy_(scales.view(torch.uint8))
    sq_norm, sq_err, under = torch.stack([sq_norm, sq_err, under.double()]).tolist()
    return out, (sq_norm, sq_err, int(under))


def unpack(payload: torch.Tensor, chunks: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A payload's in-chunk indices (int64 [chunks, k]) and values (FP32 [chunks, k])."""
    codes, indices, scale_bytes = _sections(payload, chunks, k)
    scales = scale_bytes.clone().view(torch.bfloat16)  # clone: 2-byte aligned
    return unpack_indices(indices, k), values(unpack_codes(codes, k), scales)


def _sizes(sizes: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.long, device=device)


def _segment_norms(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """FP32 [len(sizes)]: the L2 norm of each consecutive segment of x (a bucket's tensors)."""
    return torch.stack([torch.linalg.vector_norm(part) for part in x.split(sizes)])


def decode_add_(
    payload: torch.Tensor, chunk: int, k: int, out: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """out (FP32 [chunks * chunk], zero-padded like the encoded bucket) += the decoded payload (times
    `weight`, an FP32 scalar, if given)."""
    chunks = out.numel() // chunk
    idx, vals = unpack(payload, chunks, k)
    if weight is not None:
        vals = vals * weight
    out.view(chunks, chunk).scatter_add_(1, idx, vals)  # indices unique per chunk
    return out


def decode(payload: torch.Tensor, n: int, chunk: int, k: int) -> torch.Tensor:
    """uint8 [payload_bytes(n)] -> FP32 [n]: the kept values at their levels, zero elsewhere."""
    out = torch.zeros(num_chunks(n, chunk) * chunk, device=payload.device)
    return decode_add_(payload, chunk, k, out)[:n]


def encode(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """The payload of FP32 [n] x without error feedback (x is not modified)."""
    n = x.numel()
    y = torch.zeros(num_chunks(n, chunk) * chunk, device=x.device)
    y[:n].copy_(x)
    payload, _ = encode_(y.view(-1, chunk), k, n)
    return payload


# --------------------------------------------------------------------------- averaging


class TopKAverager:
    """Mean over the members of `coll` of flat FP32 buckets sent as top-k 2-bit payloads with error
    feedback (module docstring). `key` names a bucket, for its carry."""

    def __init__(
        self,
        coll: Collective,
        density: float = 1 / 64,
        chunk: int = MAX_CHUNK,
        error_feedback: bool = True,
        normalize: str = "none",
        decay: float = 1.0,
    ):
        if not 1 <= chunk <= MAX_CHUNK:
            raise ValueError(f"topk_chunk must be an integer in [1, {MAX_CHUNK}], got {chunk}")
        if not 0 < density <= 1:
            raise ValueError(f"topk_density must be in (0, 1], got {density}")
        if not error_feedback:
            raise ValueError("pseudo_grad_dtype topk2 needs error_feedback (it drops most of every round)")
        if normalize not in NORMALIZE:
            raise ValueError(f"topk_normalize must be one of {NORMALIZE}, got {normalize!r}")
        if not 0 < decay <= 1:
            raise ValueError(f"topk_ef_decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.coll, self.dtype, self.wire = coll, TOPK_DTYPE, torch.uint8
        self.chunk, self.k, self.normalize = chunk, topk_count(density, chunk), normalize
        self.residuals: dict[int, torch.Tensor] = {}  # this worker's carry, per bucket (zero-padded)
        self.cast = CastStats()

    def carry(self, key: int, n: int, device: torch.device) -> torch.Tensor:
        """The bucket's carry, FP32 [chunks * chunk] (zeros the first time)."""
        size = num_chunks(n, self.chunk) * self.chunk
        c = self.residuals.get(key)
        if c is None or c.numel() != size:
            c = self.residuals[key] = torch.zeros(size, device=device)
        return c

    def average_(self, flat: torch.Tensor, sizes: list[int], key: int = 0) -> torch.Tensor:
        """flat (FP32 [n]) <- the mean over all members of what each sends for it (module docstring)."""
        n = flat.numel()
        y = self.carry(key, n, flat.device).view(-1, self.chunk)
        # carry * decay + pseudo_grad (SparseLoCo: the decayed carry stands in for the outer momentum);
        # the encoding leaves what it did not send in the carry
        payload, (sq_norm, sq_err, under) = encode_(y, self.k, n, add=flat, decay=self.decay)
        c = self.cast
        c.sq_norm, c.sq_error, c.underflow = c.sq_norm + sq_norm, c.sq_error + sq_err, c.underflow + under
        c.numel += n
        gathered = self.coll.all_gather(payload, tag=f"pseudo_grad_{self.dtype}")  # [W, payload_bytes]
        total = torch.zeros(y.numel(), device=flat.device)
        if self.normalize == "median":
            weights = self.weights(gathered, n, sizes)  # [W, tensors]
            for row, weight in zip(gathered, weights):  # rank order, as below
                total[:n].add_(
                    decode(row, n, self.chunk, self.k).mul_(
                        weight.repeat_interleave(_sizes(sizes, weight.device))
                    )
                )
        else:
            for row in gathered:  # rank order: every member adds the same in the same order
                decode_add_(row, self.chunk, self.k, total)
        return flat.copy_(total[:n]).div_(self.coll.size)

    def weights(self, gathered: torch.Tensor, n: int, sizes: list[int]) -> torch.Tensor:
        """topk_normalize median: FP32 [W, tensors], worker r's weight for tensor t, min(1, median_j
        ||sent_j,t|| / (||sent_r,t|| + MEDIAN_EPS)) (the lower median for an even W)."""
        norms = torch.stack([_segment_norms(decode(row, n, self.chunk, self.k), sizes) for row in gathered])
        median = norms.median(dim=0).values  # [tensors]
        return (median / (norms + MEDIAN_EPS)).clamp_(max=1.0)

    def state_dict(self) -> dict:
        return {"residuals": {k: t.cpu() for k, t in self.residuals.items()}}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        saved = state.get("residuals", {})
        self.residuals = {int(k): t.to(device, copy=True) for k, t in saved.items()}

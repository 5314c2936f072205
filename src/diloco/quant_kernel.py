"""A fused CPU kernel for diloco.quant's blockwise int8/int4 codes: one pass over the pseudo-gradient
and the residual, block by block in L1 (add the residual, absmax, bfloat16 scale, codes, new residual,
error statistics), and one pass to decode (into a buffer or added to it).

Ours, not a library's, because it was measured: eager torch takes 11-22x the memory-bandwidth floor
(a dozen full passes) and torch.compile about 6x (its kernel copies the mutated residual through a
temporary); this C loop reaches the floor (results/bench/quant.json). It computes exactly what the
eager reference in diloco.quant computes (same operations in the same order, no fused multiply-add:
-ffp-contract=off), so the codes and residuals are bit for bit the same on either path
(tests/sync/test_quant.py); only the float64 error statistics are summed in another order.

Built once per machine with the C compiler (`cc`, as torch.utils.cpp_extension uses one) into
~/.cache/diloco (or $DILOCO_KERNEL_CACHE) and loaded with ctypes, which releases the GIL: the blocks are
split over torch.get_num_threads() threads. Without a compiler, or with DILOCO_QUANT_KERNEL=torch,
diloco.quant runs its eager torch code (the path GPU tensors always take).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = r"""
#include <stdint.h>
#include <string.h>

static uint16_t to_bf16(float f) {  /* round to nearest even, as c10::BFloat16 */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* GCC/Clang vector extensions: 8 floats at a time on any target, no intrinsics. */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
static inline vf vsel(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }

/* Blocks [b0, b1) of y = x + carry (carry may be NULL), n elements in all: codes and scales; residual
   (may be NULL, may alias carry) <- y - decoded; stats += {sum y^2, sum (y - decoded)^2, #(y != 0,
   decoded == 0)}. Padding past n counts as zeros. The codes of a block holding NaN or Inf are
   unspecified; its scale (NaN, Inf) makes it decode to NaN either way. */
void encode(const float *x, const float *carry, float *residual, int64_t n, int bits, int64_t block,
            int64_t b0, int64_t b1, uint8_t *codes, uint8_t *scales, double *stats) {
    const float qmax = (float)((1 << (bits - 1)) - 1), magic = 12582912.0f; /* 1.5 * 2^23 */
    const int64_t padded = (block + 7) / 8 * 8;
    vf y[padded / 8], e[padded / 8];
    vi qi[padded / 8];
    double s_sq = 0, s_se = 0, s_un = 0;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t i0 = b * block, m = n - i0 < block ? n - i0 : block;
        float *yf = (float *)y;
        if (carry)
            for (int64_t i = 0; i < m; i++) yf[i] = x[i0 + i] + carry[i0 + i];
        else
            memcpy(yf, x + i0, m * sizeof(float));
        for (int64_t i = m; i < padded; i++) yf[i] = 0.f;
        vf mx = {0};
        vi nan = {0};
        for (int64_t j = 0; j < padded / 8; j++) {
            const vf a = (vf)((vi)y[j] & 0x7fffffff);
            mx = vsel(a > mx, a, mx);
            nan |= a != a;
        }
        float amax = 0.f;
        int any_nan = 0;
        for (int l = 0; l < 8; l++) { amax = mx[l] > amax ? mx[l] : amax; any_nan |= nan[l]; }
        const uint16_t sb = any_nan ? 0x7fc0 : to_bf16(amax / qmax); /* NaN propagates, as torch.amax */
        const float s = from_bf16(sb), inv = s > 0.f ? 1.f / s : 1.f;
        memcpy(scales + 2 * b, &sb, 2); /* scales may be at an odd offset of the payload */
        vf sq = {0}, se = {0};
        vi un = {0};
        for (int64_t j = 0; j < padded / 8; j++) {
            vf t = y[j] * inv;
            t = vsel(t > -qmax, t, (vf){0} - qmax);
            t = vsel(t < qmax, t, (vf){0} + qmax);
            const vf r = t + magic; /* round half to even, as torch.round; the integer is in r's bits */
            const vf d = (r - magic) * s;
            qi[j] = (vi)r - 0x4B400000;
            e[j] = y[j] - d;
            sq += y[j] * y[j];
            se += e[j] * e[j];
            un -= (y[j] != 0.f) & (d == 0.f);
        }
        const int32_t *q = (const int32_t *)qi;
        if (bits == 8)
            for (int64_t i = 0; i < block; i++) codes[i0 + i] = (uint8_t)q[i];
        else
            for (int64_t i = 0; i < block / 2; i++)
                codes[i0 / 2 + i] = (uint8_t)(q[2 * i] + 8) | (uint8_t)((q[2 * i + 1] + 8) << 4);
        if (residual) memcpy(residual + i0, e, m * sizeof(float));
        for (int l = 0; l < 8; l++) { s_sq += sq[l]; s_se += se[l]; s_un += un[l]; }
    }
    stats[0] += s_sq; stats[1] += s_se; stats[2] += s_un;
}

/* Blocks [b0, b1) of a payload of n elements into out (out[i] = or += code * scale), i < count. */
void decode(const uint8_t *codes, const uint8_t *scales, float *out, int64_t count, int bits,
            int64_t block, int64_t b0, int64_t b1, int accumulate) {
    for (int64_t b = b0; b < b1; b++) {
        const int64_t i0 = b * block, m = count - i0 < block ? count - i0 : block;
        uint16_t sb;
        memcpy(&sb, scales + 2 * b, 2);
        const float s = from_bf16(sb);
        float d[block];
        if (bits == 8)
            for (int64_t i = 0; i < block; i++) d[i] = (float)(int8_t)codes[i0 + i] * s;
        else
            for (int64_t i = 0; i < block / 2; i++) {
                const uint8_t c = codes[i0 / 2 + i];
                d[2 * i] = (float)((int)(c & 15) - 8) * s;
                d[2 * i + 1] = (float)((int)(c >> 4) - 8) * s;
            }
        if (accumulate)
            for (int64_t i = 0; i < m; i++) out[i0 + i] += d[i];
        else
            memcpy(out + i0, d, m * sizeof(float));
    }
}
"""

FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
NATIVE = "-march=native"  # AVX2/AVX-512 where the CPU has them: 2-5x faster than the baseline ISA
_MIN_BLOCKS_PER_THREAD = 256
_lib: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable
_pool: ThreadPoolExecutor | None = None


def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (a shared cache directory
    across different machines then holds one build per kind of CPU)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "".join(sorted({line for line in info if line.startswith(("model name", "flags", "Features"))}))


def _compile(flags: list[str], so: Path) -> None:
    with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
        src, out = Path(tmp) / "quant_kernel.c", Path(tmp) / "quant_kernel.so"
        src.write_text(SOURCE)
        cmd = [os.environ.get("CC", "cc"), *flags, "-o", str(out), str(src)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(out, so)  # atomic: a concurrent build of the same source lands the same file


def _build() -> ctypes.CDLL:
    key = hashlib.sha256(f"{SOURCE}{FLAGS}{platform.machine()}{_cpu()}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("DILOCO_KERNEL_CACHE") or Path.home() / ".cache" / "diloco")
    so = cache / f"quant_kernel_{key}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        try:
            _compile([*FLAGS, NATIVE], so)
        except subprocess.CalledProcessError:  # a compiler without -march=native
            _compile(FLAGS, so)
    lib = ctypes.CDLL(str(so))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.encode.argtypes = [p, p, p, i64, ctypes.c_int, i64, i64, i64, p, p, p]
    lib.decode.argtypes = [p, p, p, i64, ctypes.c_int, i64, i64, i64, ctypes.c_int]
    lib.encode.restype = lib.decode.restype = None
    return lib


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, a failed build, or DILOCO_QUANT_KERNEL=torch)."""
    global _lib
    if os.environ.get("DILOCO_QUANT_KERNEL", "c") == "torch":
        return None
    if _lib is None:
        try:
            _lib = _build()
        except Exception as e:  # no compiler, no writable cache, ...: the torch ops do the same
            log.warning("quantization runs in eager torch (no C kernel: %s)", str(e).splitlines()[0])
            _lib = False
    return _lib or None


def usable(*tensors: torch.Tensor | None) -> bool:
    """The kernel can take these: contiguous CPU tensors, float32 or uint8 (None: absent), and it is built."""
    ok = all(
        t is None
        or (t.device.type == "cpu" and t.is_contiguous() and t.dtype in (torch.float32, torch.uint8))
        for t in tensors
    )
    return ok and kernel() is not None


def _ranges(blocks: int) -> list[tuple[int, int]]:
    t = max(1, min(torch.get_num_threads(), blocks // _MIN_BLOCKS_PER_THREAD))
    return [(blocks * i // t, blocks * (i + 1) // t) for i in range(t)]


def _run(calls) -> None:
    global _pool
    if len(calls) == 1:
        calls[0]()
        return
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="quant")
    for f in [_pool.submit(c) for c in calls]:
        f.result()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def encode(x, carry, residual, bits: int, block: int, codes, scales) -> tuple[float, float, int]:
    """codes/scales of y = x + carry; residual <- y - decoded (module docstring). Returns (sum y^2,
    sum of squared errors, #underflows)."""
    lib, n = kernel(), x.numel()
    ranges = _ranges(-(-n // block))
    stats = [(ctypes.c_double * 3)() for _ in ranges]
    args = (_ptr(x), _ptr(carry), _ptr(residual), n, bits, block)
    _run(
        [lambda r=r, s=s: lib.encode(*args, *r, _ptr(codes), _ptr(scales), s) for r, s in zip(ranges, stats)]
    )
    return sum(s[0] for s in stats), sum(s[1] for s in stats), int(sum(s[2] for s in stats))


def decode(codes, scales, out, bits: int, block: int, accumulate: bool) -> None:
    """out[:] (or +=) the first out.numel() elements the codes and scales decode to."""
    lib, count = kernel(), out.numel()
    ranges = _ranges(-(-count // block))
    args = (_ptr(codes), _ptr(scales), _ptr(out), count, bits, block)
    _run([lambda r=r: lib.decode(*args, *r, int(accumulate)) for r in ranges])

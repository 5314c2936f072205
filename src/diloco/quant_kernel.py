"""A fused CPU kernel for diloco.quant's blockwise int8/int4 codes: one pass over the pseudo-gradient
and the residual, block by block in L1 (add the residual, absmax, bfloat16 scale, codes, new residual,
error statistics), and one pass to decode (into a buffer or added to it).

Ours, not a library's, because it was measured: eager torch takes 11-22x the memory-bandwidth floor
(a dozen full passes) and torch.compile about 6x (its kernel copies the mutated residual through a
temporary); this C loop reaches the floor (results/bench/quant.json). It computes exactly what the
eager reference in diloco.quant computes (same operations in the same order, no fused multiply-add:
-ffp-contract=off), so the codes and residuals are bit for bit the same on either path
(tests/sync/test_quant.py); only the float64 error statistics are summed in another order.

And diloco.sparse's topk2 encoding (`topk_encode`), fused the same way: per chunk of up to 4,096 values,
carry * decay + pseudo-gradient in one vectorized pass, a threshold from a strided sample of 256 keeps
about 2k candidates (packed with AVX-512 or AVX2 compress where the CPU has them), the k-th and
ceil(k/2)-th largest found bit by bit by counting (no sort, no branch on the data), then the levels,
codes and the carry left behind. Eager torch takes 13x the bandwidth floor for it (topk, gather, scatter
and norms over the whole bucket). The kept set is defined by a total order (ties to the lower index) and
the level sums by one fixed order, so here too the bytes and the carry equal the torch ops' bit for bit
(tests/sync/test_sparse.py, on the native, AVX2 and portable builds).

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

/* ---- topk2 (diloco.sparse): the k largest magnitudes of each chunk, 2-bit values, error feedback ---- */

/* The r-th largest of key[0, m) (keys below 2^31, 1 <= r <= m): bit by bit from the top, the largest t
   with at least r keys >= t. Counts only: no branch on the data, and it vectorizes. */
static uint32_t nth_key(const uint32_t *key, int64_t m, int64_t r) {
    int32_t t = 0;
    for (int bit = 30; bit >= 0; bit--) {
        const int32_t trial = t | (int32_t)1 << bit;
        int32_t count = 0;
        for (int64_t i = 0; i < m; i++) count += (int32_t)key[i] >= trial;
        if (count >= r) t = trial;
    }
    return (uint32_t)t;
}

static int64_t count_above(const uint32_t *key, int64_t m, uint32_t t) {
    int32_t count = 0;
    for (int64_t i = 0; i < m; i++) count += key[i] > t;
    return count;
}

/* The sum of m[0, w) where sel[i] == want (the others as zeros), added pairwise over w zero-padded to a
   power of two, as diloco.sparse.levels; then divided by count. t: scratch for 2w values. */
static float tree_mean(const float *m, const uint8_t *sel, uint8_t want, int64_t w, int64_t count, float *t) {
    int64_t p = 1;
    while (p < w) p *= 2;
    for (int64_t i = 0; i < p; i++) t[i] = i < w && sel[i] == want ? m[i] : 0.f;
    for (; p > 1; p /= 2)
        for (int64_t i = 0; i < p / 2; i++) t[i] = t[2 * i] + t[2 * i + 1];
    return t[0] / (float)count;
}

static inline uint32_t key_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u & 0x7fffffffu; }

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
static int32_t lut[256][8]; /* lut[mask]: the lanes set in mask, in order */

__attribute__((constructor)) static void fill_lut(void) { /* at load time, before any thread runs */
    for (int mask = 0; mask < 256; mask++)
        for (int l = 0, o = 0; l < 8; l++)
            if (mask >> l & 1) lut[mask][o++] = l;
}
#endif

/* Every i < chunk whose key is >= t, in order: its key into key[], i into at[] (room for chunk + 16
   each); returns how many. Packed 16 (AVX-512) or 8 (AVX2) at a time where the CPU can. */
static int64_t candidates(const float *v, int64_t chunk, uint32_t t, uint32_t *key, uint32_t *at) {
    int64_t m = 0, i = 0;
#if defined(__AVX512F__)
    const __m512i tv = _mm512_set1_epi32((int)t), absmask = _mm512_set1_epi32(0x7fffffff);
    __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= chunk; i += 16) {
        const __m512i kv = _mm512_and_si512(_mm512_loadu_si512(v + i), absmask);
        const __mmask16 keep = _mm512_cmpge_epi32_mask(kv, tv); /* keys and t are below 2^31 */
        _mm512_mask_compressstoreu_epi32(key + m, keep, kv);
        _mm512_mask_compressstoreu_epi32(at + m, keep, iota);
        iota = _mm512_add_epi32(iota, _mm512_set1_epi32(16));
        m += __builtin_popcount(keep);
    }
#elif defined(__AVX2__)
    const __m256i tv = _mm256_set1_epi32((int)t), absmask = _mm256_set1_epi32(0x7fffffff);
    for (; i + 8 <= chunk; i += 8) {
        const __m256i kv = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(v + i)), absmask);
        const __m256i ge = _mm256_cmpgt_epi32(kv, _mm256_sub_epi32(tv, _mm256_set1_epi32(1)));
        const int keep = _mm256_movemask_ps(_mm256_castsi256_ps(ge)); /* key > t - 1 */
        const __m256i perm = _mm256_loadu_si256((const __m256i *)lut[keep]);
        _mm256_storeu_si256((__m256i *)(key + m), _mm256_permutevar8x32_epi32(kv, perm));
        _mm256_storeu_si256((__m256i *)(at + m), _mm256_add_epi32(perm, _mm256_set1_epi32((int)i)));
        m += __builtin_popcount(keep);
    }
#endif
    for (; i < chunk; i++) {
        key[m] = key_of(v[i]);
        at[m] = (uint32_t)i;
        m += key[m] >= t;
    }
    return m;
}

/* The k largest of v[0, chunk) by magnitude (key = |v| as bits, ties to the lower index), in the order of
   their indices: idx[0, k), their magnitudes and hi[j] = 1 for the ceil(k/2) largest. A threshold, the
   r-th largest of a strided sample of at most 256, keeps about 2k candidates (fewer than k, and r
   doubles; past the sample, every value); nth_key finds the k-th and the ceil(k/2)-th largest key among
   them, and of the keys equal to one, the lower indices come first. key: scratch for chunk + 16 values,
   at: for 256 + chunk + 16 (the sample's keys, then the candidates' indices). */
static void select_top(const float *v, int64_t chunk, int64_t k, uint32_t *key, uint32_t *at, int64_t *idx,
                       float *mag, uint8_t *hi) {
    const int64_t stride = (chunk + 255) / 256, s = chunk / stride, h = (k + 1) / 2; /* s <= 256 */
    for (int64_t j = 0; j < s; j++) at[j] = key_of(v[j * stride]);
    int64_t m = 0;
    for (int64_t r = 2 * k * s / chunk + 3; m < k; r *= 2)
        m = candidates(v, chunk, r < s ? nth_key(at, s, r) : 0, key, at + s);
    const uint32_t kk = nth_key(key, m, k), kh = nth_key(key, m, h);
    int64_t ties_k = k - count_above(key, m, kk), ties_h = h - count_above(key, m, kh);
    for (int64_t i = 0, j = 0; i < m; i++) {
        int keep = key[i] > kk, up = key[i] > kh;
        if (key[i] == kk && ties_k > 0) { keep = 1; ties_k--; }
        if (key[i] == kh && ties_h > 0) { up = 1; ties_h--; }
        memcpy(mag + j, key + i, 4); /* room for k + 1: j moves on only when kept */
        idx[j] = at[s + i];
        hi[j] = (uint8_t)up;
        j += keep;
    }
}

/* v[0, chunk) <- v * decay + x (x may be NULL; only the first m take x); returns sum v^2 over the first
   m (float lanes: a metric) and adds their non-zeros to *nz. 8 at a time where the chunk is whole. */
static double scale_add(float *v, const float *x, float decay, int64_t chunk, int64_t m, int64_t *nz) {
    if (x && m == chunk && chunk % 8 == 0) {
        vf sq = {0};
        vi cnt = {0};
        for (int64_t i = 0; i < chunk; i += 8) {
            vf a, b;
            memcpy(&a, v + i, 32);
            memcpy(&b, x + i, 32);
            a = a * decay + b;
            memcpy(v + i, &a, 32);
            sq += a * a;
            cnt -= a != 0.f;
        }
        double s = 0;
        for (int l = 0; l < 8; l++) { s += sq[l]; *nz += cnt[l]; }
        return s;
    }
    double s = 0;
    for (int64_t i = 0; i < chunk; i++) {
        v[i] = v[i] * decay;
        if (x && i < m) v[i] = v[i] + x[i];
        if (i < m) { s += (double)v[i] * v[i]; *nz += v[i] != 0.f; }
    }
    return s;
}

static double sum_sq(const float *v, int64_t m) {
    vf acc = {0};
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) { vf a; memcpy(&a, v + i, 32); acc += a * a; }
    double s = 0;
    for (int l = 0; l < 8; l++) s += acc[l];
    for (; i < m; i++) s += (double)v[i] * v[i];
    return s;
}

/* Chunks [c0, c1) of y (FP32, chunk values each; n real values in all, then zero padding): y <- y * decay
   + x (x: the n values, or NULL), then the chunk's payload (codes, indices, scales: diloco.sparse's
   format) and y <- y - decoded, the padding zeroed. stats += {sum y^2, sum (y - decoded)^2, #(y != 0,
   decoded == 0)} over the n real values. */
void topk_encode(float *y, const float *x, float decay, int64_t n, int64_t chunk, int64_t k, int64_t c0,
                 int64_t c1, uint8_t *codes, uint8_t *indices, uint8_t *scales, double *stats) {
    const int64_t h = (k + 1) / 2, cb = (k + 3) / 4, ib = 3 * ((k + 1) / 2);
    uint32_t key[chunk + 16], at[256 + chunk + 16];
    float mag[k + 1], t[2 * k];
    int64_t idx[k + 1];
    uint8_t code[k + 4], hi[k + 1];
    double s_sq = 0, s_se = 0;
    int64_t s_un = 0;
    for (int64_t c = c0; c < c1; c++) {
        float *v = y + c * chunk;
        const int64_t i0 = c * chunk, m = n - i0 < chunk ? (n - i0 > 0 ? n - i0 : 0) : chunk;
        s_sq += scale_add(v, x ? x + i0 : NULL, decay, chunk, m, &s_un);
        select_top(v, chunk, k, key, at, idx, mag, hi);
        const uint16_t up = to_bf16(tree_mean(mag, hi, 1, k, h, t));
        const uint16_t lo = k > h ? to_bf16(tree_mean(mag, hi, 0, k, k - h, t)) : 0;
        const float lv[2] = {from_bf16(lo), from_bf16(up)};
        for (int64_t j = 0; j < k; j++) {
            const float kept = v[idx[j]];
            const int neg = kept < 0.f, is_hi = hi[j];
            const float sent = neg ? -lv[is_hi] : lv[is_hi];
            code[j] = (uint8_t)(neg | is_hi << 1);
            v[idx[j]] = kept - sent;
            s_un -= kept != 0.f && sent != 0.f && idx[j] < m;
        }
        for (int64_t i = m; i < chunk; i++) v[i] = 0.f;
        for (int64_t j = k; j < k + 4; j++) code[j] = 0;
        idx[k] = 0;
        uint8_t *co = codes + c * cb, *io = indices + c * ib;
        for (int64_t b = 0; b < cb; b++)
            co[b] = code[4 * b] | code[4 * b + 1] << 2 | code[4 * b + 2] << 4 | code[4 * b + 3] << 6;
        for (int64_t p = 0; p < ib / 3; p++) {
            const int64_t a = idx[2 * p], b = idx[2 * p + 1];
            io[3 * p] = (uint8_t)(a & 0xff);
            io[3 * p + 1] = (uint8_t)(a >> 8 | (b & 0xf) << 4);
            io[3 * p + 2] = (uint8_t)(b >> 4);
        }
        memcpy(scales + 4 * c, &lo, 2);
        memcpy(scales + 4 * c + 2, &up, 2);
        s_se += sum_sq(v, m);
    }
    stats[0] += s_sq; stats[1] += s_se; stats[2] += (double)s_un;
}
"""

FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
NATIVE = "-march=native"  # AVX2/AVX-512 where the CPU has them: 2-5x faster than the baseline ISA
ISAS = {"native": [NATIVE], "avx2": ["-mavx2", "-mno-avx512f"], "portable": []}  # build(isa)'s paths, by name
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


def cpu_runs(isa: str) -> bool:
    """Whether this CPU runs the build for ISAS[isa]: the native and portable ones always do."""
    return isa != "avx2" or "avx2" in _cpu()


def _compile(flags: list[str], so: Path) -> None:
    with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
        src, out = Path(tmp) / "quant_kernel.c", Path(tmp) / "quant_kernel.so"
        src.write_text(SOURCE)
        cmd = [os.environ.get("CC", "cc"), *flags, "-o", str(out), str(src)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(out, so)  # atomic: a concurrent build of the same source lands the same file


def build(isa: list[str] | None = None) -> ctypes.CDLL:
    """The kernel compiled for this CPU (-march=native, else the compiler's default target), or for the
    instruction sets `isa` names (ISAS["avx2"], ISAS["portable"]), cached per source, flags and CPU. A
    compiler that refuses `isa` raises CalledProcessError."""
    flags = [*FLAGS, *(isa if isa is not None else [NATIVE])]
    key = hashlib.sha256(f"{SOURCE}{flags}{platform.machine()}{_cpu()}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("DILOCO_KERNEL_CACHE") or Path.home() / ".cache" / "diloco")
    so = cache / f"quant_kernel_{key}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        try:
            _compile(flags, so)
        except subprocess.CalledProcessError:
            if isa is not None:
                raise
            _compile(FLAGS, so)  # a compiler without -march=native
    lib = ctypes.CDLL(str(so))
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.encode.argtypes = [p, p, p, i64, ctypes.c_int, i64, i64, i64, p, p, p]
    lib.decode.argtypes = [p, p, p, i64, ctypes.c_int, i64, i64, i64, ctypes.c_int]
    lib.topk_encode.argtypes = [p, p, f32, i64, i64, i64, i64, i64, p, p, p, p]
    lib.encode.restype = lib.decode.restype = lib.topk_encode.restype = None
    return lib


def kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, a failed build, or DILOCO_QUANT_KERNEL=torch)."""
    global _lib
    if os.environ.get("DILOCO_QUANT_KERNEL", "c") == "torch":
        return None
    if _lib is None:
        try:
            _lib = build()
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


def _with_stats(fn, blocks: int) -> tuple[float, float, int]:
    """fn(b0, b1, stats) over `blocks` split across threads, each adding (sum y^2, sum of squared errors,
    #underflows) into its own stats; their totals."""
    ranges = _ranges(blocks)
    stats = [(ctypes.c_double * 3)() for _ in ranges]
    _run([lambda r=r, s=s: fn(*r, s) for r, s in zip(ranges, stats)])
    return sum(s[0] for s in stats), sum(s[1] for s in stats), int(sum(s[2] for s in stats))


def encode(x, carry, residual, bits: int, block: int, codes, scales) -> tuple[float, float, int]:
    """codes/scales of y = x + carry; residual <- y - decoded (module docstring). Returns (sum y^2,
    sum of squared errors, #underflows)."""
    lib, n = kernel(), x.numel()
    args = (_ptr(x), _ptr(carry), _ptr(residual), n, bits, block)
    return _with_stats(
        lambda b0, b1, s: lib.encode(*args, b0, b1, _ptr(codes), _ptr(scales), s), -(-n // block)
    )


def decode(codes, scales, out, bits: int, block: int, accumulate: bool) -> None:
    """out[:] (or +=) the first out.numel() elements the codes and scales decode to."""
    lib, count = kernel(), out.numel()
    ranges = _ranges(-(-count // block))
    args = (_ptr(codes), _ptr(scales), _ptr(out), count, bits, block)
    _run([lambda r=r: lib.decode(*args, *r, int(accumulate)) for r in ranges])


def topk_encode(y, x, decay: float, n: int, k: int, codes, indices, scales) -> tuple[float, float, int]:
    """diloco.sparse.encode_ on y (FP32 [chunks, chunk]): y <- y * decay + x (x: FP32 [n] or None), the
    payload's codes, indices and scales, y <- what the payload lost. Returns (sum y^2, sum of squared
    errors, #underflows) over the n real values."""
    lib, (chunks, chunk) = kernel(), y.shape
    args = (_ptr(y), _ptr(x), decay, n, chunk, k)
    outs = (_ptr(codes), _ptr(indices), _ptr(scales))
    return _with_stats(lambda b0, b1, s: lib.topk_encode(*args, b0, b1, *outs, s), chunks)

"""diloco.quant_kernel's C under AddressSanitizer and UndefinedBehaviorSanitizer: a small C program runs
every entry point (int8/int4 encode and decode, topk2 encode) over awkward sizes (tail blocks and chunks,
a bucket smaller than k, k = 1, k = C, chunks of 257-511 values where every value is a candidate, odd
scale offsets) on each instruction-set path the compiler can build here, and must finish clean. The
equivalence tests (test_quant.py, test_sparse.py) prove the values; this proves no read or write
leaves its buffer, which a wrong value would not always show."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from diloco import quant_kernel

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include "kernel.c"

static float *randoms(int64_t n, int zeros_every) {
    float *x = malloc((n ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = i % zeros_every ? rand() / (float)RAND_MAX - 0.5f : 0.f;
    return x;
}

static void topk_case(int64_t n, int64_t chunk, int64_t k) {
    const int64_t chunks = (n + chunk - 1) / chunk;
    float *y = calloc(chunks * chunk, sizeof(float)), *x = randoms(n, 7);
    uint8_t *codes = malloc(chunks * ((k + 3) / 4)), *idx = malloc(chunks * 3 * ((k + 1) / 2));
    uint8_t *scales = malloc(chunks * 4);
    double stats[3] = {0};
    for (int r = 0; r < 3; r++) topk_encode(y, x, 0.95f, n, chunk, k, 0, chunks, codes, idx, scales, stats);
    free(y); free(x); free(codes); free(idx); free(scales);
}

static void quant_case(int64_t n, int bits, int64_t block) {
    const int64_t blocks = (n + block - 1) / block;
    float *x = randoms(n, 5), *carry = randoms(n, 3), *out = calloc(n ? n : 1, sizeof(float));
    uint8_t *codes = malloc(blocks * block * bits / 8 + 1), *scales = malloc(2 * blocks + 1);
    double stats[3] = {0};
    encode(x, carry, carry, n, bits, block, 0, blocks, codes, scales + 1, stats); /* odd scale offset */
    decode(codes, scales + 1, out, n, bits, block, 0, blocks, 1);
    free(x); free(carry); free(out); free(codes); free(scales);
}

int main(void) {
    const int64_t topk[][3] = {{70001, 4096, 64}, {7, 4096, 64}, {50, 16, 5}, {3000, 1000, 250},
                               {500, 100, 100}, {5000, 4096, 1}, {10000, 520, 33}, {3000, 300, 200},
                               {5000, 511, 511}, {4096, 4096, 4096}, {100, 1, 1}, {10, 3, 3}};
    for (size_t c = 0; c < sizeof topk / sizeof topk[0]; c++) topk_case(topk[c][0], topk[c][1], topk[c][2]);
    const int64_t quant[][3] = {{1, 8, 2}, {255, 4, 2}, {513, 8, 6}, {1000, 4, 256}, {70001, 8, 256}};
    for (size_t c = 0; c < sizeof quant / sizeof quant[0]; c++) quant_case(quant[c][0], quant[c][1], quant[c][2]);
    puts("clean");
    return 0;
}
"""

SANITIZE = [
    "-O1",
    "-g",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
]


@pytest.mark.parametrize("isa", list(quant_kernel.ISAS))
def test_the_kernels_stay_inside_their_buffers_under_address_sanitizer(tmp_path, isa):
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip("no C compiler here: the kernel is not built either")
    if not quant_kernel.cpu_runs(isa):
        pytest.skip("no AVX2 on this CPU")
    (tmp_path / "kernel.c").write_text(quant_kernel.SOURCE)
    (tmp_path / "harness.c").write_text(HARNESS)
    exe = tmp_path / "harness"
    flags = [f for f in quant_kernel.FLAGS if f not in ("-shared", "-fPIC", "-O3")]
    cmd = [cc, *SANITIZE, *flags, *quant_kernel.ISAS[isa], "-o", str(exe), str(tmp_path / "harness.c")]
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if built.returncode != 0:
        pytest.skip(
            f"this compiler cannot build the {isa} path with sanitizers: {built.stderr.strip()[-200:]}"
        )
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and ran.stdout.strip() == "clean", ran.stderr[-3000:]

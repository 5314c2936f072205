"""Top-k 2-bit pseudo-gradients (diloco.sparse, `pseudo_grad_dtype: topk2`): a payload worked out by hand,
the kept set and levels against a by-hand selection, the C kernel against the torch ops bit for bit (on
each instruction-set path the compiler can build here), the bytes on the wire, every worker getting the same
mean bit for bit, error feedback losing nothing, exact resume, and bad settings as one line. (The carry's
round trip through DiLoCo's state dict is test_quant's, parametrized over int4 and topk2.)"""

from __future__ import annotations

import subprocess

import pytest
import torch
from test_comm import run_threads
from test_diloco import TinyModel, diloco_for
from trainer_utils import compose_cfg, read_metrics, resumed_equals_uninterrupted

from diloco import quant_kernel
from diloco.comm import SoloCollective
from diloco.config import ConfigError, validate
from diloco.sparse import TopKAverager, decode, encode, encode_, num_chunks, payload_bytes, topk_count


def test_a_tiny_vector_encodes_to_the_bytes_worked_out_by_hand():
    """Chunks of 4, k = 2. Chunk 0 [0.5, -3, 0.1, 2] keeps -3 (hi: 3) and 2 (lo: 2); chunk 1
    [-0.2, 1, 0, -0.05] keeps 1 (hi: 1) and -0.2 (lo: bfloat16(0.2) = 0.2002). Codes (bit 0 sign,
    bit 1 hi) in the order of the indices: 3, 0 and 1, 2; indices (1, 3) and (0, 1) in 12 bits each."""
    x = torch.tensor([0.5, -3.0, 0.1, 2.0, -0.2, 1.0, 0.0, -0.05])
    payload = encode(x, chunk=4, k=2)
    codes = [3 | 0 << 2, 1 | 2 << 2]
    indices = [1, 0 | 3 << 4, 0, 0, 0 | 1 << 4, 0]
    scales = [0x00, 0x40, 0x40, 0x40, 0x4D, 0x3E, 0x80, 0x3F]  # bf16 2.0, 3.0, 0.2002, 1.0 (little end)
    assert payload.tolist() == codes + indices + scales
    assert payload.numel() == payload_bytes(8, 4, 2) == 2 * (1 + 3 + 4)
    lo = torch.tensor(0.2).to(torch.bfloat16).float().item()
    assert decode(payload, 8, 4, 2).tolist() == [0.0, -3.0, 0.0, 2.0, -lo, 1.0, 0.0, 0.0]


def _by_hand(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """Per chunk (the last one zero-padded): the k largest magnitudes, the larger ceil(k/2) at the mean
    of theirs, the rest at the mean of theirs (each rounded to bfloat16), with their signs."""
    n = x.numel()
    x = torch.cat([x, torch.zeros(num_chunks(n, chunk) * chunk - n)])
    out = torch.zeros_like(x)
    h = -(-k // 2)
    for lo in range(0, x.numel(), chunk):
        part = x[lo : lo + chunk]
        order = sorted(range(part.numel()), key=lambda i: -abs(float(part[i])))[:k]
        mags = part[order].abs()
        hi_level = mags[:h].mean().to(torch.bfloat16).float()
        lo_level = mags[h:].mean().to(torch.bfloat16).float() if k > h else torch.tensor(0.0)
        for rank, i in enumerate(order):
            out[lo + i] = torch.copysign(hi_level if rank < h else lo_level, part[i])
    return out[:n]


@pytest.mark.parametrize("n,chunk,k", [(50, 16, 5), (1000, 64, 4), (9000, 4096, 64), (7, 4096, 64)])
def test_decoding_gives_the_top_k_of_every_chunk_at_its_two_levels(n, chunk, k):
    """An odd k (packing pads), a tail chunk, a bucket smaller than k (the padding's zeros are kept)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    payload = encode(x, chunk, k)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(n, chunk, k)
    assert torch.equal(decode(payload, n, chunk, k), _by_hand(x, chunk, k))


def _kernel_for(isa: str, monkeypatch) -> None:
    """Make diloco.sparse use the C kernel built for `isa` (skip where this compiler or CPU cannot)."""
    if quant_kernel.kernel() is None:
        pytest.skip("no C compiler here: only the torch path exists")
    if not quant_kernel.cpu_runs(isa):
        pytest.skip("no AVX2 on this CPU")
    try:
        monkeypatch.setattr(quant_kernel, "_lib", quant_kernel.build(quant_kernel.ISAS[isa]))
    except subprocess.CalledProcessError:
        pytest.skip(f"the compiler cannot build the {isa} path here")


def _encode_both(monkeypatch, isa, y0, x, k, decay):
    """encode_ of a copy of y0 (FP32 [chunks, C]) with x added, through the C kernel for `isa` and then
    through the torch ops: [(payload, carry left, stats)] for each."""
    _kernel_for(isa, monkeypatch)
    n, out = x.numel(), []
    for path in ("c", "torch"):
        monkeypatch.setenv("DILOCO_QUANT_KERNEL", path)
        assert quant_kernel.usable(y0) == (path == "c")
        y = y0.clone()
        payload, stats = encode_(y, k, n, add=x, decay=decay)
        out.append((payload, y, stats))
    return out


@pytest.mark.parametrize("isa", list(quant_kernel.ISAS))
@pytest.mark.parametrize(
    "n,chunk,k,decay",
    [
        (70_001, 4096, 64, 1.0),
        (9000, 4096, 64, 0.95),
        (50, 16, 5, 1.0),
        (7, 4096, 64, 1.0),
        (3000, 1000, 250, 0.9),
        (500, 100, 100, 1.0),
        (5000, 4096, 1, 1.0),
        (10_000, 520, 33, 1.0),
        (2000, 300, 10, 1.0),
        (5000, 511, 8, 1.0),
        (3000, 300, 200, 1.0),
    ],
)
def test_the_cpu_kernel_encodes_the_same_bits_as_the_torch_ops(monkeypatch, isa, n, chunk, k, decay):
    """Payload and carry bit for bit, the float64 statistics to round-off. Covers ties (zeros, a repeated
    value: the lower index wins on both paths), all-zero chunks, a tail chunk, a bucket smaller than k,
    k = 1, k = C, an odd k, a chunk not a multiple of 8 or 16 (and between 256 and 512: a sample of every
    value), and the SparseLoCo decay."""
    gen = torch.Generator().manual_seed(n + k)
    y0 = torch.zeros(num_chunks(n, chunk) * chunk)
    y0[:n] = torch.randn(n, generator=gen) * 1e-3
    x = torch.randn(n, generator=gen)
    x[::7], y0[:n:7] = 0.0, 0.0
    x[1::13], y0[1:n:13] = 0.5, 0.0
    x[: min(n, 2 * chunk)] = 0.0  # an all-zero first chunk where the carry is zero
    y0[: min(n, chunk)] = 0.0
    (p_c, y_c, s_c), (p_t, y_t, s_t) = _encode_both(monkeypatch, isa, y0.view(-1, chunk), x, k, decay)
    assert torch.equal(p_c, p_t)
    assert torch.equal(y_c, y_t)
    assert s_c[2] == s_t[2]
    assert s_c[:2] == pytest.approx(s_t[:2], rel=1e-5)


def test_averaging_with_the_cpu_kernel_equals_the_torch_ops_over_rounds(monkeypatch):
    """Three workers, error feedback with SparseLoCo's decay and median normalisation, four rounds: the
    same means and carries bit for bit on both paths."""
    _kernel_for("native", monkeypatch)

    def run():
        def worker(r, coll):
            avg = TopKAverager(coll, density=1 / 16, chunk=256, normalize="median", decay=0.95)
            gen = torch.Generator().manual_seed(40 + r)
            outs = [avg.average_(torch.randn(3000, generator=gen) * 1e-2, [3000]) for _ in range(4)]
            return outs + [avg.residuals[0]]

        return run_threads(3, worker)

    fast = run()
    monkeypatch.setenv("DILOCO_QUANT_KERNEL", "torch")
    ref = run()
    for worker_fast, worker_ref in zip(fast, ref):
        for a, b in zip(worker_fast, worker_ref):
            assert torch.equal(a, b)


def test_bits_per_parameter_follow_the_formula_and_stay_under_half_a_bit():
    k = topk_count(1 / 64, 4096)
    assert k == 64 and payload_bytes(4096, 4096, k) == 16 + 96 + 4
    for n in (262_464, 14_000_000, 4096 * 1000):
        bits = 8 * payload_bytes(n, 4096, k) / n
        assert bits == 8 * num_chunks(n, 4096) * 116 / n < 0.5
    assert 8 * payload_bytes(4096 * 1000, 4096, k) / (4096 * 1000) == pytest.approx(0.2266, abs=1e-4)


class Recording:
    """A collective that keeps what every all-gather returned (the payloads of all workers)."""

    def __init__(self, coll):
        self.coll, self.size, self.rank, self.gathered = coll, coll.size, coll.rank, []

    def all_gather(self, t, tag="other"):
        out = self.coll.all_gather(t, tag=tag)
        self.gathered.append(out.clone())
        return out


def test_four_workers_get_the_same_mean_bit_for_bit_the_mean_of_the_decoded_payloads():
    w, n, chunk, k, rounds = 4, 3000, 256, 8, 3

    def worker(r, coll):
        rec = Recording(coll)
        avg = TopKAverager(rec, density=k / chunk, chunk=chunk)
        gen = torch.Generator().manual_seed(r)
        outs = [avg.average_(torch.randn(n, generator=gen) * 1e-2, [1000, 2000]) for _ in range(rounds)]
        return outs, rec.gathered, coll.sent

    results = run_threads(w, worker)
    for outs, gathered, sent in results:
        for t, (out, rows) in enumerate(zip(outs, gathered)):
            assert torch.equal(out, results[0][0][t])  # bit for bit on every worker
            reference = sum(decode(row, n, chunk, k) for row in rows) / w  # rank order
            assert torch.equal(out, reference)
        assert sent == {"pseudo_grad_topk2": rounds * payload_bytes(n, chunk, k)}


def test_median_normalisation_clips_each_tensor_to_the_median_norm_as_the_authors_do():
    """SparseLoCo's median norm as the authors' code applies it, by hand on the decoded payloads: per
    parameter tensor t, worker r's contribution times min(1, median_j ||sent_j,t|| / (||sent_r,t|| +
    1e-8)), the lower median for an even W. Worker r's first tensor is 10^r times larger, its second
    10^-r times: the large ones are scaled down, the small ones never up (worker 1's second tensor, a
    tenth of worker 0's, keeps weight 1; the rule before issue 55, median / norm per bucket, scaled such
    a contribution up)."""
    w, sizes, chunk, k = 4, [1200, 800], 256, 8
    n = sum(sizes)

    def worker(r, coll):
        rec = Recording(coll)
        avg = TopKAverager(rec, density=k / chunk, chunk=chunk, normalize="median")
        x = torch.randn(n, generator=torch.Generator().manual_seed(r))
        x[: sizes[0]] *= 10.0**r
        x[sizes[0] :] *= 10.0**-r
        return avg.average_(x, sizes), rec.gathered[0]

    results = run_threads(w, worker)
    decoded = [decode(row, n, chunk, k) for row in results[0][1]]
    reference, weights = torch.zeros(n), []
    for lo, hi in [(0, sizes[0]), (sizes[0], n)]:
        norms = [float(torch.linalg.vector_norm(d[lo:hi])) for d in decoded]
        median = sorted(norms)[(w - 1) // 2]
        weights.append([min(1.0, median / (norm + 1e-8)) for norm in norms])
        for d, weight in zip(decoded, weights[-1]):
            reference[lo:hi] += d[lo:hi] * weight
    reference /= w
    one = pytest.approx([1.0, 1.0], rel=1e-6)  # the median's own: median / (median + 1e-8)
    assert weights[0][:2] == one and weights[0][3] < 0.02  # the 1000x worker is clipped
    assert weights[1][2:] == one and weights[1][0] < 0.02  # the small ones keep weight 1
    for out, _ in results:
        assert torch.equal(out, results[0][0])  # the same on every worker
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-9)


def test_error_feedback_loses_nothing_over_rounds():
    """Sum over rounds of what one worker sent (its own decoded payload) + its final carry == the sum
    of its pseudo-gradients; the carry's padding stays zero."""
    n, chunk, k = 1000, 128, 4

    def worker(r, coll):
        rec = Recording(coll)
        avg = TopKAverager(rec, density=k / chunk, chunk=chunk)
        gen = torch.Generator().manual_seed(30 + r)
        fed, sent = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        for _ in range(6):
            g = torch.randn(n, generator=gen) * 1e-2
            fed += g.double()
            avg.average_(g.clone(), [n])
            sent += decode(rec.gathered[-1][r], n, chunk, k).double()
        carry = avg.residuals[0]
        assert carry.numel() == num_chunks(n, chunk) * chunk and not carry[n:].any()
        return fed, sent + carry[:n].double()

    for fed, accounted in run_threads(2, worker):
        torch.testing.assert_close(accounted, fed, rtol=0, atol=1e-6)


def test_error_feedback_delivers_a_constant_pseudo_gradient_over_rounds():
    """A constant input at density 1/16: one round loses most of it, but the carry stays bounded (a few
    times the input), so the mean of what arrived over T rounds tends to it (error ~ 1/T)."""
    g = torch.randn(512, generator=torch.Generator().manual_seed(3)) * 1e-3
    avg = TopKAverager(SoloCollective(), density=1 / 16, chunk=256)
    arrived, errors = torch.zeros(512), {}
    for t in range(1, 257):
        arrived += avg.average_(g.clone(), [512])
        errors[t] = float((arrived / t - g).norm() / g.norm())
    assert errors[1] > 0.5
    assert errors[256] < errors[64] / 2 and errors[256] < 0.05


def test_diloco_workers_end_with_bit_identical_global_weights_and_log_bits_per_param():
    w, chunk, k = 4, 8, 2  # TinyModel: 23 parameters in 3 chunks of 8
    models = [TinyModel() for _ in range(w)]
    gens = [torch.Generator().manual_seed(i) for i in range(w)]
    moves = [[torch.randn(p.shape, generator=g) * 0.1 for p in m.parameters()] for g, m in zip(gens, models)]

    def worker(i, coll):
        opts = dict(pseudo_grad_dtype="topk2", topk_density=k / chunk, topk_chunk=chunk)
        algo, _ = diloco_for(models[i], coll, **opts)
        metrics = []
        for _ in range(3):
            with torch.no_grad():
                for p, d in zip(models[i].parameters(), moves[i]):
                    p.sub_(d)
            metrics.append(algo.outer_step())
        return [t.clone() for t in algo.global_params], metrics

    results = run_threads(w, worker)
    for params, metrics in results:
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0]))
        for m in metrics:
            assert m["comm/bytes_topk2"] == m["comm/bytes"] == payload_bytes(23, chunk, k)
            assert m["comm/bits_per_param"] == 8 * payload_bytes(23, chunk, k) / 23
            assert 0 < m["comm/cast_rel_error"] < 1


def test_resumed_topk2_run_equals_uninterrupted_bit_for_bit(tmp_path, stop=3):
    """Stopped mid-round (H=2) and resumed: the carry comes back from the checkpoint."""
    opts = ["distributed=diloco", "distributed.cosine_sample_size=0", "distributed.inner_steps=2"]
    opts += ["distributed.pseudo_grad_dtype=topk2", "distributed.topk_chunk=1024"]
    sf = resumed_equals_uninterrupted(tmp_path, opts, stop)
    residuals = sf["averager"]["residuals"]
    assert residuals and all(t.abs().sum() > 0 for t in residuals.values())
    rounds = [r for r in read_metrics(tmp_path / "full") if "outer/round" in r]
    assert rounds and all(0 < r["comm/cast_rel_error"] < 1 for r in rounds)
    assert all(r["comm/bytes_topk2"] == r["comm/bytes"] for r in rounds)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["distributed.topk_density=0"], "topk_density must be a positive number"),
        (["distributed.topk_density=1.5"], r"topk_density must be in \(0, 1\]"),
        (["distributed.topk_chunk=0"], "topk_chunk must be an integer >= 1"),
        (["distributed.topk_chunk=5000"], "topk_chunk must be an integer >= 1 and < 4097"),
        (["distributed.topk_density=0.001", "distributed.topk_chunk=100"], "at least 1 value per chunk"),
        (["distributed.pseudo_grad_dtype=topk2", "distributed.error_feedback=false"], "cannot go with"),
        (["distributed.pseudo_grad_dtype=topk3"], "pseudo_grad_dtype must be .* int4 or topk2"),
        (["distributed.topk_normalize=mean"], "topk_normalize must be none or median"),
        (["distributed.topk_ef_decay=1.5"], r"topk_ef_decay must be in \(0, 1\]"),
        (["distributed.topk_ef_decay=0"], "topk_ef_decay must be a positive number"),
    ],
)
def test_bad_topk_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(compose_cfg(["distributed=diloco", *overrides]))
    assert "\n" not in str(err.value)


def test_topk2_turns_error_feedback_on_and_the_experiment_validates():
    c = validate(compose_cfg(["experiment=tiny/diloco_topk2"]))
    assert c.distributed.pseudo_grad_dtype == "topk2" and c.distributed.error_feedback is True
    assert c.distributed.topk_chunk == 4096 and topk_count(c.distributed.topk_density, 4096) == 64
    algo, _ = diloco_for(TinyModel(), SoloCollective(), pseudo_grad_dtype="topk2")  # error_feedback None
    assert isinstance(algo.averager, TopKAverager)


def test_a_decayed_carry_is_sparselocos_error_feedback():
    """topk_ef_decay beta: carry_t = beta carry_{t-1} + g_t - sent_t, sent_t = decode(encode(beta carry_{t-1}
    + g_t)), checked by hand over rounds; beta = 1 is today's error feedback bit for bit."""
    n, chunk, k, beta = 300, 64, 4, 0.95
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(n, generator=gen) * 1e-2 for _ in range(5)]
    decayed = TopKAverager(SoloCollective(), density=k / chunk, chunk=chunk, decay=beta)
    plain = TopKAverager(SoloCollective(), density=k / chunk, chunk=chunk, decay=1.0)
    default = TopKAverager(SoloCollective(), density=k / chunk, chunk=chunk)
    carry = torch.zeros(n)
    for g in inputs:
        v = beta * carry + g
        sent = decode(encode(v, chunk, k), n, chunk, k)
        torch.testing.assert_close(decayed.average_(g.clone(), [n]), sent, rtol=0, atol=0)
        carry = v - sent
        torch.testing.assert_close(decayed.residuals[0][:n], carry, rtol=1e-6, atol=1e-9)
        assert torch.equal(plain.average_(g.clone(), [n]), default.average_(g.clone(), [n]))
    with pytest.raises(ValueError, match="topk_ef_decay"):
        TopKAverager(SoloCollective(), decay=0.0)

"""Int8 / 4-bit pseudo-gradients: the codes against a by-hand quantizer, the mean every worker computes,
the bytes on the wire, error feedback losing nothing, and exact resume through the real trainer."""

from __future__ import annotations

import pytest
import torch
from test_comm import run_threads
from test_diloco import TinyModel, diloco_for
from trainer_utils import read_metrics, resumed_equals_uninterrupted

from diloco import quant_kernel
from diloco.quant import QuantizedAverager, dequantize, encode, payload_bytes, quantize


def _by_hand(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """What a worker sends for x, decoded: the nearest code of x * (1 / s) per block, s = absmax / qmax
    rounded to bfloat16 (the scale sent)."""
    qmax = 2 ** (bits - 1) - 1
    out = torch.empty_like(x)
    for lo in range(0, x.numel(), block):
        b = x[lo : lo + block]
        s = (b.abs().max() / qmax).to(torch.bfloat16).float()
        out[lo : lo + block] = (b * (1 / s)).round().clamp(-qmax, qmax) * s if s > 0 else 0.0
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1, 255, 256, 1000])
def test_codes_decode_to_the_by_hand_quantizer(bits, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
    x[n // 2] = 0.0
    payload = quantize(x, bits, 64)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(n, bits, 64)
    assert torch.equal(dequantize(payload, n, bits, 64), _by_hand(x, bits, 64))


def _both_paths(monkeypatch, fn):
    """fn() through the C kernel, then through the eager torch ops (diloco.quant_kernel)."""
    if quant_kernel.kernel() is None:
        pytest.skip("no C compiler here: only the torch path exists")
    fast = fn()
    monkeypatch.setenv("DILOCO_QUANT_KERNEL", "torch")
    assert not quant_kernel.usable(torch.zeros(1))
    return fast, fn()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,block", [(1, 2), (255, 2), (513, 6), (1000, 256), (70_001, 256)])
def test_the_cpu_kernel_computes_the_same_bits_as_the_torch_ops(monkeypatch, bits, n, block):
    """Codes, scales, residual and decoded values bit for bit; the float64 error sums to round-off.
    Covers a tail block, an odd scale offset (int4, block 2), an all-zero block, underflow to zero,
    and the residual written over the carry it reads."""
    gen = torch.Generator().manual_seed(n + bits)
    x = torch.randn(n, generator=gen) * 1e-3
    x[: min(n, block)] = 0.0
    x[min(n - 1, block) :: 97] = 1e-30
    carry0 = torch.randn(n, generator=gen) * 1e-5

    def run():
        carry, fresh = carry0.clone(), torch.empty(n)
        p1, s1 = encode(x, bits, block, carry, carry)  # residual in place of the carry
        p2, s2 = encode(x, bits, block, None, fresh)
        decoded, added = torch.empty(n), torch.ones(n - n // 3)
        dequantize(p1, n, bits, block, out=decoded)
        dequantize(p2, n, bits, block, out=added, accumulate=True)
        return (p1, p2, carry, fresh, decoded, added), (s1, s2)

    (fast, fast_sums), (ref, ref_sums) = _both_paths(monkeypatch, run)
    for a, b in zip(fast, ref):
        assert torch.equal(a, b)
    assert torch.equal(ref[4], dequantize(ref[0], n, bits, block))
    for a, b in zip(fast_sums, ref_sums):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-30)


def test_without_a_compiler_the_torch_ops_run_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(quant_kernel, "_lib", None)  # not tried yet
    monkeypatch.setenv("DILOCO_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    x = torch.randn(300, generator=torch.Generator().manual_seed(5))
    with caplog.at_level("WARNING"):
        payload, _ = encode(x, 8, 64)
        assert quant_kernel.kernel() is None
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["quantization runs in eager torch"]
    assert torch.equal(payload, quantize(x, 8, 64))
    assert list(tmp_path.iterdir()) == []  # nothing half-built left behind


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_averaging_with_the_cpu_kernel_equals_the_torch_ops_over_rounds(monkeypatch, dtype):
    """Three workers, error feedback at both quantizations, four rounds: the same means and residuals."""

    def run():
        def worker(r, coll):
            avg = QuantizedAverager(coll, dtype, block_size=64, error_feedback=True)
            gen = torch.Generator().manual_seed(40 + r)
            outs = [avg.average_(torch.randn(700, generator=gen) * 1e-2, [700]) for _ in range(4)]
            return outs + [avg.residuals[0], avg.mean_residuals[0], torch.tensor(avg.cast.sq_error)]

        return run_threads(3, worker)

    fast, ref = _both_paths(monkeypatch, run)
    for worker_fast, worker_ref in zip(fast, ref):
        for a, b in zip(worker_fast[:-1], worker_ref[:-1]):
            assert torch.equal(a, b)
        torch.testing.assert_close(worker_fast[-1], worker_ref[-1], rtol=1e-5, atol=0)


def test_bytes_per_element_are_a_quarter_and_an_eighth_of_float32_plus_scales():
    n = 1 << 20
    assert payload_bytes(n, 8, 256) / (4 * n) == pytest.approx(1 / 4 * (1 + 2 / 256))
    assert payload_bytes(n, 4, 256) / (4 * n) == pytest.approx(1 / 8 * (1 + 4 / 256))


@pytest.mark.parametrize("dtype,bits", [("int8", 8), ("int4", 4)])
def test_every_worker_gets_the_mean_of_what_was_sent_and_bytes_are_the_payload(dtype, bits):
    w, n = 3, 700
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(w)]

    def worker(r, coll):
        avg = QuantizedAverager(coll, dtype, block_size=128, error_feedback=False)
        out = avg.average_(xs[r].clone(), [300, 400])
        return out, coll.sent

    results = run_threads(w, worker)
    # two shots (quant.py): each worker's codes, summed in FP32 by the chunk's owner, the mean's codes;
    # 3 chunks of 256 (whole blocks of 128) cover the 700 values
    padded = [torch.cat([x, torch.zeros(3 * 256 - n)]) for x in xs]
    expected = _by_hand(sum(_by_hand(x, bits, 128) for x in padded) / w, bits, 128)[:n]
    for out, sent in results:
        assert torch.equal(out, results[0][0])  # bit for bit the same on every worker
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
        # one payload per worker: W-1 chunks to their owners, and its own chunk of the mean
        assert sent == {f"pseudo_grad_{dtype}": payload_bytes(3 * 256, bits, 128)}


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_error_feedback_loses_nothing_over_rounds(dtype):
    """Sum over rounds of what one worker sent + its final residual == sum of its pseudo-gradients."""

    def worker(r, coll):
        avg = QuantizedAverager(coll, dtype, block_size=64, error_feedback=True)
        gen = torch.Generator().manual_seed(10 + r)
        fed, sent = torch.zeros(500, dtype=torch.float64), torch.zeros(500, dtype=torch.float64)
        for _ in range(5):
            g = torch.randn(500, generator=gen) * 1e-2
            fed += g.double()
            before = avg.residuals.get(0, torch.zeros(512))[:500].clone()
            avg.average_(g.clone(), [500])
            sent += (g + before - avg.residuals[0][:500]).double()  # v - residual = what was quantized
        return fed, sent + avg.residuals[0][:500].double()

    for fed, accounted in run_threads(2, worker):
        torch.testing.assert_close(accounted, fed, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_what_arrives_plus_every_residual_is_the_mean_of_the_inputs(dtype):
    """Both quantizations feed back: over rounds, what every worker received + the owners' residuals of
    the mean + the mean of the workers' own residuals == the mean of the pseudo-gradients."""
    w, n, rounds = 3, 700, 4

    def worker(r, coll):
        avg = QuantizedAverager(coll, dtype, block_size=64, error_feedback=True)
        gen = torch.Generator().manual_seed(20 + r)
        fed, got = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        for _ in range(rounds):
            g = torch.randn(n, generator=gen) * 1e-2
            fed += g.double()
            got += avg.average_(g.clone(), [n]).double()
        own = coll.all_gather(avg.residuals[0]).double().mean(0)  # the workers' residuals, averaged
        mean = coll.all_gather(avg.mean_residuals[0]).double().view(-1)  # the owners' chunks, in order
        fed_mean = coll.all_gather(fed.float()).double().mean(0)
        return got + (own + mean)[:n], fed_mean

    for accounted, fed_mean in run_threads(w, worker):
        torch.testing.assert_close(accounted, fed_mean, rtol=0, atol=1e-6)


def test_error_feedback_makes_the_time_average_converge_to_the_float32_mean():
    """A constant pseudo-gradient: with error feedback the mean of what arrives over k rounds tends to
    the true value (error ~ 1/k); without it the same quantization error repeats every round."""
    g = torch.randn(256, generator=torch.Generator().manual_seed(3)) * 1e-3

    def arrived(ef: bool) -> float:
        def worker(r, coll):
            avg = QuantizedAverager(coll, "int4", block_size=256, error_feedback=ef)
            return sum(avg.average_(g.clone(), [256]) for _ in range(32)) / 32

        return float((run_threads(1, worker)[0] - g).norm() / g.norm())

    with_ef, without = arrived(True), arrived(False)
    assert with_ef < without / 8


@pytest.mark.parametrize(
    "opts",
    [
        dict(pseudo_grad_dtype="int4", quant_block_size=4),
        dict(pseudo_grad_dtype="topk2", topk_density=0.25, topk_chunk=8),  # diloco.sparse's carry
    ],
)
def test_residuals_round_trip_through_the_diloco_state_dict(tmp_path, opts):
    model = TinyModel()
    from diloco.comm import SoloCollective

    algo, opt = diloco_for(model, SoloCollective(), **opts)
    for step in range(1, 5):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        algo.after_inner_step(step)
    assert algo.averager.residuals and any(t.abs().sum() > 0 for t in algo.averager.residuals.values())
    torch.save(algo.state_dict(), tmp_path / "s.pt")
    other, _ = diloco_for(TinyModel(seed=1), SoloCollective(), **opts)
    other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert other.averager.residuals.keys() == algo.averager.residuals.keys()
    assert all(torch.equal(other.averager.residuals[k], t) for k, t in algo.averager.residuals.items())


def test_resumed_int4_run_equals_uninterrupted_bit_for_bit(tmp_path, stop=3):
    """Stopped mid-round (H=2) and resumed: the residuals come back from the checkpoint."""
    opts = ["distributed=diloco", "distributed.cosine_sample_size=0", "distributed.inner_steps=2"]
    opts += ["distributed.pseudo_grad_dtype=int4", "distributed.quant_block_size=64"]
    sf = resumed_equals_uninterrupted(tmp_path, opts, stop)
    residuals = sf["averager"]["residuals"]
    assert residuals and all(t.abs().sum() > 0 for t in residuals.values())
    # one worker: its mean is its own decoded codes, which quantize to themselves (nothing more lost)
    assert sf["averager"]["mean_residuals"].keys() == residuals.keys()
    rounds = [r for r in read_metrics(tmp_path / "full") if "outer/round" in r]
    assert all(0 < r["comm/cast_rel_error"] < 0.5 for r in rounds)
    assert all(r["comm/bytes_int4"] == r["comm/bytes"] for r in rounds)


@pytest.mark.parametrize(
    "override,message",
    [
        ("distributed.error_feedback=true", "error_feedback applies to pseudo_grad_dtype int8 or int4"),
        ("distributed.quant_block_size=7", "quant_block_size must be even"),
        ("distributed.quant_block_size=0", "quant_block_size"),
    ],
)
def test_bad_quantization_settings_are_one_line(override, message):
    from trainer_utils import compose_cfg

    from diloco.config import ConfigError, validate

    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(["distributed=diloco", override]))

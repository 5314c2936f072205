"""The averaging seam: in-process collectives, wire dtypes, byte counting and cast-error measurement."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from diloco.comm import Averager, CommError, InProcessGroup, mean_pairwise_cosine, power_of_two_scales


def run_threads(n: int, fn, timeout: float = 30.0):
    """fn(rank, collective) in n threads over one InProcessGroup; the results by rank."""
    group = InProcessGroup(n, timeout_seconds=timeout)
    out, errors = [None] * n, []

    def body(r):
        try:
            out[r] = fn(r, group.member(r))
        except BaseException as e:  # surfaced in the test thread below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    if errors:
        raise errors[0]
    return out


def test_in_process_collectives():
    def fn(r, coll):
        s = torch.tensor([1.0, float(r)])
        coll.all_reduce_(s)
        m = torch.tensor([float(r), -float(r)])
        coll.all_reduce_(m, op="max")
        b = torch.full((2,), float(r))
        coll.broadcast_(b, src=2)
        return s, m, coll.all_gather(torch.tensor([float(r)])), b, dict(coll.sent)

    for r, (s, m, g, b, sent) in enumerate(run_threads(3, fn)):
        assert s.tolist() == [3.0, 3.0] and m.tolist() == [2.0, 0.0]
        assert g.view(-1).tolist() == [0.0, 1.0, 2.0] and b.tolist() == [2.0, 2.0]
        assert sent["other"] == 8 + 8 + 4 + (8 if r == 2 else 0)  # a broadcast is sent by its source only


def test_in_process_timeout_is_a_comm_error():
    group = InProcessGroup(2, timeout_seconds=0.3)
    with pytest.raises(CommError, match="timed out"):
        group.member(0).all_reduce_(torch.ones(1))  # member 1 never comes


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_average_is_the_mean_and_bytes_are_the_payload(dtype):
    w, n = 3, 10_000
    data = [torch.randn(n, generator=torch.Generator().manual_seed(r)) * 1e-2 for r in range(w)]

    def fn(r, coll):
        avg = Averager(coll, dtype, fp16_scaling=True)
        x = data[r].clone()
        avg.average_(x, [4000, 6000])
        return x, dict(coll.sent)

    mean = (data[0] + data[1] + data[2]) / w
    tol = {"float32": 0.0, "float16": 1e-3, "bfloat16": 1e-2}[dtype]
    for x, sent in run_threads(w, fn):
        if dtype == "float32":
            assert torch.equal(x, mean)  # the same sum in the same order, then / W
        else:
            assert ((x - mean).norm() / mean.norm()).item() < tol
        size = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
        assert sent[f"pseudo_grad_{dtype}"] == n * size  # what went into the all-reduce
        assert sent.get("fp16_scales", 0) == (2 * 4 if dtype == "float16" else 0)  # one fp32 per tensor


def built_to_underflow(n: int = 4096) -> torch.Tensor:
    """Magnitudes from 1e-12 to 1e-6: mostly below FP16's smallest subnormal (6e-8)."""
    g = torch.Generator().manual_seed(0)
    return torch.logspace(-12, -6, n) * torch.sign(torch.randn(n, generator=g))


def test_scaled_fp16_loses_strictly_fewer_elements_to_underflow():
    x = built_to_underflow()
    scaled = Averager(_Solo(), "float16", fp16_scaling=True)
    unscaled = Averager(_Solo(), "float16", fp16_scaling=False)
    scaled.encode(x, [x.numel()])
    unscaled.encode(x, [x.numel()])
    assert unscaled.cast.underflow > x.numel() // 2  # the paper's plain cast flushes most of it to zero
    assert scaled.cast.underflow < unscaled.cast.underflow
    assert scaled.cast.underflow == 0
    assert scaled.cast.metrics()["comm/cast_rel_error"] < 2**-11
    assert unscaled.cast.metrics()["comm/cast_rel_error"] > 2**-11 * 10


def test_overflow_is_counted_and_scaling_prevents_it():
    x = torch.tensor([1e5, -2e5, 3.0, 0.0])
    unscaled = Averager(_Solo(), "float16", fp16_scaling=False)
    unscaled.encode(x, [4])
    assert unscaled.cast.overflow == 2  # saturated at +-65504
    scaled = Averager(_Solo(), "float16", fp16_scaling=True)
    wire, scales = scaled.encode(x, [4])
    assert scaled.cast.overflow == 0 and torch.isfinite(wire).all()
    back = scaled.decode_(torch.empty(4), wire, [4], scales)
    torch.testing.assert_close(back, x, rtol=2**-11, atol=0)  # FP16 rounding only


def test_scales_are_powers_of_two_and_leave_room_for_the_sum():
    absmax = torch.tensor([1e-9, 3.0, 65504.0, 0.0])
    s = power_of_two_scales(absmax, num_workers=8, dtype=torch.float16)
    assert torch.equal(torch.log2(s), torch.log2(s).round())
    assert (absmax * s * 8 <= 65504).all() and (absmax[:3] * s[:3] * 8 * 2 > 65504).all()
    assert s[3] == 1.0


def realistic_pseudo_gradient(inner_steps: int = 10) -> tuple[torch.Tensor, list[int]]:
    """theta_0 - theta_H of the micro Llama after H AdamW steps at the paper's lr (4e-4)."""
    from omegaconf import OmegaConf

    from diloco.model import build_model

    cfg = OmegaConf.load(Path(__file__).resolve().parents[2] / "configs" / "model" / "micro.yaml")
    model = build_model(cfg, seed=0)
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(inner_steps):
        ids = torch.randint(3, cfg.vocab_size, (2, 32), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return before - after, [p.numel() for p in model.parameters()]


def test_cast_error_on_realistic_pseudo_gradients_is_bounded():
    """FP16 keeps 11 significant bits: relative error <= 2^-11 per normal element, so the relative L2
    error must stay under 2^-11 when nothing underflows; BF16 (8 bits) under 2^-8."""
    x, sizes = realistic_pseudo_gradient()
    errors = {}
    for dtype, scaling in [("float16", True), ("float16", False), ("bfloat16", False)]:
        avg = Averager(_Solo(), dtype, fp16_scaling=scaling)
        avg.encode(x, sizes)
        errors[(dtype, scaling)] = m = avg.cast.metrics()
        assert m["comm/cast_overflow_frac"] == 0
    assert errors[("float16", True)]["comm/cast_rel_error"] < 2**-11
    assert errors[("float16", True)]["comm/cast_underflow_frac"] == 0
    assert errors[("float16", False)]["comm/cast_rel_error"] < 2**-10  # a few subnormals at most
    assert errors[("float16", False)]["comm/cast_underflow_frac"] < 1e-3
    assert errors[("bfloat16", False)]["comm/cast_rel_error"] < 2**-8
    print("cast error on realistic pseudo-gradients:", errors)


def test_mean_pairwise_cosine():
    g = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    expected = (0.0 + 2**-0.5 + 2**-0.5) / 3
    assert mean_pairwise_cosine(g @ g.T) == pytest.approx(expected)


class _Solo:
    """A one-member group that still counts, for encode-only checks."""

    size, rank = 1, 0

    def all_reduce_(self, t, op="sum", tag="other"):
        pass


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "int4"])
def test_the_mean_s_error_is_the_relative_l2_error_of_what_arrived(dtype):
    """comm/mean_rel_error: with every coordinate sampled, ||what every worker got - the float32 mean|| /
    ||the float32 mean||, over a round of two buckets; float32 only loses the sum's round-off."""
    from diloco.comm import Averager, RoundMeter, SoloCollective, sample_positions
    from diloco.quant import QuantizedAverager

    w, sizes = 3, [300, 200]
    xs = [
        [torch.randn(n, generator=torch.Generator().manual_seed(10 * r + b)) for b, n in enumerate(sizes)]
        for r in range(w)
    ]

    def worker(r, coll):
        avg = QuantizedAverager(coll, dtype, 64) if dtype.startswith("int") else Averager(coll, dtype, False)
        meter = RoundMeter(avg, SoloCollective(), sample_positions(sizes, 10**6, 0, "cpu"))
        meter.begin()
        arrived = []
        for b, n in enumerate(sizes):
            flat = xs[r][b].clone()
            meter.observe(b, flat)
            avg.average_(flat, [n], key=b)
            meter.observe_mean(b, flat)
            arrived.append(flat)
        return meter.finish("cpu")["mean_error"], torch.cat(arrived)

    exact = torch.cat([sum(x[b].double() for x in xs) / w for b in range(len(sizes))])
    for got, arrived in run_threads(w, worker):
        want = float((arrived.double() - exact).norm() / exact.norm())
        assert got == pytest.approx(want, rel=1e-9)
        assert got < {"float32": 1e-6, "float16": 1e-3, "int8": 2e-2, "int4": 0.3}[dtype]

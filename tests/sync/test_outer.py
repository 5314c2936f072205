"""The one outer optimizer: torch's SGD-Nesterov at period 1, delayed Nesterov by hand otherwise."""

import copy

import pytest
import torch

from diloco.outer import OuterOptimizer


def _tensors(seed, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 4, generator=g) for _ in range(n)]


def test_period_one_is_torch_sgd_nesterov():
    ours, ref = _tensors(0), _tensors(0)
    opt = OuterOptimizer(ours, lr=0.7, momentum=0.9)
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for t in range(4):
        grads = _tensors(100 + t)
        opt.step(grads)
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        sgd.step()
        for a, b in zip(ours, ref):  # fused or not: the same math up to float32 round-off
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_delayed_nesterov_follows_the_papers_rule_by_hand():
    """Liu et al. 2024 (arXiv 2401.09135), delayed Nesterov with buffer N, one delta at a time, in plain
    floats: each delta moves theta by lr * g / N; every N-th also refreshes m <- mu m + (sum of the N)/N
    and moves by lr * (g / N + mu m). (The HALoS authors' DelayedNesterovOptimizer with c = 0.)"""
    lr, mu, n = 0.5, 0.8, 3
    deltas = [1.0, -2.0, 0.5, 4.0, 1.5, -1.0, 3.0]
    theta, m, buf = 10.0, 0.0, 0.0
    for t, g in enumerate(deltas, start=1):
        buf += g
        if t % n == 0:
            m = mu * m + buf / n
            theta -= lr * (g / n + mu * m)
            buf = 0.0
        else:
            theta -= lr * g / n
    ours = [torch.tensor([10.0], dtype=torch.float64)]
    opt = OuterOptimizer(ours, lr=lr, momentum=mu, delay_period=n)
    for g in deltas:
        opt.step([torch.tensor([g], dtype=torch.float64)])
    assert ours[0].item() == pytest.approx(theta, rel=1e-12)
    # the numbers: 7 deltas, refreshes after the 3rd and 6th
    assert theta == pytest.approx(
        10.0
        - 0.5 * (1.0 - 2.0) / 3
        - 0.5 * (0.5 / 3 + 0.8 * (-0.5 / 3))
        - 0.5 * (4.0 + 1.5) / 3
        - 0.5 * (-1.0 / 3 + 0.8 * (0.8 * (-0.5 / 3) + 4.5 / 3))
        - 0.5 * 3.0 / 3
    )


@pytest.mark.parametrize("mu", [0.0, 0.9])
def test_n_single_deltas_are_one_nesterov_step_on_their_mean(mu):
    """The identity the rule exists for: N deltas one at a time move theta exactly as torch's
    SGD-Nesterov on their mean, period after period (with N=4 and no momentum, 1.00x the mean step; the
    rule before issue 55 moved 4.00x)."""
    n, lr = 4, 0.7
    ours, ref = _tensors(5), _tensors(5)
    start = [t.clone() for t in ours]
    opt = OuterOptimizer(ours, lr=lr, momentum=mu, delay_period=n)
    sgd = torch.optim.SGD(ref, lr=lr, momentum=mu, nesterov=mu > 0)
    for period in range(3):
        deltas = [_tensors(600 + 10 * period + i) for i in range(n)]
        for d in deltas:
            opt.step(d)
        for j, p in enumerate(ref):
            p.grad = sum(d[j] for d in deltas) / n
        sgd.step()
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        if period == 0:
            moved = sum(float((s - a).norm()) for s, a in zip(start, ours))
            mean_step = sum(float((lr * p.grad).norm()) for p in ref)
            assert moved == pytest.approx(mean_step, rel=1e-5) or mu > 0


def test_state_round_trip_resumes_exactly():
    a = _tensors(2)
    opt_a = OuterOptimizer(a, lr=0.7, momentum=0.9, delay_period=2)
    for t in range(3):
        opt_a.step(_tensors(300 + t))
    b_params = [t.clone() for t in a]
    opt_b = OuterOptimizer(b_params, lr=0.7, momentum=0.9, delay_period=2)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as through a checkpoint file
    for t in range(3, 6):
        g = _tensors(300 + t)
        opt_a.step(g)
        opt_b.step([x.clone() for x in g])
    for x, y in zip(a, b_params):
        assert torch.equal(x, y)


def test_delayed_nesterov_counts_deltas_not_steps():
    """A step that is the mean of n deltas counts n toward the period: rounds of 4 deltas with period 4
    refresh the momentum every round, i.e. torch's SGD-Nesterov on the round means (issue 12; before, the
    period counted steps, so the momentum refreshed every 4th round)."""
    ours, ref = _tensors(3), _tensors(3)
    opt = OuterOptimizer(ours, lr=0.5, momentum=0.8, delay_period=4)
    sgd = torch.optim.SGD(ref, lr=0.5, momentum=0.8, nesterov=True)
    for t in range(5):
        mean = _tensors(400 + t)
        opt.step(mean, deltas=4)
        for p, g in zip(ref, mean):
            p.grad = g.clone()
        sgd.step()
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_delayed_nesterov_refreshes_from_the_mean_per_delta_when_a_round_overshoots():
    lr, mu = 0.5, 0.8
    ours = _tensors(4, n=1)
    theta, g1, g2 = ours[0].clone(), _tensors(500, n=1)[0], _tensors(501, n=1)[0]
    opt = OuterOptimizer(ours, lr=lr, momentum=mu, delay_period=4)
    opt.step([g1], deltas=3)  # k = 3 < 4: three deltas' share of a step, 3/4
    opt.step([g2], deltas=3)  # k = 6 >= 4: m = (3 g1 + 3 g2) / 6
    m = (3 * g1 + 3 * g2) / 6
    want = theta - lr * 0.75 * g1 - lr * (0.75 * g2 + mu * m)
    torch.testing.assert_close(ours[0], want, rtol=1e-6, atol=1e-6)
    assert opt.delayed_sums()[1] == 0

"""The one outer optimizer: torch's SGD-Nesterov at period 1, delayed Nesterov by hand otherwise."""

import copy

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


def test_delayed_nesterov_follows_the_formula():
    lr, mu, period = 0.5, 0.8, 3
    ours = _tensors(1)
    theta = [t.clone() for t in ours]
    m = [torch.zeros_like(t) for t in ours]
    a = [torch.zeros_like(t) for t in ours]
    opt = OuterOptimizer(ours, lr=lr, momentum=mu, delay_period=period)
    for t in range(7):
        grads = _tensors(200 + t)
        opt.step(grads)
        k = t % period + 1
        for i, g in enumerate(grads):
            a[i] += g
            if k < period:
                theta[i] -= lr * g
            else:
                m[i] = mu * m[i] + a[i] / period
                theta[i] -= lr * (g + mu * m[i])
                a[i] = torch.zeros_like(g)
        for x, y in zip(ours, theta):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


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
    opt.step([g1], deltas=3)  # k = 3 < 4: plain SGD
    opt.step([g2], deltas=3)  # k = 6 >= 4: m = (3 g1 + 3 g2) / 6
    m = (3 * g1 + 3 * g2) / 6
    torch.testing.assert_close(ours[0], theta - lr * g1 - lr * (g2 + mu * m), rtol=1e-6, atol=1e-6)
    assert opt.delayed_sums()[1] == 0

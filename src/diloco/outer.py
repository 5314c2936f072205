"""The outer optimizer of DiLoCo (Douillard et al., arXiv 2311.08105, Algorithm 1, line 12), shared by
synchronous DiLoCo (diloco.py) and the DumbDiLoCo master (dumb_diloco/master/loop.py): the float32 global
weights are stepped in place by `torch.optim.SGD(nesterov=True)` with the averaged pseudo-gradient as
their gradient. The two strategies differ only in how that average is formed (a collective, a store).

`delay_period` N > 1 is delayed Nesterov (Liu et al., Asynchronous Local-SGD Training for Language
Modeling, arXiv 2401.09135, Sec. 3.2; as in the HALoS authors' public `DelayedNesterovOptimizer`, their
c = 0), for the asynchronous master. Each delta moves the weights by 1/N of a step; the momentum changes
only once N deltas have arrived since its last change, from their mean. For one delta g at a time:

    every delta:   a <- a + g,  k <- k + 1
    k < N:         theta <- theta - lr * g / N
    k = N:         m <- mu * m + a / N;  theta <- theta - lr * (g / N + mu * m);  a <- 0, k <- 0

so N single-delta steps move theta exactly as one synchronous Nesterov step on their mean (a test). A
step whose gradient g is the mean of n deltas (a quorum round) is those n deltas at once: a <- a + n g,
k <- k + n, and its plain part is lr * n g / N. A round that overshoots the period (k > N) refreshes
from the mean of its k deltas, a / k. With rounds of N deltas the momentum refreshes every round, as in
synchronous DiLoCo; with N = 1 this is exactly torch's SGD with nesterov=True (a test).

Before issue 55 each step moved theta by lr * g, whatever N: N single deltas moved it N times as far as
the paper's rule (records made before then say which rule they ran).
"""

from __future__ import annotations

import torch


class OuterOptimizer:
    def __init__(
        self,
        params: list[torch.Tensor],
        *,
        lr: float,
        momentum: float,
        nesterov: bool = True,
        delay_period: int = 1,
    ):
        if delay_period < 1:
            raise ValueError(f"delay_period must be >= 1, got {delay_period}")
        self.params = params  # float32 global weights, stepped in place
        self.lr, self.momentum, self.delay_period = lr, momentum, delay_period
        hyper = dict(lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)
        try:  # fused: one pass over weights, momentum and gradient, the same results, where supported
            self.sgd = torch.optim.SGD(params, **hyper, fused=True)
        except (RuntimeError, TypeError, ValueError):
            self.sgd = torch.optim.SGD(params, **hyper)
        self._sum: list[torch.Tensor | None] = [None] * len(params)  # delayed Nesterov's a
        self._count = 0  # delayed Nesterov's k

    @torch.no_grad()
    def step(self, pseudo_grads: list[torch.Tensor | None], deltas: int = 1) -> None:
        """theta <- theta - lr * nesterov(pseudo_grad), in place; None skips a tensor. `deltas`: how many
        pseudo-gradients `pseudo_grads` is the mean of (delayed Nesterov's period counts them)."""
        if self.delay_period == 1:
            for p, g in zip(self.params, pseudo_grads, strict=True):
                p.grad = g
            self.sgd.step()
            for p in self.params:
                p.grad = None
            return
        if deltas < 1:
            raise ValueError(f"deltas must be >= 1, got {deltas}")
        self._count += deltas
        for i, g in enumerate(pseudo_grads):
            if g is not None:
                self._sum[i] = g * deltas if self._sum[i] is None else self._sum[i].add_(g, alpha=deltas)
        share = deltas / self.delay_period  # each delta moves theta by 1/N of a step
        if self._count < self.delay_period:
            for p, g in zip(self.params, pseudo_grads, strict=True):
                if g is not None:
                    p.sub_(g, alpha=self.lr * share)
            return
        for i, (p, g) in enumerate(zip(self.params, pseudo_grads, strict=True)):
            if g is None:
                continue
            state = self.sgd.state[p]
            m = state.get("momentum_buffer")
            m = torch.zeros_like(g) if m is None else m
            state["momentum_buffer"] = m.mul_(self.momentum).add_(self._sum[i], alpha=1.0 / self._count)
            p.sub_(g * share + self.momentum * m, alpha=self.lr)
        self._sum = [None] * len(self.params)
        self._count = 0

    # ------------------------------------------------------------------- state (tensors by position)
    def momentum_buffers(self) -> list[torch.Tensor | None]:
        return [
            self.sgd.state[p].get("momentum_buffer") if p in self.sgd.state else None for p in self.params
        ]

    def delayed_sums(self) -> tuple[list[torch.Tensor | None], int]:
        return list(self._sum), self._count

    def load_buffers(
        self,
        momentum: list[torch.Tensor | None],
        sums: list[torch.Tensor | None] | None = None,
        count: int = 0,
    ) -> None:
        """Restore what `momentum_buffers()` / `delayed_sums()` returned (copies, on the params' devices)."""
        for p, m in zip(self.params, momentum, strict=True):
            if m is not None:
                self.sgd.state[p]["momentum_buffer"] = m.to(p.device, torch.float32, copy=True)
            else:
                self.sgd.state.pop(p, None)
        sums = sums if sums is not None else [None] * len(self.params)
        self._sum = [
            None if s is None else s.to(p.device, torch.float32, copy=True) for p, s in zip(self.params, sums)
        ]
        self._count = int(count)

    def state_dict(self) -> dict:
        """torch's SGD state dict (momentum by position), plus delayed Nesterov's running sum."""
        sums, count = self.delayed_sums()
        return {**self.sgd.state_dict(), "delayed_sums": sums, "delayed_count": count}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        sums = state.pop("delayed_sums", None)  # absent in checkpoints from before this class
        count = state.pop("delayed_count", 0)
        self.sgd.load_state_dict(state)
        sums = sums if sums is not None else [None] * len(self.params)
        self._sum = [
            None if s is None else s.to(p.device, torch.float32, copy=True) for p, s in zip(self.params, sums)
        ]
        self._count = int(count)

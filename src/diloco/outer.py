"""The outer optimizer of DiLoCo (Douillard et al., arXiv 2311.08105, Algorithm 1, line 12), shared by
synchronous DiLoCo (diloco.py) and the DumbDiLoCo master (dumb_diloco/master/loop.py): the float32 global
weights are stepped in place by `torch.optim.SGD(nesterov=True)` with the averaged pseudo-gradient as
their gradient. The two strategies differ only in how that average is formed (a collective, a store).

`delay_period > 1` is delayed Nesterov (Liu et al., Asynchronous Local-SGD, arXiv 2401.09135, Sec. 3.2),
for the asynchronous master: the momentum changes only once `delay_period` pseudo-gradients (deltas, not
outer steps) have arrived since its last change, from their mean; in between each step is plain SGD. A
step whose gradient g is the mean of n deltas (a quorum round) counts n:

    every step:      a <- a + n * g,  k <- k + n
    k < period:      theta <- theta - lr * g
    k >= period:     m <- mu * m + a / k;  theta <- theta - lr * (g + mu * m);  a <- 0, k <- 0

So with 4 nodes, rounds of 4 deltas and period 4 the momentum refreshes every round, as in synchronous
DiLoCo; with one delta per step, every 4th step (the paper's setting, period = number of workers).
With period 1 this is exactly torch's SGD with nesterov=True (a test).
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
        if self._count < self.delay_period:
            for p, g in zip(self.params, pseudo_grads, strict=True):
                if g is not None:
                    p.sub_(g, alpha=self.lr)
            return
        for i, (p, g) in enumerate(zip(self.params, pseudo_grads, strict=True)):
            if g is None:
                continue
            state = self.sgd.state[p]
            m = state.get("momentum_buffer")
            m = torch.zeros_like(g) if m is None else m
            state["momentum_buffer"] = m.mul_(self.momentum).add_(self._sum[i], alpha=1.0 / self._count)
            p.sub_(g + self.momentum * m, alpha=self.lr)
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

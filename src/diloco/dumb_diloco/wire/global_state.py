"""What the node and the master both hold of the global model: a version of it (`GlobalSnapshot`), the
layouts its files must have (`state_layout`, `delta_layout`) and a node's pseudo-gradient against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class GlobalSnapshot:
    """One version of the global model: the full state_dict in the model's dtypes (never mutated)."""

    outer_step: int
    state: dict[str, torch.Tensor]
    source: str = "repo"  # "repo" (downloaded) or "master" (this process's outer loop)
    num_peers: int = 0  # distinct nodes whose deltas made this version's round
    included: dict[str, int] = field(default_factory=dict)  # node -> newest local step of its applied deltas
    step_micros: dict[str, int] = field(
        default_factory=dict
    )  # node -> its busy microseconds per step, if sent


def is_delta_tensor(t: torch.Tensor) -> bool:
    """Floating and complex tensors take part in deltas; integer/bool buffers do not."""
    return t.is_floating_point() or t.is_complex()


def pseudo_gradient(
    baseline: dict[str, torch.Tensor], current: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """float32(baseline) - float32(current) for every floating/complex entry (DiLoCo's outer
    gradient). Complex entries go through `torch.view_as_real`, giving float32 of shape [..., 2]."""
    if set(baseline) != set(current):
        diff = sorted(set(baseline) ^ set(current))
        raise ValueError(f"baseline and current have different keys, e.g. {diff[:3]}")
    out: dict[str, torch.Tensor] = {}
    for name, base in baseline.items():
        cur = current[name]
        if not is_delta_tensor(base):
            continue
        if base.shape != cur.shape or base.is_complex() != cur.is_complex():
            raise ValueError(f"{name}: baseline {tuple(base.shape)} and current {tuple(cur.shape)} differ")
        if base.is_complex():
            base, cur = torch.view_as_real(base), torch.view_as_real(cur)
        out[name] = base.detach().to(torch.float32) - cur.detach().to(base.device, torch.float32)
    return out


def delta_layout(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected (shape, dtype) of every tensor of a node delta for a model with this state_dict."""
    return {
        name: ((*t.shape, 2) if t.is_complex() else tuple(t.shape), torch.float32)
        for name, t in state.items()
        if is_delta_tensor(t)
    }


def state_layout(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Expected (shape, dtype) of every tensor of the global file: the full state_dict as it is."""
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}

"""Small pieces shared by the DumbDiLoCo tests: a tiny model whose numbers can be followed by hand, a
transport wrapper that records and injects faults, and a fake clock."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import torch

from diloco.config import check_dumb_diloco
from diloco.dumb_diloco.master.loop import OuterConfig, OuterLoop
from diloco.dumb_diloco.master.recovery import MasterState
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import Settings
from diloco.dumb_diloco.store.base import Transport
from diloco.dumb_diloco.store.transport import DirectoryTransport, TransientError
from diloco.dumb_diloco.wire.repo_paths import GLOBAL_STEP_PATH, GLOBAL_WEIGHTS_PATH, delta_path
from diloco.dumb_diloco.wire.tensor_format import DeltaMeta, encode, parse_header

LR, MU = 0.7, 0.9  # the spec's outer optimizer
W0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # Tiny's initial weights
B0 = torch.tensor([0.5, -0.5])


def g(value: float) -> dict[str, torch.Tensor]:
    """A delta for Tiny with every entry equal to `value` (w [2,2], b [2])."""
    return {"w": torch.full((2, 2), value), "b": torch.full((2,), value)}


class Tiny(torch.nn.Module):
    """Two float parameters and an integer buffer (published in globals, never part of a delta);
    optionally a complex parameter (sent as float32 view_as_real) and a bfloat16 one."""

    def __init__(self, complex_param: bool = False, bf16: bool = False):
        super().__init__()
        self.w = torch.nn.Parameter(W0.clone())
        self.b = torch.nn.Parameter(B0.clone())
        self.register_buffer("count", torch.tensor([7], dtype=torch.int64))
        if complex_param:
            self.z = torch.nn.Parameter(torch.tensor([1 + 2j, -1 + 0.5j], dtype=torch.complex64))
        if bf16:
            self.h = torch.nn.Parameter(torch.tensor([0.1, 0.2, 0.3], dtype=torch.bfloat16))

    def forward(self, x):
        return x @ self.w.T + self.b


def nudge(model: torch.nn.Module, amount: float) -> None:
    """A stand-in for an optimizer step: move every floating parameter by `amount`."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amount)


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class Spy:
    """A Transport that records every call (with the calling thread) and can fail or block writes,
    and fail or hold revisions. A blocked write or a held revision waits for its event (60 s at most:
    only a failing test waits that long)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[str, str, str]] = []  # (operation, argument, thread name)
        self.fail_writes = 0
        self.fail_revisions = 0
        self.block_writes: threading.Event | None = None
        self.writes_started = threading.Event()
        # revision() waits while this event is unset: a poll or an outer round stops before it reads
        # the repository (a paused reader); `revisions_held` is set once a call waits there
        self.hold_revisions: threading.Event | None = None
        self.revisions_held = threading.Event()

    def _rec(self, op: str, arg: str = "") -> None:
        self.calls.append((op, arg, threading.current_thread().name))

    def count(self, op: str, arg: str | None = None) -> int:
        return sum(1 for o, a, _ in self.calls if o == op and (arg is None or a == arg))

    def revision(self):
        self._rec("revision")
        if self.hold_revisions is not None and not self.hold_revisions.is_set():
            self.revisions_held.set()
            self.hold_revisions.wait(60)
        if self.fail_revisions > 0:
            self.fail_revisions -= 1
            raise TransientError("injected: revision failed")
        return self.inner.revision()

    def list(self, prefix, revision=None):
        self._rec("list", prefix)
        return self.inner.list(prefix, revision)

    def read(self, path, revision=None, max_bytes=None):
        self._rec("read", path)
        return self.inner.read(path, revision, max_bytes)

    def read_header(self, path, revision=None, **kw):
        self._rec("read_header", path)
        return self.inner.read_header(path, revision, **kw)

    def write(self, files, delete=(), message="", parent_revision=None):
        self._rec("write", ",".join(files))
        self.writes_started.set()
        if self.block_writes is not None:
            self.block_writes.wait(60)
        if self.fail_writes > 0:
            self.fail_writes -= 1
            raise TransientError("injected: commit failed after retries")
        return self.inner.write(files, delete, message, parent_revision)

    def delete(self, paths):
        return self.inner.delete(paths)


def settings(repo: Path | str, role: str = "worker", node_id: str = "w1", **kw) -> Settings:
    """Test defaults: v1 (synchronous), H=3, fast timeouts."""
    base = dict(
        inner_steps=3,
        poll_interval=1.0,
        async_delta_upload=False,
        async_global_poll=False,
        startup_timeout=2.0,
        shutdown_timeout=5.0,
        state_dir=str(Path(repo).parent / "state"),
    )
    s = Settings(role=role, node_id=node_id, repo_id=str(repo), **(base | kw))
    check_dumb_diloco(s)  # Settings built directly are not checked; validate's checker is
    return s


def make_loop(
    repo: Path | Transport,
    state: MasterState | dict[str, torch.Tensor] | None = None,
    *,
    lr: float = LR,
    momentum: float = MU,
    node_id: str = "m",
    poll_interval: float = 1.0,
    state_dir: Path | None = None,
    max_file_bytes: int = 2**20,
    publish: bool = False,
    **kw,
) -> tuple[OuterLoop, Transport]:
    """A master's `OuterLoop` on `repo` (a transport, or a directory: a DirectoryTransport on <repo>/repo)
    over `state` (a MasterState, or a model's state dict at outer step 0; default Tiny's), with the spec's
    outer optimizer; `kw` goes to OuterConfig or OuterLoop, by name. `publish`: publish the global as a starting master does.
    Returns the loop and its transport."""
    transport = DirectoryTransport(repo / "repo") if isinstance(repo, Path) else repo
    if state is None or isinstance(state, dict):
        state = MasterState.from_model_state(Tiny().state_dict() if state is None else state)
    config_keys = {f.name for f in dataclasses.fields(OuterConfig)}
    config = OuterConfig(
        node_id,
        lr,
        momentum,
        poll_interval,
        max_file_bytes,
        **{k: v for k, v in kw.items() if k in config_keys},
    )
    rest = {k: v for k, v in kw.items() if k not in config_keys}
    loop = OuterLoop(transport, state, config, state_dir=state_dir, **rest)
    if publish:
        loop.publish()
    return loop, transport


def publish(transport, state: dict[str, torch.Tensor], outer_step: int) -> None:
    """Publish a global exactly as the master does."""
    make_loop(transport, MasterState.from_model_state(state, outer_step), publish=True)


def publish_raw(
    transport, tensors: dict[str, torch.Tensor], outer_step: int, meta_step: int | None = None
) -> None:
    """Publish a hand-made (possibly bad) global file with a matching step_count.json."""
    blob = encode(tensors, {"outer_step": str(outer_step if meta_step is None else meta_step)})
    step = json.dumps({"outer_step": outer_step, "deltas": []}).encode()
    transport.write({GLOBAL_WEIGHTS_PATH: blob, GLOBAL_STEP_PATH: step})


def put_delta(
    transport, node_id: str, local_step: int, tensors: dict[str, torch.Tensor], base: int = 0, **meta
):
    """Upload a delta as node `node_id` would; returns its payload SHA-256."""
    header = DeltaMeta(node_id, local_step, base).to_header() | meta
    blob = encode(tensors, header)
    transport.write({delta_path(node_id, local_step): blob})
    return parse_header(blob).metadata["payload_sha256"]


def worker(
    tmp_path: Path, model=None, initial=None, clock=None, spy=True, **kw
) -> tuple[DumbDiLoCo, Spy, Tiny]:
    """A started worker DumbDiLoCo on a directory repository that holds global outer step 0."""
    repo = DirectoryTransport(tmp_path / "repo")
    model = model or Tiny()
    publish(repo, initial if initial is not None else model.state_dict(), 0)
    transport = Spy(repo) if spy else repo
    coord = DumbDiLoCo(
        model,
        settings(tmp_path / "repo", **kw),
        transport,
        clock=clock or FakeClock(),
        tokens_per_step=64,
        samples_per_step=4,
    )
    coord.start()
    return coord, transport, model

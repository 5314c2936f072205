"""Deadlines that hold: a Hub call never retries past the caller's `deadline`, and a node's start-up
(a worker's wait for the first global, the master's repository creation and reads) is bounded as a
whole by startup_timeout, retries included (issue 14, finding 5).

In-process tests run HubTransport against the loopback Hub (src/diloco/testing/hub_server.py) on a virtual clock
that only the recorded `sleep` moves, so nothing depends on the machine's speed. Process tests start
`python -m diloco.train` against a loopback Hub that answers 503 to everything.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import huggingface_hub.utils
import pytest

from diloco.dumb_diloco.store.transport import HubTransport, RetryPolicy, TransientError, deadline, time_left

pytestmark = pytest.mark.usefixtures("no_network")

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "hf_DeadlineFakeTokenNeverLogged0123456789"
ALWAYS = 10**6  # fail_next(ALWAYS): every request fails


class VirtualTime:
    """A clock that only `sleep` moves: a request takes no time, a backoff exactly what it asked for."""

    def __init__(self) -> None:
        self.now, self.sleeps = 1000.0, []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _hub(t: VirtualTime, *, create: bool = False, **kw) -> HubTransport:
    kw.setdefault("retry", RetryPolicy())  # the defaults: 8 attempts, 1 s base, 60 s max delay, 900 s
    return HubTransport("org/run", create=create, rng=random.Random(0), sleep=t.sleep, clock=t.clock, **kw)


CALLS = {
    "create repository": lambda t: _hub(t, create=True),
    "read repository revision": lambda t: _hub(t).revision(),
    "read 'a.bin'": lambda t: _hub(t).read("a.bin"),
    "list": lambda t: _hub(t).list("nodes"),
    "commit": lambda t: _hub(t).write({"a.bin": b"1"}),
}


@pytest.fixture
def client_sleeps(monkeypatch) -> list[float]:
    """huggingface_hub retries some requests itself (http_backoff: a 5xx is retried 5 times after 1, 2, 4, 8
    and 8 s) with time.sleep: here those waits are recorded, not slept (they took 69 s of a test each).
    What the tests check, HubTransport's own retries and deadline, runs on VirtualTime as before."""
    import huggingface_hub.utils._http as http

    slept: list[float] = []

    class ClientTime:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            slept.append(seconds)

    monkeypatch.setattr(http, "time", ClientTime())
    return slept


@pytest.mark.parametrize("what", CALLS)
def test_retries_stop_before_the_deadline(hub_server, client_sleeps, what):
    t = VirtualTime()
    hub_server.fail_next(ALWAYS, status=503)
    with deadline(t.now + 5.0, "start-up"), pytest.raises(TransientError) as info:
        CALLS[what](t)
    message = str(info.value)
    assert message.startswith(what) and "would pass the start-up deadline" in message and "503" in message
    assert "\n" not in message
    # without the deadline the backoff would be ~1 + 2 + 4 + 8 + 16 + 32 + 60 s (halves at the least)
    assert len(t.sleeps) >= 1 and sum(t.sleeps) <= 5.0, t.sleeps


def test_without_a_deadline_the_retry_policy_runs_in_full(hub_server):
    t = VirtualTime()
    hub_server.fail_next(ALWAYS, status=503)
    with pytest.raises(TransientError, match=r"gave up after 8 attempt\(s\)"):
        _hub(t).revision()
    assert len(t.sleeps) == 7 and sum(t.sleeps) > 60


def test_no_attempt_starts_after_the_deadline(hub_server):
    t = VirtualTime()
    hub = _hub(t, create=True)
    before = sum(hub_server.counts.values())
    with deadline(t.now, "start-up"), pytest.raises(TransientError, match="not tried, the start-up deadline"):
        hub.revision()
    assert sum(hub_server.counts.values()) == before and t.sleeps == []


def test_request_timeouts_are_clipped_to_the_time_left(hub_server, monkeypatch):
    t = VirtualTime()
    hub = _hub(t, create=True, timeout_s=60.0)
    hub.write({"a.bin": b"payload"})
    seen: list[tuple[str, float]] = []
    repo_info, session = hub.api.repo_info, huggingface_hub.utils.get_session()

    def recording_repo_info(*args, timeout, **kw):
        seen.append(("repo_info", timeout))
        return repo_info(*args, timeout=timeout, **kw)

    class RecordingSession:
        def stream(self, *args, timeout, **kw):
            seen.append(("GET", timeout))
            return session.stream(*args, timeout=timeout, **kw)

    monkeypatch.setattr(hub.api, "repo_info", recording_repo_info)
    monkeypatch.setattr(huggingface_hub.utils, "get_session", RecordingSession)
    hub.revision(), hub.read("a.bin")
    with deadline(t.now + 2.5):
        hub.revision(), hub.read("a.bin")
    assert seen == [("repo_info", 60.0), ("GET", 60.0), ("repo_info", 2.5), ("GET", 2.5)]


def test_a_deadline_inside_another_keeps_the_earlier_and_is_not_inherited_by_threads():
    assert time_left() is None
    now = time.monotonic()
    with deadline(now + 10):
        with deadline(now + 100):
            assert time_left() <= 10
        with deadline(now + 1):
            assert time_left() <= 1
        in_thread = []
        worker = threading.Thread(target=lambda: in_thread.append(time_left()))
        worker.start(), worker.join()
        assert in_thread == [None]  # the master's outer loop and the lanes are not bounded by start-up
    assert time_left() is None


# ============================================================================ processes

NODE = [
    "model=micro",
    "data=sample",
    "data.seq_len=64",
    "train.batch_size=4",
    "train.micro_batch_size=4",
    "train.max_steps=10",
    "optim.total_steps=10",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.progress=false",
    "device=cpu",
    "wandb.mode=disabled",
    "distributed=dumb_diloco",
    "distributed.repo_id=org/unreachable",
    "distributed.startup_timeout=3",
    "distributed.request_timeout=5",
]
STARTUP_TIMEOUT, REQUEST_TIMEOUT = 3, 5
# the old behaviour: each start-up attempt ran the whole retry policy (at least 61.5 s of backoff)
BOUND = STARTUP_TIMEOUT + REQUEST_TIMEOUT + 15  # s, from the node's first request to its exit


@pytest.mark.alone  # a bound in seconds: run with the machine to itself (issue 54)
@pytest.mark.slow
@pytest.mark.parametrize("role", ["worker", "master"])
def test_a_node_that_cannot_reach_the_hub_fails_within_startup_timeout(tmp_path, role):
    from diloco.testing.hub_server import HubServer

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    with HubServer(token=TOKEN) as server:
        server.fail_next(ALWAYS, status=503)
        env |= {
            "HF_ENDPOINT": server.url,
            "HF_TOKEN": TOKEN,
            "HF_HOME": str(tmp_path / "hf_home"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "WANDB_MODE": "disabled",
        }
        cmd = [
            *(sys.executable, "-m", "diloco.train", *NODE),
            *(f"distributed.role={role}", f"distributed.node_id={role}-1"),
            *(
                f"distributed.state_dir={tmp_path / 'state'}",
                f"out_dir={tmp_path / 'runs'}",
                f"run_name={role}",
            ),
        ]
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the {role} was still waiting after 120 s (startup_timeout={STARTUP_TIMEOUT})")
        exited = time.monotonic()
        first = min(r["time"] for r in server.requests)
        kinds = {r["kind"] for r in server.requests}
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1, out[-4000:]
    expected = "cannot open org/unreachable" if role == "master" else "no global model in org/unreachable"
    assert expected in errors[0] and "503" in errors[0], errors[0]
    assert TOKEN not in out
    assert kinds == ({"repo_create"} if role == "master" else {"repo_info"})
    print(f"\n[{role}] first request to exit: {exited - first:.1f}s; {errors[0]}")
    assert exited - first < BOUND

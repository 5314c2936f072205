"""Fail fast (issue 12): a refused token (HTTP 401/403) or a repository gone is not retried for ever. A
node stops with one line instead of training alone and ending "completed"; a master whose outer loop met
one fails its run. Each test fails on the old behaviour (retried, carried, logged, ignored).
"""

from __future__ import annotations

import pytest
import torch
from dumb_helpers import Spy, Tiny, g, put_delta, settings, worker
from polling import wait_until

from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import DumbDiLoCoError
from diloco.dumb_diloco.store.transport import DirectoryTransport, HubTransport, PermanentError

pytestmark = pytest.mark.usefixtures("no_network")
TOKEN = "hf_FailFastTestToken0123456789"


def test_a_refused_commit_is_not_retried(tmp_path):
    from diloco.testing.hub_server import HubServer

    with HubServer(token=TOKEN) as server:
        hub = HubTransport("org/run", token=TOKEN, endpoint=server.url, sleep=lambda s: None)
        server.fail_next(5, status=403, kinds="commit")
        server.reset_counters()
        with pytest.raises(PermanentError, match="403"):
            hub.write({"a.bin": b"x"})
        assert server.counts["commit"] == 1  # one attempt, not the retry policy's 8


class Refusing(Spy):
    """Writes refused as a revoked token's would be."""

    def __init__(self, inner):
        super().__init__(inner)
        self.refuse = False

    def write(self, files, delete=(), message="", parent_revision=None):
        if self.refuse:
            raise PermanentError("commit refused: HTTP 403 Forbidden")
        return super().write(files, delete, message, parent_revision)


def test_a_worker_whose_token_cannot_write_stops_with_one_line(tmp_path):
    coord, spy, model = worker(tmp_path, spy=False, inner_steps=2)
    coord.transport = refusing = Refusing(coord.transport)
    refusing.refuse = True
    coord.on_step(1)
    with pytest.raises(DumbDiLoCoError, match="retrying will not fix: PermanentError"):
        coord.on_step(2)  # the boundary's upload is refused: the node stops, it does not carry the delta
    coord.close()


def test_a_master_whose_outer_loop_met_a_refused_token_fails_its_run(tmp_path):
    repo = Refusing(DirectoryTransport(tmp_path / "repo"))
    s = settings(tmp_path / "repo", role="master", node_id="m", poll_interval=0.01)
    coord = DumbDiLoCo(Tiny(), s, repo)
    coord.start()
    repo.refuse = True  # the publication of the round with w's delta is refused
    put_delta(repo.inner, "w", 3, g(1.0))
    wait_until(lambda: coord.outer.dead, "the outer loop to stop")
    with torch.no_grad():
        coord.model.w.add_(0.1)
    with pytest.raises(DumbDiLoCoError, match="the outer loop stopped: PermanentError"):
        coord.on_step(1)
    coord.close()

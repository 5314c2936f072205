"""Evaluate what was averaged: DiLoCo's evaluations see the global weights, and a DumbDiLoCo master's
final checkpoint holds the model it evaluated (the final global)."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_utils import compose_cfg, final_weights, train

from diloco.config import ConfigError, validate
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.dumb_diloco.wire.repo_paths import GLOBAL_WEIGHTS_PATH
from diloco.dumb_diloco.wire.tensor_format import decode

pytestmark = pytest.mark.usefixtures("no_network")

DILOCO = ["distributed=diloco", "distributed.cosine_sample_size=0", "distributed.inner_steps=2"]


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_diloco_refuses_periodic_evaluations_between_outer_steps():
    with pytest.raises(
        ConfigError, match="train.eval_every=3 is not a multiple of distributed.inner_steps=2"
    ):
        validate(compose_cfg(["model=micro", "data=sample", *DILOCO, "train.eval_every=3"]))


def test_a_diloco_run_ending_mid_round_evaluates_the_last_global(tmp_path):
    """Steps 3 of H=2 end one step into a round: the model to report is the global of step 2, so the
    final evaluation equals that of a run stopped at step 2; the live (local) weights are put back, so
    the checkpoint still resumes exactly (test_diloco's mid-round resume)."""
    at_boundary = train(tmp_path, "train.max_steps=2", *DILOCO, name="two")
    mid_round = train(tmp_path, "train.max_steps=3", *DILOCO, name="three")
    assert _summary(mid_round)["final_eval_loss"] == _summary(at_boundary)["final_eval_loss"]
    w2, w3 = final_weights(at_boundary), final_weights(mid_round)
    assert not all(torch.equal(w2[k], w3[k]) for k in w2)  # step 3's local weights, restored after eval


def test_a_dumb_diloco_masters_final_checkpoint_is_the_model_it_evaluated(tmp_path):
    repo = tmp_path / "repo"
    run_dir = train(
        tmp_path,
        "train.max_steps=10",
        "distributed=dumb_diloco",
        "distributed.role=master",
        "distributed.node_id=master-1",
        f"distributed.repo_id={repo}",
        f"distributed.state_dir={tmp_path / 'state'}",
        "distributed.inner_steps=5",
        "distributed.poll_interval=0.1",
        name="master",
    )
    published, _ = decode(DirectoryTransport(repo, create=False).read(GLOBAL_WEIGHTS_PATH), max_bytes=2**26)
    saved = final_weights(run_dir)
    assert set(saved) == set(published)
    assert all(torch.equal(saved[k], published[k]) for k in published)

"""W&B resumes honestly: after a resume from step N its history continues from N, like metrics.jsonl.

Read from the offline run files, as far as offline W&B allows: the resumed segment is the same run,
rewound to the checkpoint's step (`resume_from`, which `wandb sync` sends as the branch point), and it
holds exactly the steps after N; the first segment keeps the steps it logged."""

from __future__ import annotations

import time

import pytest
from trainer_utils import read_metrics, train
from wandb_files import history, run_record

pytestmark = pytest.mark.usefixtures("no_network")


def test_a_resumed_run_rewinds_wandb_to_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    opts = ("wandb.mode=null", "optim.total_steps=6")
    run_dir = train(tmp_path, "train.max_steps=3", *opts, name="wb")  # checkpoint at step 3 (the end)
    # W&B names an offline segment's folder by the second it started: make sure the next one is new
    ended = int(time.time())
    while int(time.time()) <= ended:
        time.sleep(0.05)
    train(tmp_path, "train.max_steps=6", *opts, name="wb")  # resumes from step 3
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    first, second = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert run_record(first).run_id == run_record(second).run_id == run_id
    assert not run_record(first).branch_point.run
    branch = run_record(second).branch_point
    assert (branch.run, branch.metric, branch.value) == (run_id, "_step", 3)
    steps = lambda path: sorted({row["_step"] for row in history(path)})  # noqa: E731
    assert steps(first) == [1, 2, 3]
    assert steps(second) == [4, 5, 6]
    assert [r["step"] for r in read_metrics(run_dir) if "Loss" in r] == [1, 2, 3, 4, 5, 6]

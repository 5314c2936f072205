"""The single-process trainer: deterministic, resumes bit for bit, records what it did, fails clearly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from trainer_utils import SMALL, final_weights, read_metrics, train

from diloco.checkpoint import CheckpointError
from diloco.config import ConfigError

TIMING = {"tokens_per_second", "time_taken"}


def _deterministic(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_same_seed_same_metrics_and_weights(tmp_path):
    a = train(tmp_path, "train.max_steps=6", name="a")
    b = train(tmp_path, "train.max_steps=6", name="b")
    assert _deterministic(read_metrics(a)) == _deterministic(read_metrics(b))
    wa, wb = final_weights(a), final_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    c = train(tmp_path, "train.max_steps=6", "seed=7", name="c")
    assert read_metrics(c)[0]["Loss"] != read_metrics(a)[0]["Loss"]
    # the seed orders the data too: the same initial weights on another order see another first batch
    d = train(tmp_path, "train.max_steps=1", "data.shuffle_seed=7", name="d")
    assert read_metrics(d)[0]["Loss"] != read_metrics(a)[0]["Loss"]


@pytest.mark.parametrize(
    ("packing", "shuffle_seed"), [("false", "${seed}"), ("true", "${seed}"), ("true", "7"), ("true", "null")]
)
def test_resumed_run_equals_uninterrupted_run_bit_for_bit(tmp_path, packing, shuffle_seed):
    """Each data order (the run's seed, another one, the files' own) resumes exactly."""
    data = [f"data.packing={packing}", f"data.shuffle_seed={shuffle_seed}", "data.shuffle_buffer=64"]
    full = train(tmp_path, "train.max_steps=10", *data, name="full")
    # the same run, stopped after step 4 (it checkpoints at its end) and restarted with max_steps=10
    part = train(tmp_path, "train.max_steps=4", *data, name="part")
    train(tmp_path, "train.max_steps=10", *data, name="part")
    w_full, w_part = final_weights(full), final_weights(part)
    assert all(torch.equal(w_full[k], w_part[k]) for k in w_full)

    # and the training records read as one uninterrupted run
    def train_records(d):
        return _deterministic(r for r in read_metrics(d) if "Loss" in r)

    assert train_records(full) == train_records(part)


def test_run_records_metrics_and_summary(tmp_path):
    run_dir = train(tmp_path, "train.max_steps=4", "train.eval_every=2", name="rec")
    records = read_metrics(run_dir)
    train_rec = [r for r in records if "Loss" in r]
    for key in ("Loss", "Perplexity", "lr", "step", "effective_step", "total_samples", "tokens_per_second"):
        assert key in train_rec[-1], key
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and "eval/perplexity" in evals[-1]
    assert train_rec[0]["lr"] == pytest.approx(3e-3 / 2)  # linear warmup over 2 steps
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in (
        "run_name",
        "final_eval_loss",
        "final_eval_perplexity",
        "tokens_seen",
        "wall_seconds",
        "git_commit",
        "config",
        "seed",
        "status",
    ):
        assert key in summary, key
    assert summary["status"] == "completed" and summary["tokens_seen"] == 4 * 4 * 64
    assert summary["final_eval_loss"] == evals[-1]["eval/loss"]
    assert summary["config"]["model"]["name"] == "micro"
    # the final model is better than the initial one on held-out data
    assert evals[-1]["eval/loss"] < 6.9  # ln(1024) = 6.93 is a uniform guess


def test_noniid_run_reports_per_shard_eval_loss(tmp_path):
    run_dir = train(
        tmp_path,
        "train.max_steps=2",
        "data.sharding=noniid",
        "data.shard=1",
        "data.num_shards=3",
        name="noniid",
    )
    evals = [r for r in read_metrics(run_dir) if "eval/loss" in r]
    assert all(f"eval/shard{s}/loss" in evals[-1] for s in range(3))


def test_checkpoint_of_another_model_shape_is_refused(tmp_path):
    train(tmp_path, "train.max_steps=2", name="shape")
    with pytest.raises(CheckpointError, match="does not match this run's model"):
        train(tmp_path, "train.max_steps=4", "model.num_hidden_layers=3", name="shape")


def test_tokenizer_larger_than_vocab_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="model.vocab_size=512"):
        train(tmp_path, "train.max_steps=1", "model.vocab_size=512", name="vocab")


def test_missing_data_path_is_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "diloco.train",
            *SMALL,
            f"out_dir={tmp_path}",
            "data.data_files.train=/nonexistent/c4-train.*.json.gz",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "error: data.data_files.train: no file matches /nonexistent/c4-train.*.json.gz"
    )


def test_ctrl_c_keeps_checkpoint_and_metrics(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "diloco.train",
        *SMALL,
        f"out_dir={tmp_path}",
        "run_name=sigint",
        "train.max_steps=100000",
        "optim.total_steps=100000",
        "train.checkpoint_every=5",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = tmp_path / "sigint" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:  # past step 10 (a periodic checkpoint), so the signal arrives in the training loop
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 12:
            assert time.monotonic() < deadline, "the run never reached step 12"
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    records = read_metrics(tmp_path / "sigint")  # every line parses
    last = records[-1]["step"]
    ckpt = tmp_path / "sigint" / "checkpoints" / f"step_{last:08d}"
    assert (ckpt / "meta.json").exists() and (ckpt / "rank0.pt").exists()
    summary = json.loads((tmp_path / "sigint" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == last


def test_wandb_offline_run_is_recorded_and_never_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = train(tmp_path, "train.max_steps=2", "wandb.mode=null", name="wb")
    assert (run_dir / "wandb").is_dir()
    assert read_metrics(run_dir)[-1]["step"] == 2


def test_a_token_on_the_command_line_leaves_sys_argv_and_the_records(tmp_path, monkeypatch):
    """W&B records the program's arguments (sys.argv) in its run files: a token given as an override
    is removed from them, and from the run's config.yaml, before anything is written."""
    from trainer_utils import compose_cfg

    from diloco.distributed import DistContext
    from diloco.train import record_config

    planted = "hf_plantedSECRETtoken123"
    overrides = ["distributed=dumb_diloco", f"distributed.token={planted}"]
    monkeypatch.setattr(sys, "argv", ["diloco/train.py", *overrides])
    resolved = record_config(compose_cfg(overrides), tmp_path, DistContext(), "run")
    assert planted not in " ".join(sys.argv) and "distributed.token=<redacted>" in sys.argv
    assert resolved["distributed"]["token"] == "<redacted>"
    assert planted not in (tmp_path / "config.yaml").read_text()


def test_records_parse_with_any_json_reader_nan_and_infinities_as_null_with_the_reason(tmp_path):
    """Issue 52: an interrupted run's summary.json held `"final_eval_loss": NaN`, which is not JSON."""
    import math

    from diloco.metrics import RunLogger
    from diloco.schema import WandbConfig

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a record"))

    logger = RunLogger(tmp_path, {}, WandbConfig(mode="disabled"), enabled=True, resume_step=None)
    logger.log({"Loss": math.inf, "lr": 1e-3, "grad": -math.inf, "ppl": math.nan}, step=1)
    logger.write_summary({"final_eval_loss": math.nan, "nested": {"x": [1.0, math.inf]}})
    logger.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert strict(line) == {
        "step": 1,
        "Loss": None,
        "Loss_nonfinite": "inf",
        "lr": 1e-3,
        "grad": None,
        "grad_nonfinite": "-inf",
        "ppl": None,
        "ppl_nonfinite": "nan",
    }
    summary = strict((tmp_path / "summary.json").read_text())
    assert summary["final_eval_loss"] is None and summary["final_eval_loss_nonfinite"] == "nan"
    assert summary["nested"] == {"x": [1.0, None]}


def test_a_run_stopped_before_its_final_evaluation_says_why_its_loss_is_null(tmp_path):
    from types import SimpleNamespace

    from diloco.train import run_summary

    cfg = SimpleNamespace(
        run_name="r", seed=1, train=SimpleNamespace(batch_size=4), data=SimpleNamespace(seq_len=8)
    )
    strategy = SimpleNamespace(num_workers=1, summary=lambda: {})
    ran = {"status": "interrupted", "step": 3, "eval_loss": float("nan"), "wall": 1.0, "inner": 0.5}
    s = run_summary(cfg, SimpleNamespace(world_size=1, device="cpu"), strategy, ran, {}, "abc", {})
    assert s["final_eval_loss"] is None and s["final_eval_perplexity"] is None
    assert s["final_eval_loss_why"] == "no final evaluation (the run ended interrupted)"


def test_activation_checkpointing_changes_no_loss(tmp_path):
    """Recomputing each decoder layer's activations in the backward gives the same gradients: the same
    losses and weights, bit for bit on CPU (issue 53)."""
    plain = train(tmp_path, "train.max_steps=4", name="plain")
    ac = train(tmp_path, "train.max_steps=4", "train.activation_checkpointing=true", name="ac")
    assert _deterministic(read_metrics(ac)) == _deterministic(read_metrics(plain))
    wa, wb = final_weights(plain), final_weights(ac)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

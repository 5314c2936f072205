"""One schema, checked first (diloco.schema + diloco.config.validate): every mode's keys are typed and
range-checked before any tokenizer, data set or model is built, and their defaults are written once."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from trainer_utils import CONFIG_DIR, compose_cfg

from diloco import schema
from diloco.config import WIRE_DTYPES, ConfigError, validate

PLACEHOLDERS = ["distributed.node_id=n1", "distributed.repo_id=/tmp/unused-repo"]


@pytest.mark.parametrize(
    ("choice", "override", "key"),
    [
        ("experiment=tiny/dumb_diloco", "distributed.poll_interval=0", "distributed.poll_interval"),
        ("experiment=tiny/dumb_diloco", "distributed.inner_steps=-3", "distributed.inner_steps"),
        ("experiment=tiny/dumb_diloco", "distributed.retry.max_attempts=0", "distributed.retry.max_attempts"),
        ("experiment=tiny/dumb_diloco", "distributed.lease_seconds=-1", "distributed.lease_seconds"),
        ("experiment=tiny/diloco_fp32", "distributed.outer_momentum=1.0", "distributed.outer_momentum"),
        ("experiment=tiny/diloco_fp32", "distributed.timeout_seconds=0", "distributed.timeout_seconds"),
        ("experiment=tiny/ddp_mx", "distributed.timeout_seconds=-5", "distributed.timeout_seconds"),
        ("experiment=tiny/diloco_fp32", "train.eval_every=15", "train.eval_every"),
        ("experiment=tiny/diloco_fp32", "train.slowdown=0.5", "train.slowdown"),
        ("experiment=tiny/diloco_fp32", "train.step_seconds=-0.1", "train.step_seconds"),
    ],
)
def test_every_modes_values_are_validated(choice, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(compose_cfg([choice, *(PLACEHOLDERS if "dumb" in choice else []), override]))


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (  # a range error: validate, after composing
            ["experiment=tiny/diloco_fp32", "distributed.outer_momentum=1.0"],
            "error: distributed.outer_momentum must be a number >= 0 and < 1, got 1.0",
        ),
        (  # a type error: found while composing (Hydra's own message is five lines and exit 1)
            ["experiment=tiny/diloco_fp32", "train.max_steps=abc"],
            "error: train.max_steps must be an integer, got 'abc'",
        ),
        (
            ["distributed=dumb_diloco", "distributed.collaborators=w1"],
            "error: distributed.collaborators must be a list, e.g. '[a,b]', got 'w1'",
        ),
    ],
)
def test_a_bad_value_stops_in_one_line_before_anything_is_built(tmp_path, overrides, line):
    proc = subprocess.run(
        [sys.executable, "-m", "diloco.train", *overrides, f"out_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [line]
    assert not any(tmp_path.iterdir())  # no run folder, no log: nothing was built


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.micro_batch_size=1.5"], "train.micro_batch_size must be an integer, got '1.5'"),
        (
            ["distributed=diloco", "distributed.nesterov=maybe"],
            "distributed.nesterov must be true or false, got 'maybe'",
        ),
        (
            ["distributed=diloco", "distributed.outer_lr=fast"],
            "distributed.outer_lr must be a number, got 'fast'",
        ),
        (["data.shard=x"], "data.shard must be an integer or null, got 'x'"),
        (["optim.betas=3"], "optim.betas must be a list, e.g. '[a,b]', got '3'"),
        (["train.max_steps=30", "hydra.run.dir=/tmp/unused"], None),  # composes: Hydra's turn
    ],
)
def test_a_type_error_on_the_command_line_names_the_key_and_the_type(overrides, message):
    from diloco.config import check_command_line

    assert check_command_line(overrides) == message


@pytest.mark.parametrize("mode", sorted(schema.DISTRIBUTED_SCHEMAS))
def test_mode_defaults_are_written_once_in_the_schema(mode):
    """configs/distributed/<mode>.yaml only pulls its schema in; the composed block is the schema's."""
    text = yaml.safe_load((Path(CONFIG_DIR) / "distributed" / f"{mode}.yaml").read_text())
    assert set(text) == {"defaults"}
    composed = OmegaConf.to_container(compose_cfg([f"distributed={mode}"]).distributed, resolve=False)
    declared = OmegaConf.to_container(OmegaConf.structured(schema.DISTRIBUTED_SCHEMAS[mode]), resolve=False)
    assert composed == declared


def test_the_dumb_diloco_runtime_settings_take_their_defaults_from_the_schema():
    from diloco.dumb_diloco.settings import Settings

    s = Settings(node_id="n1", repo_id="/tmp/r")
    for name, value in OmegaConf.to_container(OmegaConf.structured(schema.DumbDiLoCoConfig)).items():
        if name in ("node_id", "repo_id"):
            continue
        got = dataclasses.asdict(s)[name]  # nested dataclasses (retry) become dicts too
        got = list(got) if isinstance(got, tuple) else got
        got = {k: got[k] for k in value} if name == "retry" else got
        assert got == value, name


@pytest.mark.parametrize("override", ["+train.max_step=30", "+distributed.inner_step=5"])
def test_keys_outside_the_schema_are_refused_even_with_plus(override):
    with pytest.raises(Exception, match=override.split(".")[-1].split("=")[0]):
        validate(compose_cfg(["experiment=tiny/diloco_fp32", override]))


def test_wire_dtypes_named_in_the_schema_are_the_ones_diloco_implements():
    from diloco import comm, quant, sparse

    assert set(WIRE_DTYPES) == set(comm.WIRE_DTYPES) | set(quant.QUANT_BITS) | {sparse.TOPK_DTYPE}


def test_a_hand_built_block_is_typed_like_a_composed_one():
    from diloco.config import check_distributed

    with pytest.raises(ConfigError, match="distributed.inner_steps"):
        check_distributed({"mode": "diloco", "inner_steps": "ten"})
    with pytest.raises(ConfigError, match="distributed.nesterov must be true or false"):
        check_distributed({"mode": "diloco", "nesterov": "yes"})
    with pytest.raises(ConfigError, match="distributed.mode must be"):
        check_distributed({"mode": "gossip"})

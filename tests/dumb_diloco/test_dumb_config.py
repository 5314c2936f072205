"""DumbDiLoCo configuration and its place in the trainer: the spec's keys and defaults, node IDs,
roles, the token, and one in-process training run of a lone master (lifecycle step 1: the trainer
advances the scheduler before the coordinator sees the step)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from trainer_utils import compose_cfg, read_metrics, train

from diloco.config import ConfigError, validate
from diloco.distributed import DistContext, LocalTraining
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.dumb_diloco.settings import Settings
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.dumb_diloco.wire.repo_paths import GLOBAL_STEP_PATH, GLOBAL_WEIGHTS_PATH
from diloco.dumb_diloco.wire.tensor_format import decode
from diloco.train import build_strategy

pytestmark = pytest.mark.usefixtures("no_network")

SPEC_DEFAULTS = {  # the spec's "Minimal master config", key for key (role aside: see below)
    "enabled": True,
    "mode": "dumb_diloco",
    "collaborators": [],
    "token": None,
    "inner_steps": 500,
    "poll_interval": 60,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "state_dir": ".speedtronic/diloco",
    "reset_inner_optimizer": True,
    "async_delta_upload": True,
    "async_global_poll": True,
}


def test_an_interpolation_in_the_block_resolves_within_the_whole_config():
    """tiny/dumb_diloco's `state_dir: ${out_dir}/...` (the distributed block alone has no out_dir)."""
    cfg = compose_cfg(["experiment=tiny/dumb_diloco", "out_dir=/x/runs", "distributed.role=master"])
    cfg.distributed.node_id, cfg.distributed.repo_id = "m", "/x/repo"
    assert Settings.from_config(cfg.distributed).state_dir == "/x/runs/tiny-dumb-diloco-state"


def test_config_has_the_spec_keys_and_defaults():
    cfg = compose_cfg(["distributed=dumb_diloco"])
    d = OmegaConf.to_container(cfg.distributed, resolve=False)
    for key, value in SPEC_DEFAULTS.items():
        assert d[key] == value, key
    assert d["role"] == "worker"  # a forgotten role never starts a second master
    assert OmegaConf.is_missing(cfg.distributed, "node_id") and OmegaConf.is_missing(
        cfg.distributed, "repo_id"
    )
    with pytest.raises(ConfigError, match="node_id"):
        validate(cfg)


# past the specification: the value of each switch that gives the specification's behaviour
SPEC_BEHAVIOUR = {
    "min_deltas_per_round": 0,
    "staleness_weighting": False,
    "delayed_nesterov": False,
    "publish_master_state": False,
    "keep_deltas": 0,
    "lease_seconds": 0,
    "install": "replace",
    "install_when_staged": False,
    "budget": "local",
}
DOCS = Path(__file__).resolve().parents[2] / "docs" / "dumb_diloco.md"


def test_the_docs_name_every_default_that_differs_from_the_specification():
    """Issue 12: docs and code said every past-the-spec default was the spec's, while
    publish_master_state and lease_seconds default to on. The docs' line naming the exceptions, and
    the switch column of the "Past the specification" table, must match the schema."""
    d = OmegaConf.to_container(compose_cfg(["distributed=dumb_diloco"]).distributed, resolve=False)
    differ = sorted(k for k, spec in SPEC_BEHAVIOUR.items() if d[k] != spec)
    text = DOCS.read_text()
    line = next(x for x in text.splitlines() if x.startswith("Defaults that differ from the specification:"))
    assert sorted(re.findall(r"`(\w+)`", line)) == differ
    table = text[text.index("| change | the specification |") :].split("\n\n")[0]
    for key, default in re.findall(
        r"`(\w+)`[^(|]*\(`([^`]+)`", "\n".join(r.rsplit("|", 2)[-2] for r in table.splitlines()[2:])
    ):
        if key in d:
            assert d[key] == yaml.safe_load(default), key


def _block(**kw) -> dict:
    return {**SPEC_DEFAULTS, "role": "worker", "node_id": "worker-1", "repo_id": "org/run", **kw}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"node_id": "a/b"}, "not path-safe"),
        ({"node_id": "../up"}, r"'\.\.'"),
        ({"node_id": "has space"}, "not path-safe"),
        ({"node_id": "tab\tid"}, "not path-safe"),
        ({"node_id": "nl\n"}, "not path-safe"),
        ({"node_id": ""}, "non-empty"),
        ({"node_id": "x" * 65}, "at most 64"),
        ({"node_id": None}, "node_id"),
        ({"collaborators": "worker-1"}, "must be a list"),
        ({"collaborators": ["ok", "bad/id"]}, "collaborators"),
        ({"role": "boss"}, "master, worker or single"),
        ({"mode": "diloco"}, "mode"),
        ({"inner_steps": 0}, "inner_steps"),
        ({"inner_steps": 2.5}, "inner_steps"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"outer_lr": -1}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"async_delta_upload": "yes"}, "async_delta_upload"),
        ({"repo_id": ""}, "repo_id"),
        ({"retry": {"max_tries": 3}}, "retry"),
    ],
)
def test_bad_settings_are_refused_with_the_key_named(change, match):
    with pytest.raises(ConfigError, match=match):
        Settings.from_config(_block(**change))


def test_token_in_yaml_warns_about_hf_token_and_is_not_in_the_repr(caplog):
    s = Settings.from_config(_block(token="hf_SecretInYaml0123456789"))
    assert "HF_TOKEN" in caplog.text and "hf_SecretInYaml" not in caplog.text
    assert "hf_SecretInYaml" not in repr(s)


@pytest.mark.parametrize("change", [{"role": "single"}, {"enabled": False, "role": "master"}])
def test_single_role_or_disabled_trains_like_distributed_none(tmp_path, change):
    cfg = compose_cfg(
        ["distributed=dumb_diloco", "distributed.node_id=n", f"distributed.repo_id={tmp_path}/repo"]
    )
    for k, v in change.items():
        cfg.distributed[k] = v
    strategy = build_strategy(validate(cfg), DistContext(), torch.nn.Linear(2, 2), None)
    assert isinstance(strategy, LocalTraining)
    assert not (tmp_path / "repo").exists()  # no transport was opened


def test_a_node_of_two_ranks_has_one_dumb_diloco_on_its_rank_0(tmp_path):
    """Under torchrun a node is DDP over its ranks; only rank 0 holds the node that talks to the store
    (tests/dumb_diloco/node/test_dumb_ranks.py runs such nodes)."""
    from diloco.dumb_diloco.node.ranks import NodeRanks

    cfg = compose_cfg(
        ["distributed=dumb_diloco", "distributed.node_id=n", f"distributed.repo_id={tmp_path}/r"]
    )
    model = torch.nn.Linear(2, 2)
    typed_cfg = validate(cfg)
    rank0, rank1 = (build_strategy(typed_cfg, DistContext(r, 2), model, None) for r in (0, 1))
    assert isinstance(rank0, NodeRanks) and isinstance(rank0.leader, DumbDiLoCo) and rank1.leader is None


def test_lone_master_trains_publishes_and_records(tmp_path):
    """The real trainer with distributed=dumb_diloco as a master with no workers: step 1 (the trainer has
    advanced the scheduler when the coordinator sees the step), metrics and summary, the published
    repository (loadable with from_pretrained), and the token kept out of every record."""
    from transformers import LlamaForCausalLM, get_cosine_schedule_with_warmup

    secret = "hf_TokenFromYamlMustNotLeak0123456789"
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
        "distributed.async_delta_upload=false",  # v1: a boundary returns once its delta is uploaded
        f"distributed.token={secret}",
        name="lone",
    )
    # step 1: the lr logged with each boundary is the schedule's value after that step's scheduler.step()
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=3e-3)
    sched = get_cosine_schedule_with_warmup(opt, 2, 20)
    expected = {}
    for step in range(1, 11):
        opt.step()
        sched.step()
        expected[step] = sched.get_last_lr()[0]
    records = [r for r in read_metrics(run_dir) if "comm/boundary_stall_seconds" in r]
    assert [r["step"] for r in records] == [5, 10]
    for r in records:
        assert math.isclose(r["lr"], expected[r["step"]]) and r["outer_lr"] == 0.7 and "outer/step" in r
    assert records[0]["comm/bytes_uploaded"] > 0  # v1: the upload of step 5 is done when step 5 is logged
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (
        summary["comm/total_bytes"] > 0 and summary["comm/uploads"] == 2 and summary["comm/boundaries"] == 2
    )
    assert summary["dumb_diloco/role"] == "master"
    # the master's last round took the delta of step 10 before the run ended (in a round of its own, or in
    # one with the delta of step 5 if the outer thread did not poll in between: the scheduler's choice)
    transport = DirectoryTransport(repo, create=False)
    info = json.loads(transport.read(GLOBAL_STEP_PATH))
    assert summary["outer/deltas_accepted"] == 2 and 1 <= info["outer_step"] == summary["outer/rounds"] <= 2
    ledger = json.loads((tmp_path / "state" / "master-1" / "master_state.json").read_text())["ledger"]
    assert sorted((e["local_step"], e["status"]) for e in ledger) == [(5, "applied"), (10, "applied")]
    tensors, _ = decode(transport.read(GLOBAL_WEIGHTS_PATH), max_bytes=2**26)
    loaded = LlamaForCausalLM.from_pretrained(repo).state_dict()  # config.json + index beside the layout
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    # and the run's tokenizer beside it (issue 52): the published model reads text as the run did
    from transformers import AutoTokenizer

    from diloco.data import load_tokenizer

    text = "Every published global is read with the tokenizer it was trained with."
    run_tok = load_tokenizer(compose_cfg(["data=sample"]).data.tokenizer)
    assert AutoTokenizer.from_pretrained(repo)(text)["input_ids"] == run_tok(text)["input_ids"]
    # the token: warned about, never written
    log_text = (run_dir / "train.log").read_text()
    assert "HF_TOKEN" in log_text
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path

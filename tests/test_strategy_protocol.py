"""Every strategy the trainer can be given satisfies diloco.strategy.Strategy: the protocol's methods with
its parameters (names and kinds, in order) and its two data members, `name` and `num_workers`.

Two of them are cheap to build in one process (LocalTraining; DiLoCo over a SoloCollective), so they are
also checked with isinstance (the protocol is runtime_checkable); the others need a process group, a
transport or a leader, so their classes are checked member by member.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from diloco.comm import SoloCollective
from diloco.diloco import DiLoCo
from diloco.distributed import DataParallel, DistContext, LocalTraining
from diloco.dumb_diloco.node.ranks import NodeRanks
from diloco.dumb_diloco.node.strategy import DumbDiLoCo
from diloco.schema import DiLoCoConfig
from diloco.strategy import Strategy

STRATEGIES = [LocalTraining, DataParallel, DiLoCo, DumbDiLoCo, NodeRanks]
METHODS = sorted(
    n for n, member in vars(Strategy).items() if inspect.isfunction(member) and not n.startswith("_")
)
DATA_MEMBERS = ("name", "num_workers")
LISTED = [  # the lifecycle points of strategy.py's docstring, sorted
    "after_inner_step",
    "close",
    "eval_weights",
    "finish",
    "grad_sync",
    "load_state_dict",
    "progress",
    "start",
    "state_dict",
    "summary",
    "wrap",
]


def parameters(function) -> list[tuple[str, object]]:  # (name, inspect.Parameter kind)
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def declares(cls, member: str) -> bool:
    """A class attribute, or an attribute that __init__ assigns (`self.<member> = ...`)."""
    if any(member in vars(klass) for klass in cls.__mro__):
        return True
    return f"self.{member} =" in inspect.getsource(cls.__init__)


def test_the_protocol_is_what_the_docstring_lists():
    assert METHODS == LISTED
    assert tuple(Strategy.__annotations__) == DATA_MEMBERS


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda cls: cls.__name__)
def test_every_strategy_has_the_protocols_methods_and_signatures(cls):
    for method in METHODS:
        theirs = inspect.getattr_static(cls, method, None)
        assert callable(theirs), f"{cls.__name__} has no method {method}"
        ours = inspect.getattr_static(Strategy, method)
        assert parameters(theirs) == parameters(ours), f"{cls.__name__}.{method}"
    for member in DATA_MEMBERS:
        assert declares(cls, member), f"{cls.__name__} has no {member}"
    assert isinstance(cls.name, str)


def test_the_in_process_strategies_are_instances_of_the_protocol():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = DiLoCoConfig(inner_steps=2, fp16_scaling=False, bucket_size_mb=1.0, cosine_sample_size=0)
    diloco = DiLoCo(model, optimizer, SoloCollective(), config)
    try:
        for strategy in (LocalTraining(DistContext()), diloco):
            assert isinstance(strategy, Strategy), type(strategy).__name__
    finally:
        diloco.close()


def test_a_class_that_lacks_a_method_or_renames_a_parameter_fails_the_check():
    class NoClose(LocalTraining):
        close = None

    class RenamedParameter(LocalTraining):
        def progress(self, local_step: int) -> float:
            return float(local_step)

    assert not isinstance(NoClose(DistContext()), Strategy)
    with pytest.raises(AssertionError, match="NoClose has no method close"):
        test_every_strategy_has_the_protocols_methods_and_signatures(NoClose)
    with pytest.raises(AssertionError, match="RenamedParameter.progress"):
        test_every_strategy_has_the_protocols_methods_and_signatures(RenamedParameter)


DUMB = ["distributed=dumb_diloco", "distributed.node_id=n1", "distributed.repo_id={tmp}/repo"]
DUMB += ["distributed.state_dir={tmp}/state", "data.shard=0", "data.num_shards=1"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], LocalTraining),
        (["distributed=ddp"], DataParallel),
        (["distributed=diloco", "train.eval_every=0"], DiLoCo),
        ([*DUMB, "distributed.role=single"], LocalTraining),
        ([*DUMB, "distributed.role=worker"], DumbDiLoCo),
        ([*DUMB, "distributed.role=master"], DumbDiLoCo),
    ],
    ids=["none", "ddp", "diloco", "dumb-single", "dumb-worker", "dumb-master"],
)
def test_build_strategy_gives_every_mode_a_strategy_of_the_protocol(tmp_path, overrides, expected):
    """train.build_strategy, the one place that knows the modes, from what validate returned; no I/O."""
    from trainer_utils import SMALL, compose_cfg

    from diloco.config import validate
    from diloco.train import build_strategy

    overrides = [o.format(tmp=tmp_path) for o in overrides]
    cfg = validate(compose_cfg([*SMALL, f"out_dir={tmp_path}", *overrides]))
    model = torch.nn.Linear(3, 2)
    strategy = build_strategy(cfg, DistContext(), model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    try:
        assert type(strategy) is expected and isinstance(strategy, Strategy)
    finally:
        strategy.close()
    assert not (tmp_path / "repo").exists()  # the constructor opened nothing


def test_the_seams_reach_the_strategies(tmp_path):
    """build_strategy's `collective` becomes DiLoCo's cross-worker Collective; its `transport` wraps the store
    a DumbDiLoCo node opens at start()."""
    from trainer_utils import SMALL, compose_cfg

    from diloco.config import validate
    from diloco.train import build_strategy

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = validate(compose_cfg([*SMALL, "distributed=diloco", "train.eval_every=0"]))
    solo = SoloCollective()
    diloco = build_strategy(cfg, DistContext(), model, optimizer, collective=solo)
    try:
        assert diloco.cross is solo
    finally:
        diloco.close()

    wrapped = []

    def wrap(transport):
        wrapped.append(transport)
        return transport

    dumb = [o.format(tmp=tmp_path) for o in [*DUMB, "distributed.role=master"]]
    master = build_strategy(
        validate(compose_cfg([*SMALL, *dumb])), DistContext(), model, optimizer, transport=wrap
    )
    try:
        master.start()
        assert wrapped and master.transport is wrapped[0]
    finally:
        master.close()

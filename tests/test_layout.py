"""The one rule of how ranks form DiLoCo workers, as the launch plan and the process groups read it."""

from __future__ import annotations

import pytest

from diloco.errors import ConfigError
from diloco.experiments.plan import PlanError, check_run
from diloco.layout import ranks_per_worker


def test_ddp_and_a_dumb_node_are_one_worker_and_diloco_splits_by_node_or_as_configured():
    assert ranks_per_worker("ddp", 8, 4) == 8
    assert ranks_per_worker("dumb_diloco", 2, 2) == 2
    assert ranks_per_worker("diloco", 8, 4) == 4  # default: one worker per node
    assert ranks_per_worker("diloco", 8, 4, configured=2) == 2
    assert ranks_per_worker("diloco", 4, 4, configured=1) == 1
    with pytest.raises(ConfigError, match="not divisible by distributed.ranks_per_worker=3"):
        ranks_per_worker("diloco", 8, 4, configured=3)


def test_the_plan_refuses_ranks_that_do_not_split_into_workers_in_one_line():
    with pytest.raises(PlanError, match="world size 3 is not divisible by distributed.ranks_per_worker=2"):
        check_run(["experiment=tiny/diloco_fp32", "launch.gpus_per_node=3", "distributed.ranks_per_worker=2"])

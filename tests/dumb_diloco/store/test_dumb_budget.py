"""The Hub commit budget of a DumbDiLoCo run (dumb_diloco/store/budget.py; docs/dumb_diloco.md "Hub budget"):
commits per hour to one repository, by writer, worked out by hand; the paper configs under 100/hour;
a Hub plan over the Hub's 128/hour refused in one line before anything is built; the ledger folded
into the lease heartbeat. The old check counted node uploads only (no publications, lease or ledger)."""

from __future__ import annotations

import pytest
from dumb_helpers import Spy, make_loop, settings

from diloco.config import ConfigError, validate
from diloco.dumb_diloco.store.budget import (
    CommitBudget,
    PaceCheck,
    commit_budget,
    config_budget,
    pace_warning,
)
from diloco.dumb_diloco.store.transport import DirectoryTransport
from diloco.dumb_diloco.wire.repo_paths import GLOBAL_LEDGER_PATH, LEASE_PATH
from diloco.experiments.plan import PlanError, check_run, commit_budget_line, compose_experiment

PAPER = ["150m/dumb_diloco_8n_h500", "1b/dumb_diloco_4n_h125"]


def test_the_breakdown_of_a_config_worked_out_by_hand():
    # 4 nodes x 3600 s / (100 steps x 3 s) = 48 uploads; quorum 2: 24 rounds, one every 150 s; the lease
    # (300 s) is due after 100 s, seen at the poll at 120 s: one heartbeat between two publications (24);
    # 2 markers x 4 nodes + 3 master one-offs over 12,000 steps x 3 s = 10 h: 1.1; the ledger rides the lease
    b = commit_budget(4, 100, 3.0, quorum=2, poll_interval=60, lease_seconds=300, run_steps=12_000)
    assert b == CommitBudget(uploads=48.0, markers=1.1, publications=24.0, heartbeats=24.0, ledger=0.0)
    assert b.total == pytest.approx(97.1) and b.verdict() is None
    # no lease: no heartbeat, and a ledger-only write at most once a minute while rejections wait (<= 48)
    b = commit_budget(4, 100, 3.0, quorum=2, poll_interval=60, lease_seconds=0, run_steps=12_000)
    assert (b.heartbeats, b.ledger) == (0.0, 48.0)
    assert commit_budget(4, 100, 3.0, lease_seconds=0, publish_state=False).ledger == 0.0
    # no quorum: one publication per delta, but at most one per poll
    assert commit_budget(4, 100, 3.0).publications == 48.0
    assert commit_budget(8, 10, 1.0, poll_interval=60).publications == 60.0


def test_the_old_uploads_only_count_is_not_the_budget():
    # 8 nodes uploading every 300 s were 96 commits/hour for the old check (under 128: no warning); the
    # master's publications (one per delta without a quorum, at most one a minute) make it 156: refused
    b = commit_budget(8, 100, 3.0, poll_interval=60, lease_seconds=300)
    assert (b.uploads, b.publications, b.total) == (96.0, 60.0, 156.0)
    level, line = b.verdict()
    assert level == "refuse" and "156" in line and "128" in line and "\n" not in line
    # the old check's own case: 8 nodes every 180 s, 160 uploads alone
    assert commit_budget(8, 60, 3.0, quorum=8).verdict()[0] == "refuse"


def test_heartbeats_are_zero_when_publications_renew_the_lease_often_enough():
    # a publication every 600 s renews a lease of 2400 s (due after 800 s): no lease-only write
    assert commit_budget(8, 500, 1.2, quorum=8, lease_seconds=2400).heartbeats == 0.0
    # the default 300 s lease is due after 100 s (seen at the 120 s poll): 4 heartbeats per 600 s gap
    assert commit_budget(8, 500, 1.2, quorum=8, lease_seconds=300).heartbeats == pytest.approx(24.0)
    assert commit_budget(8, 500, 1.2, quorum=8, lease_seconds=0).heartbeats == 0.0


@pytest.mark.parametrize("name", PAPER)
def test_the_paper_configs_stay_under_100_commits_per_hour(name):
    cfg = compose_experiment(name)
    b = config_budget(cfg)
    assert b is not None and b.total < 100 * 0.6 and b.verdict() is None  # margin: 40% under 100
    assert b.heartbeats == 0.0 and b.ledger == 0.0
    assert cfg.distributed.min_deltas_per_round == cfg.launch.nodes
    line = commit_budget_line(cfg)
    assert line.startswith("Hub commits/hour/repo: uploads") and f"= {b.total:.1f}" in line


def test_a_hub_plan_over_the_limit_is_refused_in_one_line():
    over = ["distributed.min_deltas_per_round=0", "distributed.inner_steps=50"]  # 8 x 60/h + 60 publications
    cfg = compose_experiment(PAPER[0], over)
    with pytest.raises(PlanError) as e:  # the plan the dry run prints first, before any leg runs
        commit_budget_line(cfg)
    assert "over the Hub's limit of 128/hour" in str(e.value) and "\n" not in str(e.value)
    hub = ["experiment=" + PAPER[0], *over, "distributed.repo_id=org/run", "distributed.node_id=node-0"]
    with pytest.raises(PlanError, match="expected_step_seconds=1.19: .* over the Hub's limit") as e:
        check_run(hub)  # what launch_node.sh runs before it starts anything (the trainer's validate)
    assert "\n" not in str(e.value)
    # a shared directory has no commit limit; an unknown step time no budget
    assert "shared directory" in commit_budget_line(
        compose_experiment(PAPER[0], [*over, "distributed.repo_id=/x"])
    )
    validate(compose_experiment(PAPER[0], [*over, "distributed.repo_id=/x", "distributed.node_id=n"]))
    assert "unknown" in commit_budget_line(
        compose_experiment(PAPER[0], ["distributed.expected_step_seconds=0"])
    )
    with pytest.raises(ConfigError, match="expected_step_seconds"):
        validate(compose_experiment(PAPER[0], ["distributed.expected_step_seconds=-1", *hub[2:]]))


def test_a_node_checks_its_pace_once_between_its_first_two_boundaries():
    """At run time a node on the Hub warns once, at its second boundary, if the run at the pace it measured
    since its first would go over the limit (node.py calls this at every boundary)."""
    s = settings("/tmp/repo", inner_steps=50, min_deltas_per_round=0)  # every delta its own outer step
    assert pace_warning(s, 60.0) is not None and pace_warning(s, 3600.0) is None
    check = PaceCheck()
    assert check.boundary(s, 1000.0) is None  # the first boundary: the clock starts
    assert check.boundary(s, 1060.0) == pace_warning(s, 60.0)  # 50 steps a minute: over the limit
    assert check.boundary(s, 1061.0) is None and check.boundary(s, 1062.0) is None  # once only
    slow = PaceCheck()
    assert slow.boundary(s, 0.0) is None and slow.boundary(s, 3600.0) is None


def test_a_plan_between_100_and_128_is_warned_about():
    cfg = compose_experiment(PAPER[0], ["distributed.expected_step_seconds=0.57"])  # 101 uploads + 13 rounds
    assert "\n   warning: " in commit_budget_line(cfg) and config_budget(cfg).verdict()[0] == "warn"


def test_with_a_lease_the_ledger_waits_for_the_heartbeat_instead_of_a_commit_of_its_own(tmp_path):
    repo = Spy(DirectoryTransport(tmp_path / "repo"))
    loop, _ = make_loop(repo, momentum=0.0, lease_seconds=300)
    assert loop.publish()  # global, ledger and lease in one write
    writes = repo.count("write")
    loop.publication.cadence.ledger_dirty, loop.publication.cadence.last_ledger = (
        True,
        loop.publication.cadence.last_ledger - 120,
    )  # rejections, 2 min on
    loop.heartbeat()  # the lease is fresh: the old master wrote the ledger alone here, once a minute
    assert repo.count("write") == writes and loop.publication.cadence.ledger_dirty
    loop.publication.cadence.last_lease -= 120  # the lease is due (after 100 s): one write holds both
    loop.heartbeat()
    assert repo.count("write") == writes + 1 and not loop.publication.cadence.ledger_dirty
    assert repo.calls[-1][1] == ",".join([LEASE_PATH, GLOBAL_LEDGER_PATH])

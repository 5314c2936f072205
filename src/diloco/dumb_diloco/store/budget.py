"""The Hub commit budget of a DumbDiLoCo run: commits per hour to its one repository, by writer.

The Hub answers 429 above about 128 commits per hour per repository, and every store `write` is one
commit, so a config is planned against that limit before anything runs (docs/dumb_diloco.md, "Hub
budget"). Writers: each node's delta per boundary (every H steps, one upload whatever its ranks), its
start/end markers; the master's publication per outer round (global, step count, ledger and lease in one
write), a lease-only heartbeat when no publication renewed the lease for lease_seconds/3 (checked once per
poll), and without a lease a ledger-only write at most once per LEDGER_EVERY_S while rejections wait
(with a lease the ledger rides with the heartbeat). Pure arithmetic: no torch, no Hub.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

HUB_REPO_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a Hub `namespace/name` (else a directory)
HUB_COMMITS_PER_HOUR = 128  # the Hub's limit per repository: above it, refused
WARN_COMMITS_PER_HOUR = 100  # planned rate above this: warned (no margin left for retries and restarts)
LEDGER_EVERY_S = 60.0  # without a lease, rejections reach the published ledger within this long
ONE_OFF_PER_NODE = 2  # nodes/<id>/final.json: "running" at the start, "finished" at the end
ONE_OFF_MASTER = 3  # the lease taken at start, the first global, the final ledger and released lease


@dataclass(frozen=True)
class CommitBudget:
    """Commits per hour per repository, by writer."""

    uploads: float  # node deltas
    markers: float  # one-off writes of the run (markers, the master's first and last), amortised
    publications: float  # master: one per outer round
    heartbeats: float  # master: lease-only writes between publications
    ledger: float  # master: ledger-only writes (upper bound: every poll's rejections, once a minute)

    @property
    def total(self) -> float:
        return self.uploads + self.markers + self.publications + self.heartbeats + self.ledger

    def line(self) -> str:
        return (
            f"Hub commits/hour/repo: uploads {self.uploads:.1f} + markers {self.markers:.1f} + publications "
            f"{self.publications:.1f} + lease {self.heartbeats:.1f} + ledger {self.ledger:.1f} "
            f"= {self.total:.1f} (limit {HUB_COMMITS_PER_HOUR}, warn above {WARN_COMMITS_PER_HOUR})"
        )

    def verdict(self) -> tuple[str, str] | None:
        """("refuse" | "warn", one line) above the limit or the warning level, else None."""
        fix = "raise inner_steps or min_deltas_per_round, or use a shared directory"
        if self.total > HUB_COMMITS_PER_HOUR:
            return "refuse", (
                f"{self.total:.0f} Hub commits/hour planned for one repository, over the Hub's limit of "
                f"{HUB_COMMITS_PER_HOUR}/hour (uploads {self.uploads:.0f}, publications {self.publications:.0f}, "
                f"lease {self.heartbeats:.0f}, ledger {self.ledger:.0f}): {fix}"
            )
        if self.total > WARN_COMMITS_PER_HOUR:
            return "warn", (
                f"{self.total:.0f} Hub commits/hour planned for one repository, above {WARN_COMMITS_PER_HOUR} "
                f"(limit {HUB_COMMITS_PER_HOUR}): little margin for retries and restarts; {fix}"
            )
        return None


def commit_budget(
    nodes: int,
    inner_steps: int,
    step_seconds: float,
    *,
    quorum: int = 0,
    poll_interval: float = 60.0,
    lease_seconds: float = 0.0,
    publish_state: bool = True,
    run_steps: int = 0,
) -> CommitBudget:
    """The budget of `nodes` nodes each taking `step_seconds` per inner step and uploading every
    `inner_steps`, for a master with quorum `quorum` (0: it steps on every poll with a delta), polling
    every `poll_interval` s, with the lease `lease_seconds` (0: none); `run_steps` amortises the one-offs."""
    if nodes <= 0 or inner_steps <= 0 or step_seconds <= 0:
        raise ValueError("nodes, inner_steps and step_seconds must be positive")
    uploads = nodes * 3600.0 / (inner_steps * step_seconds)
    run_hours = run_steps * step_seconds / 3600.0
    markers = (ONE_OFF_PER_NODE * nodes + ONE_OFF_MASTER) / run_hours if run_hours > 0 else 0.0
    polls = 3600.0 / poll_interval if poll_interval > 0 else math.inf  # at most one publication a poll
    publications = min(uploads / quorum if quorum > 0 else uploads, polls)
    heartbeats = 0.0
    if lease_seconds > 0:  # due after lease_seconds/3 without a write, seen at the next poll
        every = lease_seconds / 3
        every = poll_interval * math.ceil(every / poll_interval - 1e-9) if poll_interval > 0 else every
        gap = 3600.0 / publications  # seconds between publications, each renewing the lease
        heartbeats = publications * (math.ceil(gap / every - 1e-9) - 1)
    ledger = 0.0
    if publish_state and lease_seconds <= 0:  # one per rejecting poll: bounded by the deltas and the clock
        ledger = min(uploads, 3600.0 / max(LEDGER_EVERY_S, poll_interval))
    return CommitBudget(uploads, markers, publications, heartbeats, ledger)


def config_budget(cfg: Any) -> CommitBudget | None:
    """The budget of a composed DumbDiLoCo config (launch.nodes, distributed.*, train.max_steps); None
    while `distributed.expected_step_seconds` is 0 (unknown)."""
    d = cfg.distributed
    if d.mode != "dumb_diloco" or not d.get("expected_step_seconds"):
        return None
    return commit_budget(
        int(cfg.launch.nodes),
        int(d.inner_steps),
        float(d.expected_step_seconds),
        quorum=int(d.min_deltas_per_round),
        poll_interval=float(d.poll_interval),
        lease_seconds=float(d.lease_seconds),
        publish_state=bool(d.publish_master_state),
        run_steps=int(cfg.train.max_steps),
    )


def on_hub(repo_id: Any) -> bool:
    """A Hub `namespace/name` repository, or no repository yet (the paper runs' default is the Hub)."""
    return not isinstance(repo_id, str) or not repo_id.strip() or bool(HUB_REPO_ID_RE.fullmatch(repo_id))


def pace_warning(s: Any, seconds_per_boundary: float) -> str | None:
    """A node's check at run time: the run's budget at the pace this node measured between two boundaries
    (the number of nodes is not known to a node: at least the quorum, at least 1); None if within it."""
    budget = commit_budget(
        max(1, s.min_deltas_per_round),
        s.inner_steps,
        max(seconds_per_boundary, 1e-3) / s.inner_steps,
        quorum=s.min_deltas_per_round,
        poll_interval=s.poll_interval,
        lease_seconds=s.lease_seconds,
        publish_state=s.publish_master_state,
    )
    verdict = budget.verdict()
    return verdict[1] if verdict else None


@dataclass
class PaceCheck:
    """A node's check at run time, once: at its second boundary, the budget at the pace since its first."""

    first: float | None = None
    done: bool = False

    def boundary(self, s: Any, now: float) -> str | None:
        if self.done:
            return None
        if self.first is None:
            self.first = now
            return None
        self.done = True
        return pace_warning(s, now - self.first)

"""`make check`: judge finished runs against the paper (results/reference.yaml).

    python scripts/check.py [--runs runs] [--family tiny] [--family 150m]
    python scripts/check.py --runs results/tiny      # a committed record, judged again from its summaries
    python scripts/check.py --runs runs-s1337 --runs runs-s1   # one folder per seed, judged together
    python scripts/check.py --runs results/tiny --reference results/reference.yaml   # with today's yardstick

A committed record is judged with the reference.yaml kept beside its runs (the yardstick it was made
with), so judging it again gives the verdicts its report.md shows; runs/ folders with today's.

Prints run / expected / measured / delta / verdict and exits 1 when a claim the repository makes is
contradicted: FAIL (every seed is outside its bar) or UNCERTAIN (the seeds fall on both sides, so a
seed contradicts it). Runs still missing or unfinished are PENDING, figures printed without a verdict
REPORTED, claims a family cannot test NOT TESTED: none of these fails the check. It also exits 1 when
there is nothing to judge (no run, or no check with a verdict: only PENDING, REPORTED or NOT TESTED): a
CI job never passes on an empty folder.
With several seeds (a --runs per seed), each check is measured per seed and its delta is the mean and
sample standard deviation (sd) over seeds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diloco.replication import check, markdown_table, reference_for

# how the tally names each verdict; the first three are printed even when none
VERDICTS = {
    "PASS": "passed",
    "FAIL": "failed",
    "PENDING": "pending",
    "UNCERTAIN": "uncertain (seeds on both sides)",
    "REPORTED": "reported",
    "NOT TESTED": "not tested",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--runs", type=Path, action="append", help="directory holding the run directories (one per seed)"
    )
    p.add_argument("--family", action="append", help="only these families (default: every family found)")
    p.add_argument(
        "--reference",
        type=Path,
        help="the yardstick (default: a record's own reference.yaml, the one it was made with; else "
        "results/reference.yaml)",
    )
    args = p.parse_args(argv)
    roots = args.runs or [Path("runs")]
    try:
        reference = args.reference or reference_for(roots)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    verdicts = check(roots, args.family, reference)
    if not verdicts:
        print(
            f"error: nothing to judge: no finished run with a reference under {', '.join(map(str, roots))} "
            "(run make replicate-tiny or a paper run first, or RUNS=results/tiny for the committed record)",
            file=sys.stderr,
        )
        return 1
    print(markdown_table(verdicts))
    print(f"\njudged against {reference}")
    tally = {kind: [v.id for v in verdicts if v.verdict == kind] for kind in VERDICTS}
    shown = [f"{len(ids)} {VERDICTS[k]}" for i, (k, ids) in enumerate(tally.items()) if ids or i < 3]
    print("\n" + ", ".join(shown))
    failed, uncertain = tally["FAIL"], tally["UNCERTAIN"]
    if not (tally["PASS"] or failed or uncertain):  # pending, reported and not tested judge nothing
        print(
            f"error: nothing to judge: no check under {', '.join(map(str, roots))} has a verdict "
            "(pending ones wait for runs that have not finished)",
            file=sys.stderr,
        )
        return 1
    return 1 if failed or uncertain else 0


if __name__ == "__main__":
    sys.exit(main())

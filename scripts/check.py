"""`make check`: judge finished runs against the paper (results/reference.yaml).

    python scripts/check.py [--runs runs] [--family tiny] [--family 150m]
    python scripts/check.py --runs results/tiny      # a committed record, judged again from its summaries

Prints run / expected / measured / delta / verdict and exits 1 when a finished run or claim is outside
its tolerance (runs still missing or unfinished are PENDING and do not fail the check), and when there
is nothing to judge (no run, or every verdict PENDING): a CI job never passes on an empty folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diloco.replication import REFERENCE, check, markdown_table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=Path, default=Path("runs"), help="directory holding the run directories")
    p.add_argument("--family", action="append", help="only these families (default: every family found)")
    p.add_argument("--reference", type=Path, default=REFERENCE)
    args = p.parse_args(argv)
    verdicts = check(args.runs, args.family, args.reference)
    if not verdicts:
        print(
            f"error: nothing to judge: no finished run with a reference under {args.runs}/ "
            "(run make replicate-tiny or a paper run first, or RUNS=results/tiny for the committed record)",
            file=sys.stderr,
        )
        return 1
    print(markdown_table(verdicts))
    failed = [v.id for v in verdicts if v.verdict == "FAIL"]
    pending = [v.id for v in verdicts if v.verdict == "PENDING"]
    print(
        f"\n{len(verdicts) - len(failed) - len(pending)} passed, {len(failed)} failed, {len(pending)} pending"
    )
    if len(pending) == len(verdicts):
        print(f"error: nothing to judge: every check under {args.runs}/ is pending", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

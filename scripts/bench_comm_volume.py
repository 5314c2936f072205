"""Benchmark 6 (issue #7): communication volume, analytic and measured, and the paper runs' totals.

The benchmark lives in `diloco.bench.comm_volume` (its docstring says what it measures and how to run it);
this file keeps the command the Makefile, the README and the records name.
"""

import sys

from diloco.bench.comm_volume import main

if __name__ == "__main__":
    sys.exit(main())

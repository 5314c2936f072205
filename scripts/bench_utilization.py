"""Benchmark 5 (issue #7): compute utilization of DiLoCo and DumbDiLoCo when the network is slow.

The benchmark lives in `diloco.bench.utilization` (its docstring says what it measures and how to run it);
this file keeps the command the Makefile, the README and the records name.
"""

import sys

from diloco.bench.utilization import main

if __name__ == "__main__":
    sys.exit(main())

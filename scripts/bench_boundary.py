"""Benchmark 2 (issue #7): how long DumbDiLoCo blocks the training thread at an inner boundary.

The benchmark lives in `diloco.bench.boundary` (its docstring says what it measures and how to run it);
this file keeps the command the Makefile, the README and the records name.
"""

import sys

from diloco.bench.boundary import main

if __name__ == "__main__":
    sys.exit(main())

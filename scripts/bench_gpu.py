"""Benchmark 7 (issue #7): the 150M shape on one GPU: tokens/s, model FLOPs utilization, outer step.

The benchmark lives in `diloco.bench.gpu` (its docstring says what it measures and how to run it);
this file keeps the command the Makefile, the README and the records name.
"""

import sys

from diloco.bench.gpu import main

if __name__ == "__main__":
    sys.exit(main())

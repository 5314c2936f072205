"""Benchmark 1 (issue #7): the synchronous DiLoCo outer step against this machine's memory bandwidth.

The benchmark lives in `diloco.bench.outer_step` (its docstring says what it measures and how to run it);
this file keeps the command the Makefile, the README and the records name.
"""

import sys

from diloco.bench.outer_step import main

if __name__ == "__main__":
    sys.exit(main())

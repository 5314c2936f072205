"""Benchmark 3 (issue #7): the DumbDiLoCo wire format against a plain file write/read of the same bytes.

The benchmark lives in `diloco.bench.wire` (its docstring says what it measures and how to run it);
this file keeps the command the Makefile, the README and the records name.
"""

import sys

from diloco.bench.wire import main

if __name__ == "__main__":
    sys.exit(main())

"""Benchmark 4 (issue #7): tokens/s of the project's trainer against a minimal plain PyTorch loop.

The benchmark lives in `diloco.bench.trainer` (its docstring says what it measures and how to run it);
this file keeps the command the Makefile, the README and the records name.
"""

import sys

from diloco.bench.trainer import main

if __name__ == "__main__":
    sys.exit(main())

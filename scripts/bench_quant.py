"""Benchmark (issues #13, #32): int8 / 4-bit / topk2 encoding with error feedback against memory bandwidth.

The benchmark lives in `diloco.bench.quant` (its docstring says what it measures and how to run it);
this file keeps the command the Makefile, the README and the records name.
"""

import sys

from diloco.bench.quant import main

if __name__ == "__main__":
    sys.exit(main())

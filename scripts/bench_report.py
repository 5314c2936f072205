"""Write results/bench/README.md from the benchmarks' JSON records (`make bench` runs it last).

The benchmark lives in `diloco.bench.report` (its docstring says what it measures and how to run it);
this file keeps the command the Makefile, the README and the records name.
"""

import sys

from diloco.bench.report import main

if __name__ == "__main__":
    sys.exit(main())

"""Issue 12 (\"Bounded memory\", \"Fast aggregation\"): the DumbDiLoCo master's round over 8 pending deltas.

The benchmark lives in `diloco.bench.aggregation` (its docstring says what it measures and how to run it);
this file keeps the command the Makefile, the README and the records name.
"""

import sys

from diloco.bench.aggregation import main

if __name__ == "__main__":
    sys.exit(main())

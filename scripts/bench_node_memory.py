"""Issue 12 (\"Bounded memory\"): the model-sized CPU buffers a DumbDiLoCo worker node holds around a v2

The benchmark lives in `diloco.bench.node_memory` (its docstring says what it measures and how to run it);
this file keeps the command the Makefile, the README and the records name.
"""

import sys

from diloco.bench.node_memory import main

if __name__ == "__main__":
    sys.exit(main())

"""`make ladder-law` (issue 33): 4x-batch DDP against 4-worker DiLoCo at three sizes in the law regime.

The study lives in `diloco.experiments.studies.ladder_law` (its docstring says what it runs and
records, and how); this file keeps the command the Makefile, the README and the records
name.
"""

import sys

from diloco.experiments.studies.ladder_law import main

if __name__ == "__main__":
    sys.exit(main())

"""`make budget-law` (issue 42): DiLoCo against 4x DDP at 0.25x-2x the token budget, full schedules.

The study lives in `diloco.experiments.studies.budget_law` (its docstring says what it runs and
records, and how); this file keeps the command the Makefile, the README and the records
name.
"""

import sys

from diloco.experiments.studies.budget_law import main

if __name__ == "__main__":
    sys.exit(main())

"""`make ladder-controlled` (issue 42): DiLoCo against 4x DDP at three sizes with equal tokens per
non-embedding parameter and equal global batch, inner lr tuned per rung and method, 3 report seeds.

The study lives in `diloco.experiments.studies.ladder_controlled` (its docstring says what it runs and
records, and how; its grid is configs/studies/ladder_controlled.yaml); this file keeps the command the
Makefile, the README and the records name.
"""

import sys

from diloco.experiments.studies.ladder_controlled import main

if __name__ == "__main__":
    sys.exit(main())
